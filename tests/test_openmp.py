"""The actor's engine runs with OpenMP threads that sleep at their barriers on CPU
(shared/process/openmp.py): the policy is resolved from the config and the environment, and the
actor's process starts itself again with it, so that OpenMP, which reads it once when torch
loads it, runs with it."""

import os

import pytest
from helpers import run_started_again

from millstream.shared.config import load_config
from millstream.shared.process.openmp import openmp_environment, wait_policy


@pytest.fixture
def no_policy(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("millstream.shared.process.cpus.has_gpu", lambda: False)


def test_the_policy_follows_the_config_and_an_operators_environment(no_policy, monkeypatch):
    assert wait_policy(load_config(None, [])) == "PASSIVE"  # vLLM on CPU
    assert wait_policy(load_config(None, ["actor.kind=synthetic"])) is None
    assert wait_policy(load_config(None, ["actor.device=cuda"])) is None
    assert wait_policy(load_config(None, ["actor.omp_wait=active"])) == "ACTIVE"
    assert wait_policy(load_config(None, ["actor.omp_wait=library"])) is None
    assert openmp_environment(load_config(None, [])) == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # set by whoever started the actor
    assert wait_policy(load_config(None, [])) is None and openmp_environment(load_config(None, [])) == {}
    assert openmp_environment(load_config(None, ["actor.omp_wait=passive"])) == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_environment(load_config(None, ["actor.omp_wait=passive"])) == {}  # no loop


def test_auto_leaves_gpu_engines_alone_and_knows_a_gpu_hidden_from_the_role(no_policy, monkeypatch):
    monkeypatch.setattr("millstream.shared.process.cpus.has_gpu", lambda: True)
    assert wait_policy(load_config(None, [])) is None  # device=auto on a GPU machine: CUDA
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # Ray's for a role given no GPU: on CPU
    assert wait_policy(load_config(None, [])) == "PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # an operator tuned OpenMP: left alone
    assert wait_policy(load_config(None, [])) is None


def test_the_actors_process_runs_again_with_the_policy_its_openmp_reads(tmp_path):
    """run_role(preload=True), as the actor's entry point calls it: one pid, started twice, and
    the OpenMP that torch loads afterwards sleeps at once (OMP_DISPLAY_ENV: its spin count is 0;
    it shows 'PASSIVE' as its policy without the variable too, spinning 300,000 times)."""
    role = (
        "import os, sys\n"
        "from millstream.shared.process.runtime import run_role\n"
        "def body(cfg, ns):\n"
        "    import torch  # loads OpenMP, which reads its environment now\n"
        "    print('body', os.getpid(), os.environ.get('OMP_WAIT_POLICY'), flush=True)\n"
        "print('start', os.getpid(), flush=True)\n"
        "run_role('actor', body, sys.argv[1:], preload=True)\n"
    )
    argv = ["actor.allocator=system", "actor.device=cpu", f"run.dir={tmp_path}", "actor.cpus=all"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE"}
    out, lines, pid = run_started_again(role, argv, env)
    assert f"body {pid} PASSIVE" in lines, lines
    assert "GOMP_SPINCOUNT = '0'" in out.stderr, out.stderr[-2000:]
