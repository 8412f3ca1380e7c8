"""Which cores each role runs on (shared/process/cpus.py): the split, the checks, the pinning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from millstream.shared.config import ConfigError, load_config
from millstream.shared.process import cpus
from millstream.shared.process.cpus import CpuShare, check_cpus, parse_cores, role_share


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(cpus, "has_gpu", lambda: False)


def shares(*overrides: str, available=(0, 1)) -> dict[str, CpuShare]:
    cfg = load_config(None, list(overrides))
    return {role: role_share(cfg, role, available=available) for role in ("actor", "learner", "envpool")}


@pytest.mark.parametrize(
    ("available", "actor", "learner"),
    [
        ((0,), (0,), (0,)),
        ((0, 1), (0,), (1,)),
        ((0, 1, 2), (0, 1), (2,)),
        (tuple(range(8)), (0, 1, 2, 3), (4, 5, 6, 7)),
    ],
)
def test_auto_gives_the_actor_the_first_half_and_the_learner_the_rest(available, actor, learner):
    got = shares(available=available)
    assert got["actor"] == CpuShare(actor, len(actor))
    assert got["learner"] == CpuShare(learner, len(learner))
    assert got["envpool"] == CpuShare(None, 1)  # an event loop: not pinned, one thread


def test_replicas_ranks_and_a_judge_each_get_a_slice_when_there_are_enough_cores():
    cfg = load_config(None, ["actor.replicas=2", "learner.ranks=2", "judge.model_path=/m"])
    cores = tuple(range(12))
    # The actor's 6 cores among 2 replicas and the judge; the learner's 6 between 2 ranks.
    assert [role_share(cfg, "actor", i, available=cores).cores for i in range(2)] == [(0, 1), (2, 3)]
    assert role_share(cfg, "actor", judge=True, available=cores).cores == (4, 5)
    assert [role_share(cfg, "learner", i, available=cores).cores for i in range(2)] == [
        (6, 7, 8),
        (9, 10, 11),
    ]
    # Too few cores for a slice each: every replica shares the actor's core.
    small = [role_share(cfg, "actor", i, available=(0, 1)) for i in range(2)]
    assert small == [CpuShare((0,), 1), CpuShare((0,), 1)]


def test_tensor_parallel_workers_divide_their_replicas_threads():
    assert shares("actor.tensor_parallel_size=2", available=tuple(range(8)))["actor"] == CpuShare(
        (0, 1, 2, 3), 2
    )
    assert shares("actor.tensor_parallel_size=2")["actor"] == CpuShare((0,), 1)


def test_all_a_gpu_or_ray_leave_everything_as_the_libraries_set_it(monkeypatch):
    unchanged = CpuShare(None, None)
    assert shares("actor.cpus=all", "learner.cpus=all", "envpool.cpus=all") == dict.fromkeys(
        ("actor", "learner", "envpool"), unchanged
    )
    assert set(shares("launcher.kind=ray").values()) == {unchanged}
    assert set(shares("actor.device=cuda").values()) == {unchanged}
    monkeypatch.setattr(cpus, "has_gpu", lambda: True)
    assert set(shares().values()) == {unchanged}
    assert shares("learner.cpus=2-3")["learner"] == CpuShare((2, 3), 2)  # a list holds anywhere


def test_a_core_list_is_used_as_given():
    # One core is a string too (TOML reads a bare 1 as a number): learner.cpus='1'.
    got = shares("actor.cpus=0,2-3", "learner.cpus='1'", "envpool.cpus='4'", available=tuple(range(6)))
    assert got == {
        "actor": CpuShare((0, 2, 3), 3),
        "learner": CpuShare((1,), 1),
        "envpool": CpuShare((4,), 1),
    }
    assert parse_cores("3,0-1,1") == (0, 1, 3)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("learner.cpus=0-x", "learner.cpus"),
        ("actor.cpus=half", "actor.cpus"),
        ("envpool.cpus=", "envpool.cpus"),
    ],
)
def test_a_malformed_core_list_is_refused_naming_its_key(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [override])


def test_cores_the_machine_lacks_or_a_backwards_range_are_refused_naming_the_key():
    with pytest.raises(
        ConfigError,
        match=r"learner.cpus = '0-1,5': cores 5 are not available here \(this machine offers 0-1\)",
    ):
        check_cpus(load_config(None, ["learner.cpus=0-1,5"]), available=(0, 1))
    with pytest.raises(ConfigError, match="actor.cpus = '3-1': the range '3-1' runs backwards"):
        check_cpus(load_config(None, ["actor.cpus=3-1"]), available=(0, 1, 2, 3))
    check_cpus(load_config(None, ["actor.cpus='1'", "learner.cpus='0'"]), available=(0, 1))


@pytest.mark.slow  # starts Python with torch twice per case (about 2 s each): `make test` only
@pytest.mark.parametrize("torch_first", [False, True], ids=["before-torch", "after-torch"])
def test_a_process_pins_itself_and_sizes_its_pools_and_its_children_inherit_both(torch_first):
    """Roles import torch with their modules, before they read their config: its pool is
    sized then, not started, and apply_share sizes it either way."""
    code = (
        "import json, os, subprocess, sys\n"
        + ("import torch\n" if torch_first else "")
        + "from millstream.shared.process.cpus import CpuShare, apply_share\n"
        "apply_share(CpuShare((0,), 1))\n"
        "import torch\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)), "
        'os.environ["OMP_NUM_THREADS"])\'], capture_output=True, text=True).stdout.split()\n'
        "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads(), child]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    mine, threads, child = json.loads(out.stdout.splitlines()[-1])
    assert mine == [0] and threads == 1 and child == ["[0]", "1"]
