"""The synthetic actor: the real protocol and clients against a timing model (no vLLM).

The `synthetic` fixture (conftest) starts `python -m millstream.actor actor.kind=synthetic` as a process,
like the launcher does.
"""

import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch
from helpers import (
    MILLSTREAM,
    check_accounting,
    dealer,
    keys_for,
    start_synthetic_actor,
    steps_of,
    with_client,
)

from millstream.bench.kit.spawn import stop
from millstream.envpool.actors.client import GenerationFailed
from millstream.envpool.actors.generation import Sampling
from millstream.learner.sync.weights import WeightSender
from millstream.shared.config import ConfigError, LearnerConfig
from millstream.shared.wire import Codec, GenerateRequest, TokenDelta

ROOT = Path(__file__).resolve().parent.parent


def run_client(address, fn):
    return anyio.run(with_client, address, fn, backend="trio")


def gen(client, seed, n=40, stop=(2,)):
    return client.generate(
        [1, 5, 9], Sampling(max_tokens=n, stop_token_ids=tuple(stop), timeout_s=60), seed=seed
    )


def test_many_concurrent_requests_stream_to_completion(synthetic):
    async def many(client, _tg):
        results = {}

        async def one(i):
            results[i] = await gen(client, seed=i)

        async with anyio.create_task_group() as tg:
            for i in range(300):  # more than max_num_seqs: requests wait for slots
                tg.start_soon(one, i)
        return results, client.stats

    results, stats = run_client(synthetic, many)
    assert len(results) == 300 and stats.completed == 300 and stats.live == 0
    lengths = [len(r.token_ids) for r in results.values()]
    assert max(lengths) == 40 and min(lengths) < 40  # geometric stops, capped by max_tokens
    for r in results.values():
        assert len(r.logprobs) == len(r.token_ids) and all(lp < 0 for lp in r.logprobs)
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == 2)


@pytest.mark.slow
def test_lognormal_lengths_are_heavy_tailed_and_capped(tiny_model_dir, tmp_path):
    """`actor.synthetic_length_median`: each request's length is drawn once from a lognormal
    (median 20, sigma 1), ended by the end-of-turn token, capped by max_tokens (the bench of
    async against sync relies on this tail)."""
    address, proc = start_synthetic_actor(
        tiny_model_dir,
        tmp_path,
        "actor.max_num_seqs=256",
        "actor.synthetic_step_s=0",
        "actor.synthetic_length_median=20",
        "actor.synthetic_length_sigma=1.0",
    )

    async def many(client, _tg):
        results = {}

        async def one(i):
            results[i] = await gen(client, seed=i, n=200, stop=())

        async with anyio.create_task_group() as tg:
            for i in range(400):
                tg.start_soon(one, i)
        return list(results.values())

    try:
        results = run_client(address, many)
    finally:
        stop(proc, grace_s=0)
    lengths = sorted(len(r.token_ids) for r in results)
    median = lengths[len(lengths) // 2]
    assert 14 <= median <= 28, median  # lognormal median 20
    assert lengths[-1] == 200 and lengths[int(0.99 * len(lengths))] > 5 * median  # the tail, capped
    for r in results:
        if len(r.token_ids) < 200:  # ended by the drawn length: the end-of-turn token, certain
            assert r.finish_reason == "stop" and r.logprobs[-1] == 0.0


def test_seeded_requests_are_reproducible_and_bad_ones_named(synthetic):
    async def twice(client, _tg):
        return (await gen(client, seed=7)).token_ids, (await gen(client, seed=7)).token_ids

    a, b = run_client(synthetic, twice)
    assert a == b

    async def bad(client, _tg):
        return await client.generate([], Sampling(max_tokens=3, timeout_s=30), seed=None)

    with pytest.raises(GenerationFailed, match="empty prompt"):
        run_client(synthetic, bad)


def test_weight_sync_is_real_on_the_wire(synthetic, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sender = WeightSender(
        synthetic, LearnerConfig(sync_timeout_s=30), dtype="float32", keys=keys_for("learner")
    )
    try:
        sender.attach()
        metrics = sender.push(model.named_parameters(), version=3)
        assert metrics["sync/bytes"] == 4 * sum(p.numel() for p in model.parameters())

        async def versions(client, _tg):
            return set((await gen(client, seed=1, n=5)).versions)

        assert run_client(synthetic, versions) == {3}
    finally:
        sender.close()


def test_nccl_asked_for_a_replica_on_the_cpu_is_refused_with_the_reason(synthetic):
    """The replica says where its workers compute (`ActorInfo.gpus`, empty on the CPU); an
    explicit NCCL group that cannot form is refused before anything is attempted, as a config
    error (forming it again would fail the same way)."""
    sender = WeightSender(
        synthetic,
        LearnerConfig(sync_timeout_s=30, sync_backend="nccl"),
        dtype="float32",
        keys=keys_for("learner"),
    )
    try:
        # Both members: the learner of this test too (no GPU here).
        with pytest.raises(ConfigError, match="2 of the weight group's 2 members compute on the CPU"):
            sender.attach()
    finally:
        sender.close()


def test_tokens_keep_coming_while_weights_are_received(tiny_model_dir, tmp_path):
    """The actor receives an update while it generates and stops only to swap it in. Measured
    by the actor's own token count (`WeightsApplied.tokens`): during a push it makes tokens at a
    good part of its rate between pushes. With the engine held for the whole receive (before
    actor/receive.py) it made almost none."""
    address, proc = start_synthetic_actor(tiny_model_dir, tmp_path, "actor.synthetic_step_s=0.002")
    cfg = LearnerConfig(sync_timeout_s=60)
    sender = WeightSender(address, cfg, dtype="float32", keys=keys_for("learner"))
    weights = [(f"w{i}", torch.randn(2**20)) for i in range(64)]  # 256 MiB
    streaming_done = threading.Event()

    def stream() -> None:  # keeps 8 requests in flight, reading every delta
        sock, codec = dealer(address), Codec()
        requests = (GenerateRequest(f"r{n}", [1, 5, 9], 400, ignore_eos=True) for n in range(10**6))
        for _ in range(8):
            sock.send(codec.encode([next(requests)]))
        while not streaming_done.is_set():
            for message in codec.decode(sock.recv()) if sock.poll(50) else []:
                if isinstance(message, TokenDelta) and message.finish_reason:
                    sock.send(codec.encode([next(requests)]))
        sock.close(linger=0)

    def push(version: int) -> tuple[float, dict[str, float]]:
        metrics = sender.push(weights, version)
        return time.monotonic(), metrics

    streaming = threading.Thread(target=stream, daemon=True)
    try:
        sender.attach()
        push(1)  # the first push allocates the kept buffer
        streaming.start()
        t0, m0 = push(2)
        time.sleep(1.0)
        t1, m1 = push(3)
        t2, m2 = push(4)  # at once: the tokens since the last reply were made during this push
    finally:
        streaming_done.set()
        streaming.join(timeout=10)
        sender.close()
        stop(proc, grace_s=0)
    between = (m1["sync/actor_tokens"] - m0["sync/actor_tokens"]) / (t1 - t0)
    during = (m2["sync/actor_tokens"] - m1["sync/actor_tokens"]) / (t2 - t1)
    assert m2["sync/actor_receive_s"] > 0.02 and m2["sync/actor_paused_s"] < m2["sync/actor_receive_s"], m2
    assert between > 0 and during > 0.3 * between, (during, between, m2)


@pytest.mark.real  # the DeepSpeed learner
def test_whole_loop_runs_on_the_synthetic_actor(tiny_model_dir, tmp_path):
    """`millstream run actor.kind=synthetic`: envpool and learner unchanged, no vLLM at all."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            *MILLSTREAM,
            "run",
            "actor.kind=synthetic",
            f"model.path={tiny_model_dir}",
            f"run.dir={run_dir}",
            "train.steps=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check_accounting(run_dir)
    assert [r["step"] for r in steps_of(run_dir)] == [1, 2, 3]
    assert "vllm" not in (run_dir / "logs" / "actor.log").read_text().lower()
