"""Shared fixtures: the tiny model, and ONE real vLLM actor for the whole test session.

`synthetic` is the synthetic actor (a timing model, no vLLM), for envpool tests at scale.

The actor is started through its real entry point (`python -m millstream.actor`), exactly as the launcher
starts it, and reused by every test that needs generation; end-to-end runs attach to it with
`actor.connect=...` (a new learner session re-attaches and pushes its own weights first, so runs
do not see each other's weights). Starting vLLM costs ~1 minute here, hence once per session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from millstream.shared.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from millstream.shared.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0))


class RunningActor:
    def __init__(self, address: str, proc: subprocess.Popen, log: Path, model_dir: str) -> None:
        self.address = address
        self.proc = proc
        self.log = log
        self.model_dir = model_dir


@pytest.fixture(scope="session")
def actor(tiny_model_dir, tmp_path_factory) -> RunningActor:
    work = tmp_path_factory.mktemp("actor")
    ready, log = work / "ready.json", work / "actor.log"
    address = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "millstream.actor", "--ready-file", str(ready), f"model.path={tiny_model_dir}",
           f"actor.address={address}", "actor.max_num_seqs=64", "learner.sync_timeout_s=120"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"actor exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"actor not ready in 600s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    assert orjson.loads(ready.read_bytes())["address"] == address
    yield RunningActor(address, proc, log, tiny_model_dir)
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture(scope="session")
def synthetic(tiny_model_dir, tmp_path_factory) -> str:
    """The synthetic actor (actor/synthetic.py) as a process; yields its address."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ready = tmp_path_factory.mktemp("synthetic") / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "millstream.actor", "--ready-file", str(ready), "actor.kind=synthetic",
         f"model.path={tiny_model_dir}", f"actor.address={address}", "actor.max_num_seqs=32",
         "actor.synthetic_stop_prob=0.05"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "synthetic actor not ready"
        time.sleep(0.1)
    yield address
    os.killpg(proc.pid, 9)
    proc.wait()
