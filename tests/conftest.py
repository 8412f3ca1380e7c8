"""Shared fixtures: the tiny model, and ONE real vLLM actor for the whole test session.

`synthetic` is the synthetic actor (a timing model, no vLLM), for envpool tests at scale.

The actor is started through its real entry point (`python -m millstream.actor`), exactly as the launcher
starts it, and reused by every test that needs generation; end-to-end runs attach to it with
`actor.connect=...` (a new learner session re-attaches and pushes its own weights first, so runs
do not see each other's weights). Starting vLLM costs ~1 minute here, hence once per session.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import helpers
import pytest
from helpers import LAUNCHED, RunningActor, running_actor, start_synthetic_actor
from hypothesis import settings

from millstream.bench.kit.spawn import stop

# No per-example time limit for hypothesis: its 200 ms default is a timing assertion, and on a
# loaded 2-core machine a property test's example took 264 ms (test_starpo_pool...: a flake, not
# a bug). Speed is the benchmarks' business; pytest-timeout still ends a hang.
settings.register_profile("millstream", deadline=None)
settings.load_profile("millstream")

#: Fixtures that start the real stack or a whole run (a Ray cluster, a `millstream stress` run):
#: a test that uses one is `real`.
REAL_FIXTURES = {"actor", "cluster", "stress_run", "smollm2_dir"}
#: Engines whose import in the test process makes a test `real` (checked after each test).
REAL_MODULES = ("vllm", "deepspeed")
#: Per-test limits (pytest-timeout): a hang fails with a traceback instead of stalling the lane.
#: A `real` test may start vLLM (a minute here) and run a whole training run.
DEFAULT_TIMEOUT_S = 180
REAL_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `real` lane, by rule rather than by memory: a test that uses the real vLLM actor or a
    Ray cluster is `real` (`make test-fast` skips it); `real` tests get the longer time limit."""
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)
        if item.get_closest_marker("timeout") is None:
            real = item.get_closest_marker("real") is not None
            item.add_marker(pytest.mark.timeout(REAL_TIMEOUT_S if real else DEFAULT_TIMEOUT_S))


def _real_only(item: pytest.Item) -> Iterator[None]:
    """The rest of the rule, around a test's setup and its call: a test that starts a whole run
    or a vLLM actor through tests/helpers (`helpers.require_real`), or imports vLLM or DeepSpeed
    into this process, fails unless it is `real` (its fixtures included)."""
    before = {m for m in REAL_MODULES if m in sys.modules}
    helpers.CURRENT_TEST = item
    try:
        result = yield
    finally:
        helpers.CURRENT_TEST = None
    imported = sorted({m for m in REAL_MODULES if m in sys.modules} - before)
    if imported and item.get_closest_marker("real") is None:
        names = ", ".join(imported)
        pytest.fail(f"{item.nodeid} imports {names}: mark it `real` (make test-fast skips those)")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _real_only(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _real_only(item))


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


@pytest.fixture(scope="session")
def actor(tiny_model_dir, tmp_path_factory) -> Iterator[RunningActor]:
    workdir = tmp_path_factory.mktemp("actor")
    with running_actor(
        tiny_model_dir, workdir, "actor.max_num_seqs=64", "learner.sync_timeout_s=120"
    ) as running:
        yield running


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
    stop(proc, grace_s=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct's directory, made by `make real-model` (`make test` makes it first).
    Missing, the test fails saying so: a skipped test is not a test."""
    from millstream.shared.models.smollm2 import default_dir, is_made

    path = default_dir()
    if not is_made(path):
        pytest.fail(f"SmolLM2 is not at {path}: run `make real-model` (make test runs it first)")
    return str(path)
