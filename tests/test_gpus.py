"""Which GPUs each role sees under the local launcher (shared/process/gpus.py): the shapes of
machine a run meets (one GPU, two, eight with tensor parallelism and a judge), the lists a user
writes, and the launcher handing each role its `CUDA_VISIBLE_DEVICES`. This machine has no GPU:
the GPUs are given as CUDA would show them (`visible`), and the engine is said to run on CUDA."""

from __future__ import annotations

import os

import pytest

from millstream.shared.config import ConfigError, load_config
from millstream.shared.launch.launcher import _start_roles
from millstream.shared.process import gpus as gpus_module
from millstream.shared.process.gpus import (
    check_gpus,
    gpu_plan,
    role_gpus,
    shared_gpus,
    visible_gpus,
    weights_share_gpu,
)

ON_GPU = ["actor.device=cuda"]


def shares(visible: list[str], *overrides: str) -> dict[str, str | None]:
    cfg = load_config(None, [*ON_GPU, *overrides])
    out = {f"actor-{i}": role_gpus(cfg, "actor", i, visible=visible) for i in range(cfg.actor.replicas)}
    if cfg.judge.model_path:
        out["judge"] = role_gpus(cfg, "actor", judge=True, visible=visible)
    return out | {"learner": role_gpus(cfg, "learner", visible=visible)}


def test_one_gpu_is_shared_by_the_actor_and_the_learner():
    assert shares(["0"]) == {"actor-0": "0", "learner": "0"}  # as examples/gpu-instruct.toml plans
    assert shared_gpus(load_config(None, ON_GPU), visible=["0"]) == ["0"]


def test_two_gpus_give_the_actor_and_the_learner_one_each():
    assert shares(["0", "1"]) == {"actor-0": "0", "learner": "1"}


def test_eight_gpus_go_round_replicas_with_tensor_parallelism_a_judge_and_ranks():
    got = shares(
        [str(i) for i in range(8)],
        "actor.replicas=2",
        "actor.tensor_parallel_size=2",
        "judge.model_path=/models/judge",
        "learner.ranks=2",
    )
    assert got == {"actor-0": "0,1", "actor-1": "2,3", "judge": "4,5", "learner": "6,7"}


def test_too_few_gpus_to_go_round_are_shared_and_none_idles():
    """The engines take turns on all of them, the learner takes the last ones."""
    cfg = ["actor.replicas=2", "learner.ranks=2"]
    assert shares(["0", "1", "2"], *cfg) == {"actor-0": "0", "actor-1": "1", "learner": "2,1"}
    assert shared_gpus(load_config(None, [*ON_GPU, *cfg]), visible=["0", "1", "2"]) == ["1"]
    three = shares(["0", "1"], "actor.replicas=3")  # more engines than GPUs: round and round
    assert three == {"actor-0": "0", "actor-1": "1", "actor-2": "0", "learner": "1"}
    assert shares(["0"], "actor.tensor_parallel_size=2")["actor-0"] is None  # vLLM says why


def test_the_plan_says_where_each_process_computes_and_whether_the_weights_cross_a_shared_gpu():
    eight = [*ON_GPU, "actor.replicas=2", "actor.tensor_parallel_size=2", "judge.model_path=/m/j"]
    cfg = load_config(None, [*eight, "learner.ranks=2"])
    assert gpu_plan(cfg, [str(i) for i in range(8)]) == "actor 0,1, actor-1 2,3, judge 4,5, learner 6,7"
    assert gpu_plan(load_config(None, ON_GPU), []) == ""  # no GPU: nothing to say

    def crossing(visible: list[str], *overrides: str) -> str | None:
        return weights_share_gpu(load_config(None, [*ON_GPU, *overrides]), visible)

    assert crossing(["0"]) == "0"  # one GPU: the weights go over gloo
    assert crossing(["0", "1"]) is None
    assert crossing(["0", "1"], "judge.model_path=/m/j") is None  # the judge shares, not in the group
    assert crossing(["0", "1"], "learner.ranks=2") is None  # rank 0 on GPU 1, rank 1 with the actor


def test_auto_keeps_clear_of_the_other_roles_list():
    assert shares(["0", "1"], 'actor.gpus="1"') == {"actor-0": "1", "learner": "0"}
    four = shares(["0", "1", "2", "3"], "actor.replicas=3", 'actor.gpus="0-1"')
    assert four == {"actor-0": "0", "actor-1": "1", "actor-2": "0", "learner": "2"}
    assert shares(["0", "1", "2"], 'learner.gpus="0"', "actor.replicas=2")["actor-1"] == "2"
    assert shared_gpus(load_config(None, [*ON_GPU, 'actor.gpus="1"']), visible=["0", "1"]) == []


def test_lists_name_gpus_as_the_launchers_environment_numbers_them():
    visible = ["4", "5", "6", "7"]  # the launcher itself runs with CUDA_VISIBLE_DEVICES=4,5,6,7
    got = shares(visible, "actor.replicas=2", 'actor.gpus="2-3"', "learner.ranks=2", 'learner.gpus="0,1"')
    assert got == {"actor-0": "6", "actor-1": "7", "learner": "4,5"}
    # Fewer than one each: the replicas share the list.
    assert shares(visible, "actor.replicas=2", 'actor.gpus="3"')["actor-1"] == "7"  # both on it


def test_all_and_ray_and_a_cpu_engine_leave_the_environment_alone():
    two = ["0", "1"]
    assert shares(two, "actor.gpus=all", "learner.gpus=all") == {"actor-0": None, "learner": None}
    assert shares(two, "launcher.kind=ray") == {"actor-0": None, "learner": None}
    cpu_engine = load_config(None, ["actor.device=cpu"])
    assert role_gpus(cpu_engine, "actor", visible=two) is None
    assert role_gpus(cpu_engine, "learner", visible=two) == "0"  # the learner alone needs one
    assert role_gpus(load_config(None, ON_GPU), "envpool", visible=two) is None


def test_what_cuda_shows_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")
    assert visible_gpus() == ["GPU-aa", "GPU-bb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpus() == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (['actor.gpus="0,5"'], "actor.gpus = '0,5': GPU 5 is not visible here (this machine shows 2 GPUs)"),
        (['learner.gpus="1"', "learner.ranks=2"], "learner.gpus = '1': 1 GPU for learner.ranks = 2"),
        (
            ['actor.gpus="0"', "actor.tensor_parallel_size=2"],
            "actor.gpus = '0': 1 GPU for actor.tensor_parallel_size = 2",
        ),
        (['actor.gpus="1-0"'], "actor.gpus = '1-0': the range '1-0' runs backwards"),
        (["learner.ranks=3"], "learner.ranks = 3: this machine shows 2 GPUs, and each rank computes"),
        (["actor.tensor_parallel_size=4"], "actor.tensor_parallel_size = 4: this machine shows 2 GPUs"),
    ],
)
def test_a_list_that_cannot_be_honoured_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_gpus(load_config(None, [*ON_GPU, *overrides]), visible=["0", "1"])
    assert str(err.value).startswith(message)


def test_an_nccl_group_that_a_shared_gpu_rules_out_is_refused_before_anything_starts(monkeypatch):
    from millstream.shared.launch import preflight

    monkeypatch.setattr(gpus_module, "visible_gpus", lambda: ["0"])
    with pytest.raises(ConfigError, match="learner.sync_backend = 'nccl': the learner and an actor"):
        preflight._check_shared_gpus(load_config(None, [*ON_GPU, "learner.sync_backend=nccl"]))
    preflight._check_shared_gpus(load_config(None, ON_GPU))  # auto: a warning, not an error


class RecordingSupervisor:
    """Records what the launcher asks to start, and starts nothing (the test is about the
    environment each role is given)."""

    def __init__(self) -> None:
        self.envs: dict[str, dict[str, str] | None] = {}

    def start(self, name, module, args, *, pipe_stdout=False, env=None) -> None:
        self.envs[name] = env


def test_the_launcher_gives_each_role_its_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(gpus_module, "visible_gpus", lambda: ["0", "1", "2"])
    cfg = load_config(None, [*ON_GPU, f"run.dir={tmp_path}", "learner.ranks=2"])
    sup = RecordingSupervisor()
    _start_roles(sup, cfg, [])
    assert sup.envs["actor"] == {"CUDA_VISIBLE_DEVICES": "0"}
    for rank, name in enumerate(["learner", "learner-rank1"]):
        env = sup.envs[name]
        assert env is not None and env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["LOCAL_RANK"] == str(rank)
    assert sup.envs["envpool-0"] is None
    ray = RecordingSupervisor()  # under Ray each rank sees only its own GPU: it is its device 0
    _start_roles(ray, load_config(None, [*ON_GPU, "launcher.kind=ray", "learner.ranks=2"]), [])
    assert ray.envs["learner-rank1"] is not None and ray.envs["learner-rank1"]["LOCAL_RANK"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in ray.envs["learner-rank1"]  # Ray sets it


def test_the_actor_asks_torch_for_cuda_without_setting_cuda_up(monkeypatch):
    """torch's default check (cudaGetDeviceCount) sets CUDA up in the actor's process, and the
    engine processes vLLM forks from it then fail; NVML's does not. vLLM sets the variable on
    import, which comes after the check."""
    from millstream.actor.engine import use_cuda
    from millstream.shared.config import load_config

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    use_cuda(load_config(None, ["actor.device=auto"]))
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
