"""Tensor parallelism (`actor.tensor_parallel_size`): the check that the model splits, and a real
TP=2 actor on CPU whose two vLLM workers both load the learner's weights, and which SIGTERM
stops with its engine and both workers (the last test here: it ends the module's actor).

Why generations prove that *both* workers loaded: with TP=2 every attention and MLP layer is
split in halves across the two workers, and each logit is the sum of both halves. A worker that
kept its old shard would make logits that are neither the old model's nor the new one's, so
greedy tokens and logprobs equal to transformers' on the learner's weights need both shards new.
"""

import os
import signal
import subprocess
import sys

import anyio
import orjson
import pytest
import torch
from helpers import KEYS, ROOT, keys_for, start_actor, with_client
from test_actor import PROMPT, generate, hf_greedy, hf_logprobs
from transformers import AutoModelForCausalLM

from millstream.bench.kit.spawn import stop
from millstream.learner.sync.weights import WeightSender
from millstream.shared.config import ConfigError, LearnerConfig
from millstream.shared.process.lifecycle import group_processes
from millstream.shared.process.runtime import SETUP_FAILED, check_tensor_parallel
from millstream.shared.wire.weightsync import session_tag


def test_the_size_must_split_the_models_heads(tiny_model_dir, tmp_path):
    for size in (1, 2, 4):  # the tiny model: 4 attention heads, 2 key/value heads
        check_tensor_parallel(tiny_model_dir, size)
    with pytest.raises(ConfigError) as caught:
        check_tensor_parallel(tiny_model_dir, 3)
    assert str(caught.value).startswith(
        "actor.tensor_parallel_size = 3: must divide the model's 4 attention heads"
    )
    assert str(caught.value).endswith("choose one of [1, 2, 4]")
    # Key/value heads are split when there are enough of them, copied when there are fewer.
    (tmp_path / "config.json").write_bytes(
        orjson.dumps({"num_attention_heads": 12, "num_key_value_heads": 4})
    )
    for size in (2, 4, 12):
        check_tensor_parallel(tmp_path, size)
    for size in (3, 6):
        with pytest.raises(ConfigError, match=f"= {size}: the model's 4 key/value heads must be split"):
            check_tensor_parallel(tmp_path, size)


@pytest.mark.real
def test_the_actor_refuses_a_size_that_cannot_split_before_its_engine_starts(tiny_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "millstream.actor",
            f"model.path={tiny_model_dir}",
            "actor.tensor_parallel_size=3",
            KEYS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == SETUP_FAILED  # a launcher would not restart it: it would fail again
    assert "actor.tensor_parallel_size = 3: must divide the model's 4 attention heads" in proc.stderr
    assert "vllm" not in proc.stderr.lower()  # refused before vLLM was even imported


@pytest.fixture(scope="module")
def tp_actor(tiny_model_dir, tmp_path_factory):
    address, proc, log = start_actor(
        tiny_model_dir,
        tmp_path_factory.mktemp("tp-actor"),
        "actor.tensor_parallel_size=2",
        "actor.max_num_seqs=16",
        "learner.sync_timeout_s=120",
        timeout_s=300,
    )
    yield address, log, proc
    stop(proc, grace_s=30)


@pytest.mark.real
def test_both_tensor_parallel_workers_load_the_learners_weights(tp_actor, tiny_model_dir):
    address, log, _ = tp_actor
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    expected = hf_greedy(learner, PROMPT, 16)
    assert expected != hf_greedy(base, PROMPT, 16)

    async def greedy_and_sampled(client, _tg):
        return await generate(client, n=16), await generate(client, n=24, temperature=1.0, seed=3)

    (before, _) = anyio.run(with_client, address, greedy_and_sampled, backend="trio")
    assert before.token_ids == hf_greedy(base, PROMPT, 16)  # TP=2 runs the checkpoint's model
    sender = WeightSender(
        address, LearnerConfig(sync_timeout_s=60), dtype="float32", keys=keys_for("learner")
    )
    try:
        info = sender.attach()
        assert info.weight_ranks == 2  # the size reached vLLM: two workers, a group of three
        sender.push(learner.named_parameters(), version=3)
        greedy, sampled = anyio.run(with_client, address, greedy_and_sampled, backend="trio")
    finally:
        sender.close()
    assert greedy.token_ids == expected and set(greedy.versions) == {3}
    ref = hf_logprobs(learner, PROMPT, sampled.token_ids)
    assert max(abs(a - b) for a, b in zip(ref, sampled.logprobs)) < 1e-3
    text = log.read_text()
    assert f"vLLM workers joined weight group {session_tag(sender.session)} as ranks [1, 2] of 3" in text
    assert sender.session not in text  # the group's secret: logs show a digest of it
    assert "Failed to load weights" not in text


@pytest.mark.real
def test_sigterm_to_a_hand_started_vllm_actor_stops_its_engine_processes(tp_actor):
    """An actor started by hand (leading a process group of its own) and sent SIGTERM alone,
    not its group, stops vLLM's EngineCore and every Worker with it. It runs last in this
    module, on the module's TP=2 actor: one engine start less for the suite."""
    from test_lifecycle import titles, wait_gone

    _, _, proc = tp_actor
    names = titles(group_processes(proc.pid))
    assert {b"VLLM::EngineCore", b"VLLM::Worker_TP0", b"VLLM::Worker_TP1"} <= names, names
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert wait_gone(proc.pid, find=group_processes) == []
