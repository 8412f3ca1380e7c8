"""The real vLLM actor (one per session, see conftest): streaming, logprobs, aborts, weights."""

import os
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
from helpers import dealer, keys_for, raw_replies, with_client
from transformers import AutoModelForCausalLM

from millstream.envpool.actors.client import GenerationFailed
from millstream.envpool.actors.generation import Sampling
from millstream.learner.sync.weights import WeightSender, WeightSyncError
from millstream.shared.config import LearnerConfig
from millstream.shared.wire import Abort, Codec, GenerateRequest, TokenDelta

PROMPT = [1, 367, 201, 316, 276, 223, 19, 20, 425, 2, 201, 1, 366, 201]


def generate(client, prompt=PROMPT, n=12, temperature=0.0, seed=None, stop=()):
    sampling = Sampling(max_tokens=n, temperature=temperature, stop_token_ids=tuple(stop), timeout_s=120)
    return client.generate(list(prompt), sampling, seed=seed)


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def hf_model(actor):
    return AutoModelForCausalLM.from_pretrained(actor.model_dir, dtype=torch.float32).eval()


def test_sampled_stream_carries_exact_logprobs(actor, hf_model):
    async def run(client, _tg):
        return await generate(client, n=24, temperature=1.0, seed=7)

    gen = anyio.run(with_client, actor.address, run, backend="trio")
    assert 1 <= len(gen.token_ids) <= 24 and gen.finish_reason in ("stop", "length")
    assert len(gen.logprobs) == len(gen.token_ids) == len(gen.versions)
    ref = hf_logprobs(hf_model, PROMPT, gen.token_ids)
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs)) < 1e-3
    again = anyio.run(with_client, actor.address, run, backend="asyncio")
    assert again.token_ids == gen.token_ids  # the request's seed reaches vLLM


def test_logprobs_at_a_temperature_are_the_learners(actor, hf_model):
    """At a temperature T the engine samples from softmax(z / T): its logprobs must be that
    distribution's, and the learner's (`gather_logprobs`) the same. vLLM's default reports
    log softmax(z) whatever T, which trained another policy than the one that sampled."""
    from millstream.learner.train.loss import gather_logprobs

    async def run(client, _tg):
        return await generate(client, n=24, temperature=0.6, seed=11)

    gen = anyio.run(with_client, actor.address, run, backend="trio")
    ids = torch.tensor([PROMPT + gen.token_ids])
    with torch.no_grad():
        learner = gather_logprobs(hf_model(ids).logits, ids, temperature=0.6)[0, len(PROMPT) :].tolist()
    untempered = hf_logprobs(hf_model, PROMPT, gen.token_ids)
    assert max(abs(a - b) for a, b in zip(learner, gen.logprobs)) < 1e-3
    assert max(abs(a - b) for a, b in zip(untempered, gen.logprobs)) > 1e-2  # T made a difference


def test_top_logprobs_are_the_models_most_likely_tokens(actor, hf_model):
    """`top_logprobs` (the agent endpoint's field) comes from vLLM: per generated token, the k
    most likely tokens of the model at that position, with their logprobs, most likely first."""

    async def run(client, _tg):
        sampling = Sampling(max_tokens=6, temperature=1.0, timeout_s=120, top_logprobs=3)
        return await client.generate(list(PROMPT), sampling, seed=3)

    gen = anyio.run(with_client, actor.address, run, backend="trio")
    assert len(gen.top_logprobs) == len(gen.token_ids) >= 1
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + gen.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    for i, top in enumerate(gen.top_logprobs):
        ref = logp[len(PROMPT) - 1 + i].topk(3)
        assert [t for t, _ in top] == ref.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(top, ref.values.tolist())) < 1e-3


def test_many_concurrent_requests_and_stop_tokens(actor):
    async def run(client, _tg):
        results = {}

        async def one(i):
            results[i] = await generate(client, n=32, temperature=1.0, seed=i, stop=[2])

        async with anyio.create_task_group() as tg:
            for i in range(48):
                tg.start_soon(one, i)
        return results, client.stats

    results, stats = anyio.run(with_client, actor.address, run, backend="trio")
    assert len(results) == 48 and stats.completed == 48 and stats.live == 0
    for gen in results.values():
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == 2 and 2 not in gen.token_ids[:-1]
        else:
            assert gen.finish_reason == "length" and len(gen.token_ids) == 32


def test_ignore_eos_and_min_tokens_make_exactly_the_work_asked(actor):
    """Benchmarks need fixed output lengths: a greedy reply's third token, made a stop token,
    ends the reply there, unless the request ignores stops (then max_tokens, exactly) or asks
    for more tokens first (min_tokens)."""

    async def run(client, _tg):
        free = await generate(client, n=16)
        stop = [free.token_ids[2]]
        cut = await generate(client, n=16, stop=stop)
        sampling = Sampling(max_tokens=16, temperature=0.0, stop_token_ids=stop, timeout_s=120)
        ignored = await client.generate_once(
            list(PROMPT), msgspec.structs.replace(sampling, ignore_eos=True), seed=None
        )
        at_least = await client.generate_once(
            list(PROMPT), msgspec.structs.replace(sampling, min_tokens=8), seed=None
        )
        return free, cut, ignored, at_least

    free, cut, ignored, at_least = anyio.run(with_client, actor.address, run, backend="trio")
    first = free.token_ids.index(free.token_ids[2])  # the stop may occur before position 2
    assert cut.finish_reason == "stop" and len(cut.token_ids) == first + 1
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 16
    assert ignored.token_ids[: len(free.token_ids)] == free.token_ids  # the same greedy path
    # min_tokens masks the stop token until 8 tokens are out: the greedy path is the free one up to
    # where the stop token was, then it takes another token.
    assert len(at_least.token_ids) >= 8 and at_least.token_ids[:first] == free.token_ids[:first]
    assert free.token_ids[2] not in at_least.token_ids[:7] and at_least.token_ids[first] != free.token_ids[2]


def test_cancelled_generation_is_aborted_on_the_actor(actor):
    async def run(client, _tg):
        with anyio.move_on_after(0.3):
            await generate(client, n=900, temperature=1.0, seed=1)
        after = await generate(client, n=4)  # and the actor keeps serving
        return client.stats, after

    stats, after = anyio.run(with_client, actor.address, run, backend="trio")
    assert stats.aborted == 1 and len(after.token_ids) == 4


@pytest.mark.parametrize(
    "prompt, max_tokens, temperature, stop, message",
    [
        ([], 4, 1.0, [], "empty prompt"),
        ([1, 2, 999_999], 4, 1.0, [], "outside the vocabulary"),
        ([1, 2, 3], 5000, 1.0, [], "exceeds max_model_len"),
        # The hostile probe's: vLLM itself raises on these, outside any request's boundary.
        ([1, 2, 3], 4, 1e30, [], "bad sampling parameters temperature=1e[+]30"),
        ([1, 2, 3], 4, 1.0, [999_999], "stop token id 999999 outside the vocabulary"),
        ([1, 2, 3], 4, 1.0, [], "min_tokens must be in \\[0, max_tokens=4\\], got 5"),
    ],
)
def test_bad_requests_fail_with_a_named_cause(actor, prompt, max_tokens, temperature, stop, message):
    async def run(client, _tg):
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            stop_token_ids=stop,
            timeout_s=60,
            min_tokens=5 if "min_tokens" in message else 0,
        )
        return await client.generate_once(prompt, sampling, seed=None)

    with pytest.raises(GenerationFailed, match=message) as info:
        anyio.run(with_client, actor.address, run, backend="trio")
    assert info.value.cause == "actor_bad_request"
    assert actor.proc.poll() is None  # refused, and the actor still serves


def test_weight_broadcast_makes_actor_match_learner_weights(actor, hf_model):
    """Before the broadcast the actor's greedy tokens differ from the learner's model; after, equal."""
    learner_model = AutoModelForCausalLM.from_pretrained(actor.model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in learner_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    expected = hf_greedy(learner_model, PROMPT, 16)
    assert expected != hf_greedy(hf_model, PROMPT, 16)

    async def greedy(client, _tg):
        gen = await generate(client, n=16)
        return gen.token_ids, gen.versions

    before, _ = anyio.run(with_client, actor.address, greedy, backend="trio")
    assert before != expected
    sender = WeightSender(
        actor.address, LearnerConfig(sync_timeout_s=60), dtype="float32", keys=keys_for("learner")
    )
    try:
        assert sender.attach().gpus == []  # each vLLM worker said where it computes: the CPU
        assert sender.backend == "gloo"
        metrics = sender.push(learner_model.named_parameters(), version=5)
        after, versions = anyio.run(with_client, actor.address, greedy, backend="trio")
        assert after == expected
        assert set(versions) == {5}
        assert metrics["sync/bytes"] == 4 * sum(p.numel() for p in learner_model.parameters())
        # Restore the original weights for the other tests of this session.
        sender.push(hf_model.named_parameters(), version=0)
        restored, versions = anyio.run(with_client, actor.address, greedy, backend="trio")
        assert restored == hf_greedy(hf_model, PROMPT, 16) and set(versions) == {0}
    finally:
        sender.close()
    # vLLM's layer-wise reload warns about the rotary layer's derived cos/sin buffer at every
    # update; it is not a failure (actor/weights.py) and is filtered, so none reaches the log.
    log = actor.log.read_text()
    assert "now at policy version" in log and "Failed to load weights" not in log


def test_weight_update_from_unattached_session_is_refused(actor, hf_model):
    sender = WeightSender(
        actor.address, LearnerConfig(sync_timeout_s=30), dtype="float32", keys=keys_for("learner")
    )
    try:
        with pytest.raises(WeightSyncError, match="push\\(\\) before attach"):
            sender.push(hf_model.named_parameters(), version=1)
        wrong = WeightSender(
            actor.address, LearnerConfig(sync_timeout_s=30), dtype="bfloat16", keys=keys_for("learner")
        )
        with pytest.raises(WeightSyncError, match="float32 weights"):
            wrong.attach()
        wrong.close()
    finally:
        sender.close()


class WedgedEngine:
    """An engine whose worker calls never come back (an EngineCore stuck, not dead). A stand-in:
    no real engine can be made to wedge on purpose. Pausing answers; resuming would hang."""

    def __init__(self) -> None:
        self.resumed = 0

    async def collective_rpc(self, *args, **kwargs):
        await anyio.sleep_forever()

    async def pause_generation(self, **kwargs) -> None:
        return None

    async def resume_generation(self) -> None:
        self.resumed += 1
        await anyio.sleep_forever()  # wedged: it never comes back either


def test_an_engine_call_that_never_returns_stops_the_actor(monkeypatch):
    """vLLM bounds the EngineCore's wait for its workers, not the actor's wait for the
    EngineCore: a call past its own bound means a wedged engine, which the actor is told of (it
    stops, and its launcher starts it again) and the exchange fails at once, not waiting on a
    resume the engine would never answer."""
    from millstream.actor.engine_weights import EngineStuck, VllmWeights
    from millstream.shared.wire import TensorSpec, WeightUpdate

    monkeypatch.setattr(VllmWeights, "MARGIN_S", 0.2)
    engine, told = WedgedEngine(), []
    weights = VllmWeights(engine, rpc_timeout_s=0.1, on_stuck=told.append)
    update = WeightUpdate("s", 1, "float32", 4, [TensorSpec("w", [4], 0)])

    async def exchanges() -> None:
        with pytest.raises(EngineStuck, match="millstream_digest did not return in 0s"):
            await weights.digest()
        with pytest.raises(EngineStuck, match="millstream_load"):
            await weights.load(update)

    anyio.run(exchanges, backend="asyncio")  # the actor's loop is asyncio
    assert weights.holds == 0  # a wedged call no longer holds the stall watch off
    assert [type(exc) for exc in told] == [EngineStuck, EngineStuck]
    assert engine.resumed == 0  # not asked to resume (it would not): the actor is stopping


def test_on_nccl_the_load_s_bound_holds_the_broadcast_too():
    """On NCCL a worker receives the broadcast inside `millstream_load`, under a bound of its
    own as long as the sync's: with the same bound on the call, vLLM could give up first, and
    its late answer would be read as the next call's. The load's bound is now both; on gloo the
    broadcast came before (`millstream_receive`), and the bound is the sync's."""
    from millstream.actor.engine_weights import VllmWeights
    from millstream.shared.wire import AttachLearner, TensorSpec, WeightUpdate

    class Recording:
        def __init__(self) -> None:
            self.bounds: dict[str, float] = {}

        async def collective_rpc(self, name, timeout=None, args=()):
            self.bounds[name] = timeout
            return [1]

        async def pause_generation(self, **kwargs) -> None:
            return None

        async def resume_generation(self) -> None:
            return None

    update = WeightUpdate("s", 1, "float32", 4, [TensorSpec("w", [4], 0)])
    for backend, load_bound in (("nccl", 60.0), ("gloo", 30.0)):
        engine = Recording()
        weights = VllmWeights(engine, rpc_timeout_s=30.0)

        async def exchange() -> None:
            await weights.join(AttachLearner("s", "127.0.0.1", 1, 2, backend, 30.0))  # noqa: B023
            await weights.load(update)  # noqa: B023

        anyio.run(exchange, backend="asyncio")
        assert engine.bounds["millstream_load"] == load_bound, backend


class ScriptedEngine:
    """A stand-in engine (the actor's watchdog is under test, not vLLM): each request gets one
    output per entry of `gaps`, that many seconds apart, the last one final. With `hang`, the
    engine goes quiet for good after them, an EngineCore that no longer steps; an abort then
    ends the request with vLLM's empty final output. `holds` maps a gap to a weight call the
    request makes through the actor's real `VllmWeights` ("load" or "join"), whose engine side
    takes that gap's time while no output comes."""

    errored = False
    dead_error = None

    def __init__(self, gaps: list[float], *, hang: bool = False, holds: dict[int, str] | None = None) -> None:
        self.gaps, self.hang, self.holds = gaps, hang, holds or {}
        self.call_s = 0.0
        self.server: Any = None  # set once the server exists
        self.aborted: dict[str, anyio.Event] = {}

    async def generate(self, prompt, params, key):
        from types import SimpleNamespace

        from millstream.shared.wire import AttachLearner, TensorSpec, WeightUpdate

        for i, gap in enumerate(self.gaps):
            self.call_s = gap
            if self.holds.get(i) == "load":
                await self.server.weights.load(WeightUpdate("s", 1, "float32", 4, [TensorSpec("w", [4], 0)]))
            elif self.holds.get(i) == "join":
                await self.server.weights.join(AttachLearner("s", "127.0.0.1", 1, 2, "gloo", 10.0))
            else:
                await anyio.sleep(gap)
            last = i == len(self.gaps) - 1 and not self.hang
            step = {7: SimpleNamespace(logprob=-0.5, rank=1)}
            completion = SimpleNamespace(
                token_ids=[7], logprobs=[step], finish_reason="length" if last else None
            )
            yield SimpleNamespace(outputs=[completion], finished=last)
        if self.hang:
            await self.aborted.setdefault(key, anyio.Event()).wait()
            ended = SimpleNamespace(token_ids=[], logprobs=[], finish_reason="abort")
            yield SimpleNamespace(outputs=[ended], finished=True)  # made by vLLM's front end

    async def abort(self, key) -> None:
        self.aborted.setdefault(key, anyio.Event()).set()

    async def pause_generation(self, **kwargs) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def collective_rpc(self, name, timeout=None, args=()):
        await anyio.sleep(self.call_s)  # the workers' side of a join or a load
        return [1]


def serve_scripted(
    monkeypatch,
    engine: ScriptedEngine,
    requests: list[float],
    run_s: float,
    stall_s: float,
    abort_s: float = 0,
):
    """Serve `engine` behind a real ROUTER for `run_s` s (or until the actor stops), sending one
    request at each of `requests` (seconds from the start), each aborted `abort_s` later if set,
    as the envpool aborts a turn past its timeout; returns the server, the error `serve` ended
    with (None if it served on), and every message the client got."""
    from millstream.actor import server as server_module
    from millstream.shared.config import TransportConfig
    from millstream.shared.wire.transport import open_channel

    monkeypatch.setattr(server_module, "sampling_params", lambda req, interval: None)  # vLLM's; unused
    channel = open_channel(
        "router", "tcp://127.0.0.1:0", bind=True, cfg=TransportConfig(), keys=keys_for("actor")
    )
    server = server_module.ActorServer(
        engine,
        channel,
        model="m",
        dtype="float32",
        weight_ranks=1,
        max_model_len=256,
        vocab_size=50_000,
        stall_timeout_s=stall_s,
    )
    engine.server = server
    sock, got, ended = dealer(channel.address), [], []

    async def client() -> None:
        start = anyio.current_time()
        for n, at in enumerate(requests):
            await anyio.sleep(max(0.0, start + at - anyio.current_time()))
            sock.send(Codec().encode([GenerateRequest(f"r{n}", PROMPT, max_tokens=8)]))
            if abort_s:
                await anyio.sleep(abort_s)
                sock.send(Codec().encode([Abort(f"r{n}")]))
        await anyio.sleep_forever()

    async def body() -> None:
        with anyio.fail_after(run_s + 20):  # a bound for a broken watchdog, not a timing check
            async with anyio.create_task_group() as tg:
                tg.start_soon(client)
                with anyio.move_on_after(run_s):
                    try:
                        await server.serve(stats_every_s=3600)
                    except RuntimeError as exc:
                        ended.append(exc)
                tg.cancel_scope.cancel()

    try:
        anyio.run(body, backend="asyncio")  # the actor's loop is asyncio
        got = raw_replies(sock, 0.2)
    finally:
        sock.close()
    return server, (ended[0] if ended else None), got


def test_an_engine_that_stops_handing_over_output_stops_the_actor(monkeypatch):
    """A single-process engine (one GPU) runs its steps inside the EngineCore, where vLLM bounds
    nothing: one that stops stepping used to leave the actor serving nothing for good, its
    clients timing out turn after turn. With requests live and no tokens for
    `actor.stall_timeout_s`, the actor now stops as wedged, and its launcher starts it again."""
    engine = ScriptedEngine([0.05, 0.05], hang=True)
    server, ended, got = serve_scripted(monkeypatch, engine, requests=[0.0], run_s=15.0, stall_s=0.5)
    assert ended is not None and "is wedged" in str(ended), ended
    assert "no output from the engine in" in str(server.dead) and "1 requests live" in str(server.dead)
    assert [len(m.token_ids) for m in got if isinstance(m, TokenDelta)] == [1, 1]  # what it made, sent


def test_aborts_do_not_keep_a_wedged_engine_looking_alive(monkeypatch):
    """The envpool aborts a turn past its timeout, and vLLM's front end ends an aborted request
    with an empty output of its own, engine or no engine: counted as output, a request aborted
    and sent again more often than the bound kept the stalled engine "alive" for good."""
    engine = ScriptedEngine([], hang=True)  # no step at all: no request gets a token
    requests = [0.4 * n for n in range(30)]  # a new one every 0.4 s, each aborted after 0.3 s
    _server, ended, got = serve_scripted(monkeypatch, engine, requests, run_s=12.0, stall_s=0.8, abort_s=0.3)
    assert ended is not None and "is wedged" in str(ended), ended
    assert any(isinstance(m, TokenDelta) and m.finish_reason == "abort" for m in got)  # aborts did come


def test_a_slow_idle_joining_or_loading_engine_is_not_taken_for_wedged(monkeypatch):
    """Quiet is wedged only while requests are live and no weight call holds the engine: an
    engine idle for longer than the bound (before and after its requests), one slower than the
    bound in total but never quiet for it, one whose workers wait to join a weight group and
    one paused for a load, each longer than the bound, all serve on and finish their requests;
    the holds are the actor's own `VllmWeights` calls, and end with them."""
    gaps = [0.25] * 4 + [1.2, 0.25, 1.2]  # output 0.25 s apart, a 1.2 s join, a 1.2 s load
    engine = ScriptedEngine(gaps, holds={4: "join", 6: "load"})
    server, ended, got = serve_scripted(monkeypatch, engine, requests=[1.2], run_s=6.0, stall_s=0.6)
    assert ended is None and server.dead is None
    finals = [m for m in got if isinstance(m, TokenDelta) and m.finish_reason]
    assert [m.finish_reason for m in finals] == ["length"] and server._live == set()
    assert server.weights.holds == 0


def test_delta_labels_are_never_newer_than_the_weights():
    """An engine output read at version v may hold tokens sampled before the update to v (held
    back by stream_interval, or read late): output k is labelled with the version of read k-2."""
    from millstream.actor.stream import Deltas

    pending = Deltas("r", 3)
    assert pending.add([1], [-0.1], now=3) is None  # read 0: the request's version, 3
    assert pending.add([2, 3], [-0.2, -0.3], now=4) is None  # read 1 at 4: still the request's 3
    assert pending.add([4], [-0.4], now=4) is None  # read 2: labelled as read 0 was, 3
    first = pending.add([5], [-0.5], now=4)  # read 3: labelled as read 1 was, 4: label changes
    assert (first.token_ids, first.logprobs, first.version) == ([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], 3)
    last = pending.take("length", 0)
    assert (last.token_ids, last.logprobs, last.version, last.finish_reason) == ([5], [-0.5], 4, "length")


def test_the_first_token_goes_at_once_then_stream_interval_at_a_time(actor):
    """Time to first token is what a streaming consumer waits on: the first delta holds the
    first token alone, the rest come `actor.stream_interval` (16) at a time, the last shorter."""
    sock = dealer(actor.address)
    try:
        request = GenerateRequest("first-token", PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)
        sock.send(Codec().encode([request]))
        got = raw_replies(sock, 60.0, lambda out: any(getattr(m, "finish_reason", None) for m in out))
    finally:
        sock.close()
    deltas = [m for m in got if isinstance(m, TokenDelta)]
    assert [len(d.token_ids) for d in deltas] == [1, 16, 16, 7], got
    assert deltas[-1].finish_reason == "length"


def test_deltas_send_the_first_tokens_at_once():
    from millstream.actor.stream import Deltas

    pending = Deltas("r", 0)
    assert not pending.due(16)  # nothing waiting
    pending.add([1], [-0.1], now=0)
    assert pending.due(16)  # the first token: at once
    pending.take()
    pending.add([2] * 15, [-0.2] * 15, now=0)
    assert not pending.due(16)  # then 16 at a time
    pending.add([3], [-0.3], now=0)
    assert pending.due(16)


def test_the_engine_processes_are_forked_from_the_actor(actor):
    """`actor.engine_start=auto` on CPU forks vLLM's EngineCore and Worker (actor/engine.py).

    A forked child keeps its parent's address space, so libc sits at the actor's address; an
    exec'd (spawned) child is laid out afresh by address-space randomization (on here:
    randomize_va_space=2), so the two addresses would differ.
    """
    from millstream.shared.process.lifecycle import descendants

    assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"

    def libc_at(pid: int) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return next(line.split("-")[0] for line in f if "/libc.so" in line)

    titles = {
        pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        for pid in descendants(actor.proc.pid)
    }
    engine = {pid: title for pid, title in titles.items() if title.startswith("VLLM::")}
    assert sorted(engine.values()) == ["VLLM::EngineCore", "VLLM::Worker"], engine
    for pid, title in engine.items():
        assert libc_at(pid) == libc_at(actor.proc.pid), title
    # On CPU the EngineCore's busy loop yields to every other thread (shared/process/enginecore.py);
    # the Worker, which computes, keeps the actor's priority.
    nice = {
        title: {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        for pid, title in engine.items()
    }
    assert nice == {
        "VLLM::EngineCore": {19},
        "VLLM::Worker": {os.getpriority(os.PRIO_PROCESS, actor.proc.pid)},
    }
