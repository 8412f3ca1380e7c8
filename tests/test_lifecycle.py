"""No process outlives its run: after every kind of stop, the run's processes are counted.

Every process of a run carries `MILLSTREAM_RUN=<run dir>` in its environment, inherited by what
it spawns (vLLM's EngineCore and Worker too), so `run_processes` finds them all, however deep.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import MILLSTREAM, ROOT, start_run

from millstream.shared.process.lifecycle import run_processes
from millstream.shared.process.runtime import free_port

pytestmark = pytest.mark.real


def wait_gone(
    what: Any, timeout_s: float = 60, find: Callable[[Any], list[int]] = run_processes
) -> list[int]:
    """What `find(what)` still finds alive after waiting up to `timeout_s` for it to end."""
    deadline = time.monotonic() + timeout_s
    while (left := find(what)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def titles(pids: list[int]) -> set[bytes]:
    """Process titles (vLLM names its processes VLLM::EngineCore, VLLM::Worker)."""
    return {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in pids}


def synthetic_run(tiny_model_dir: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """A synthetic-actor run that trains until stopped, returned once it trains."""
    proc = start_run(
        run_dir,
        "actor.kind=synthetic",
        f"model.path={tiny_model_dir}",
        "train.steps=1000",
        "train.group_size=4",
        "train.groups_per_batch=2",
        *overrides,
    )
    assert len(run_processes(run_dir)) >= 3  # actor, learner, envpool (and their children)
    return proc


def test_kill_9_of_the_launcher_leaves_no_process_vllm_children_included(tiny_model_dir, tmp_path):
    """The launcher starts its own vLLM actor here: EngineCore and Worker must go too. It dies
    as soon as both exist, while the engine still loads: every role is up by then (the learner
    in about 10 s, the Worker after two starts of Python with vLLM, about 25 s)."""
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        f"model.path={tiny_model_dir}",
        "train.steps=1000",
        "train.group_size=4",
        "train.groups_per_batch=2",
        until="millstream run: ",
    )
    engine = {b"VLLM::EngineCore", b"VLLM::Worker"}
    learner_log = run_dir / "logs" / "learner.log"

    def learner_watches() -> bool:  # its first line comes after it started watching its parent
        text = learner_log.read_text() if learner_log.exists() else ""
        return "learner: on cores" in text or "weight group" in text

    deadline = time.monotonic() + 300
    while not (engine <= titles(run_processes(run_dir)) and learner_watches()):
        assert time.monotonic() < deadline, f"{titles(run_processes(run_dir))}: no engine or learner"
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    # Each role notices its launcher is gone and stops, the actor with its engine.
    assert wait_gone(run_dir) == []
    assert "the launcher (pid" in (run_dir / "logs" / "learner.log").read_text()


def test_sigterm_to_the_launcher_stops_every_process(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = synthetic_run(tiny_model_dir, run_dir, "learner.checkpoint_every=1")
    while not (run_dir / "checkpoints" / "latest").exists():
        time.sleep(0.1)
    proc.terminate()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted: stopping every process" in out
    assert "resume with: millstream run run.resume=" in out
    assert wait_gone(run_dir, 10) == []


def test_a_role_that_dies_stops_the_run_naming_it_and_how_to_resume(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = synthetic_run(tiny_model_dir, run_dir, "learner.checkpoint_every=1", "run.max_restarts=0")
    while not (run_dir / "checkpoints" / "latest").exists():
        time.sleep(0.1)
    os.kill(int((run_dir / "envpool-0.pid").read_text()), signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "envpool-0 exited early, stopping the run: stopped by a signal" in out
    assert f"resume with: millstream run run.resume={run_dir.resolve()}" in out
    assert wait_gone(run_dir, 10) == []


def test_a_crashing_role_is_reported_by_its_cause_not_its_traceback(tiny_model_dir, tmp_path):
    """The actor fails at start (its ipc path's folder does not exist: not a failure the launcher
    classes as repeating, so it is retried once); the launcher names the error."""
    proc = subprocess.run(
        [
            *MILLSTREAM,
            "run",
            f"run.dir={tmp_path / 'run'}",
            "actor.kind=synthetic",
            f"model.path={tiny_model_dir}",
            f"actor.address=ipc://{tmp_path / 'no-such-folder' / 'actor'}",
            "run.max_restarts=1",
            "run.restart_backoff_s=0.1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    out = proc.stdout
    assert "actor died (ZMQError: No such file or directory" in out and "restarting it in 0.1s" in out
    assert "actor exited early, stopping the run (after 1 restarts): ZMQError: No such file" in out
    assert wait_gone(tmp_path / "run", 10) == []


def test_a_role_failing_as_every_restart_would_is_not_retried(tmp_path):
    """A role whose address is taken (after the launcher's check: another process got there
    first) exits 78 with the cause written down, and the healer stops the run at once."""
    import zmq

    from millstream.shared.config import load_config
    from millstream.shared.launch.healing import Healer
    from millstream.shared.process.runtime import SETUP_FAILED, exit_file

    taken = f"tcp://127.0.0.1:{free_port()}"
    blocker = zmq.Context.instance().socket(zmq.ROUTER)
    blocker.bind(taken)
    (tmp_path / "logs").mkdir()
    body = (
        "import zmq\n"
        "from millstream.shared.process.runtime import run_role\n"
        "def body(cfg, ns):\n"
        f"    zmq.Context.instance().socket(zmq.ROUTER).bind({taken!r})\n"
        f"run_role('actor', body, ['run.dir={tmp_path}'])\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", body],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, MILLSTREAM_NAME="actor"),
        )
    finally:
        blocker.close(0)
    assert proc.returncode == SETUP_FAILED, proc.stderr
    assert "Address already in use" in exit_file(tmp_path, "actor").read_text()
    healer = Healer(load_config(None, ["run.max_restarts=3"]), tmp_path)
    decision = healer.on_exit("actor", time.monotonic(), SETUP_FAILED)
    assert not decision.restart and decision.repeats and healer.used == {}
    assert healer.on_exit("actor", time.monotonic(), 1).restart  # an ordinary crash is retried


def test_a_role_exits_with_its_status_its_output_and_exit_handlers_but_no_teardown(tmp_path):
    """`run_role` ends the process with `os._exit` (shared/process/runtime.py `exit_now`): its
    status, what it printed (buffered, to a pipe), its log lines and its exit handlers survive;
    the interpreter's teardown, which would wait for a thread a library left running (and free
    torch module by module), does not happen."""
    body = (
        "import atexit, logging, threading, time\n"
        "from millstream.shared.process.runtime import run_role\n"
        "def left_running():\n"
        "    time.sleep(5)\n"
        f"    open({str(tmp_path / 'waited')!r}, 'w').close()\n"
        "def body(cfg, ns):\n"
        f"    atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').close())\n"
        "    threading.Thread(target=left_running).start()\n"
        "    print('printed, not flushed', end='')\n"
        "    logging.getLogger('actor').warning('logged')\n"
        "    return 7\n"
        f"run_role('actor', body, ['run.dir={tmp_path}'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", body], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "printed, not flushed"
    assert "logged" in proc.stderr
    assert (tmp_path / "atexit").exists()
    assert not (tmp_path / "waited").exists()


@pytest.mark.real
def test_a_run_ends_cleanly_at_train_max_minutes(tiny_model_dir, tmp_path):
    """A time-boxed run (an allocation's limit, a soak) ends as at train.steps: the last
    episodes collected, a final checkpoint, a summary that adds up, every process gone."""
    import orjson

    run_dir = tmp_path / "run"
    proc = synthetic_run(tiny_model_dir, run_dir, "train.max_minutes=0.25")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["accounting_ok"] is True and 0 < summary["version"] < 1000
    assert (run_dir / "checkpoints" / f"step_{summary['version']:06d}").is_dir()
    assert run_processes(run_dir) == []
