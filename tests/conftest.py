"""Shared fixtures: the tiny model, and ONE real vLLM actor for the whole test session.

`synthetic` is the synthetic actor (a timing model, no vLLM), for envpool tests at scale.

The actor is started through its real entry point (`python -m millstream.actor`), exactly as the launcher
starts it, and reused by every test that needs generation; end-to-end runs attach to it with
`actor.connect=...` (a new learner session re-attaches and pushes its own weights first, so runs
do not see each other's weights). Starting vLLM costs ~1 minute here, hence once per session.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import LAUNCHED, start_actor, start_synthetic_actor, stop_group


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the real vLLM actor is `real`: `make test-fast` (-m "not real") skips it."""
    for item in items:
        if "actor" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real)


@pytest.fixture(autouse=True)
def no_run_left_behind() -> Iterator[None]:
    """Kill launchers a test started and did not see end (see helpers.LAUNCHED)."""
    yield
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from millstream.shared.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0))


class RunningActor:
    def __init__(self, address: str, proc: subprocess.Popen, log: Path, model_dir: str) -> None:
        self.address = address
        self.proc = proc
        self.log = log
        self.model_dir = model_dir


@pytest.fixture(scope="session")
def actor(tiny_model_dir, tmp_path_factory) -> Iterator[RunningActor]:
    address, proc, log = start_actor(
        tiny_model_dir,
        tmp_path_factory.mktemp("actor"),
        "actor.max_num_seqs=64",
        "learner.sync_timeout_s=120",
    )
    yield RunningActor(address, proc, log, tiny_model_dir)
    stop_group(proc, sig=15)


@pytest.fixture(scope="session")
def synthetic(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    """The synthetic actor (actor/synthetic.py) as a process; yields its address."""
    address, proc = start_synthetic_actor(
        tiny_model_dir,
        tmp_path_factory.mktemp("synthetic"),
        "actor.max_num_seqs=32",
        "actor.synthetic_stop_prob=0.05",
    )
    yield address
    stop_group(proc)
