"""The vLLM EngineCore's busy loop yields to other threads on a CPU box
(shared/process/enginecore.py): the priority follows the config, and every thread of each
EngineCore process under a root is lowered, nothing else. The real actor's own EngineCore is
checked in tests/test_actor.py."""

import os
import subprocess
import sys

import pytest

from millstream.shared.config import load_config
from millstream.shared.process.enginecore import LOW, engine_core_nice, lower_engine_cores

#: A process titled as vLLM titles its processes, with a second thread, that waits to be killed.
TITLED = (
    "import os, sys, threading, time, setproctitle\n"
    "setproctitle.setproctitle(sys.argv[1])\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "os.write(1, b'up\\n')  # one write: the two processes share a pipe\n"
    "time.sleep(60)\n"
)


#: A process (in a group of its own) that starts one of those per title and says their pids.
PARENT = (
    "import os, subprocess, sys, time\n"
    "os.setpgid(0, 0)\n"
    f"titled = {TITLED!r}\n"
    "for title in ('VLLM::EngineCore', 'VLLM::Worker'):\n"
    "    child = subprocess.Popen([sys.executable, '-c', titled, title])\n"
    "    os.write(1, f'{title} {child.pid}\\n'.encode())\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("millstream.shared.process.cpus.has_gpu", lambda: False)


def test_the_priority_follows_the_config(on_cpu, monkeypatch):
    assert engine_core_nice(load_config(None, [])) == LOW  # vLLM on CPU
    assert engine_core_nice(load_config(None, ["actor.engine_core_priority=normal"])) is None
    assert engine_core_nice(load_config(None, ["actor.kind=synthetic"])) is None  # no EngineCore
    assert engine_core_nice(load_config(None, ["actor.device=cuda"])) is None
    assert engine_core_nice(load_config(None, ["actor.device=cuda", "actor.engine_core_priority=low"])) == LOW
    monkeypatch.setattr("millstream.shared.process.cpus.has_gpu", lambda: True)
    assert engine_core_nice(load_config(None, [])) is None  # device=auto on a GPU machine


def test_every_thread_of_each_engine_core_is_lowered_and_nothing_else():
    """Under this test's own root (the session's real actor is this process's child too)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        lines = [parent.stdout.readline().split() for _ in range(4)]  # in any order
        pids = {title: int(pid) for title, pid in (line for line in lines if len(line) == 2)}
        assert len(pids) == 2 and lines.count(["up"]) == 2, lines
        lowered = lower_engine_cores(LOW, root=parent.pid)
        core, worker = pids["VLLM::EngineCore"], pids["VLLM::Worker"]
        assert lowered == [core]
        nice = {
            pid: {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
            for pid in (core, worker)
        }
        assert nice == {core: {LOW}, worker: {os.getpriority(os.PRIO_PROCESS, 0)}}
        assert len(os.listdir(f"/proc/{core}/task")) == 2  # both of its threads
        assert lower_engine_cores(LOW, root=worker) == []  # none under another root
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(timeout=10)
