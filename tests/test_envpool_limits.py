"""Admission limits and actor trouble: bounded retries, a named error for an absent actor, a
bounded number of environments starting at once, and an actor that refuses work beyond its bound.

Where the test is about the client's retry logic, the other end is a ROUTER socket the test
scripts by hand (`ScriptedPeer`): it answers what the test says, it is not an actor.
"""

import time
from pathlib import Path

import anyio
import helpers
import pytest
import zmq

from millstream.bench.kit.spawn import stop
from millstream.envpool.actors.client import ActorUnreachable, GenerationFailed
from millstream.envpool.actors.generation import Retry, Sampling
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import Observation, StepResult
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.shared.config import EnvPoolConfig
from millstream.shared.process.runtime import free_port
from millstream.shared.wire import (
    Abort,
    Cause,
    Codec,
    GenerateError,
    GenerateRequest,
    Hello,
    TokenDelta,
    Trajectory,
    TurnError,
)
from millstream.shared.wire.keys import secure

ROOT = Path(__file__).resolve().parent.parent


def turn(timeout_s: float) -> Sampling:
    return Sampling(max_tokens=4, stop_token_ids=(0,), timeout_s=timeout_s)


class ScriptedPeer:
    """A ROUTER the test drives: `script(n, request)` returns the reply to the n-th request."""

    def __init__(self, script):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        secure(self.sock, helpers.keys_for("actor"), bind=True)  # the run's keys, as an actor has
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.script, self.codec = script, Codec()
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.peer = b""  # the last sender's routing id

    async def serve(self):
        while True:
            while self.sock.poll(0):
                peer, frame = self.sock.recv_multipart()
                self.peer = peer
                for m in self.codec.decode(frame):
                    if isinstance(m, GenerateRequest):
                        self.requests.append(m)
                        reply = self.script(len(self.requests) - 1, m)
                        if reply is not None:
                            self.sock.send_multipart([peer, self.codec.encode([reply])])
                    elif isinstance(m, Abort):
                        self.aborts.append(m.request_id)
            await anyio.sleep(0.005)


def with_client(address, body, backend="trio"):
    return anyio.run(helpers.with_client, address, body, backend=backend)


def final(request, ids=(5, 6)):
    return TokenDelta(request.request_id, list(ids), [-0.5] * len(ids), 3, "length")


def test_handshake_names_an_absent_actor_after_bounded_tries():
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # connected to, never answers
    secure(silent, helpers.keys_for("actor"), bind=True)
    address = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    started = time.monotonic()

    async def body(client, tg):
        with pytest.raises(ActorUnreachable, match=r"did not answer Hello in 3 tries of 0.2s"):
            await client.handshake(timeout_s=0.2, retries=2, backoff_s=0.05)
        return client.stats.retries

    assert with_client(address, body) == 2
    assert time.monotonic() - started >= 3 * 0.2 + 0.05 + 0.1  # every try and pause was waited
    hellos = 0
    while silent.poll(100):
        hellos += sum(isinstance(m, Hello) for m in Codec().decode(silent.recv_multipart()[1]))
    assert hellos == 3
    silent.close(0)


def test_overloaded_refusal_is_retried_with_the_same_request():
    peer = ScriptedPeer(
        lambda n, r: GenerateError(r.request_id, TurnError.OVERLOADED, "full") if n == 0 else final(r)
    )

    async def body(client, tg):
        tg.start_soon(peer.serve)
        gen = await client.generate([1, 2, 3], turn(5), seed=7, retry=Retry(2, 0.01))
        return gen, client.stats.retries

    gen, retries = with_client(peer.address, body)
    assert gen.token_ids == [5, 6] and gen.versions == [3, 3] and retries == 1
    first, second = peer.requests
    assert first.request_id != second.request_id  # a new id: a late reply cannot be confused
    assert (first.prompt_token_ids, first.seed) == (second.prompt_token_ids, second.seed) == ([1, 2, 3], 7)


# The client parks a waiting request with trio's own API on trio and an anyio Event elsewhere:
# both ways are played.
@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_timed_out_request_is_aborted_then_retried(backend):
    peer = ScriptedPeer(lambda n, r: None if n == 0 else final(r))  # the first one is lost

    async def body(client, tg):
        tg.start_soon(peer.serve)
        return await client.generate([1, 2], turn(0.3), seed=7, retry=Retry(1, 0.01))

    gen = with_client(peer.address, body, backend)
    assert gen.token_ids == [5, 6]
    assert peer.aborts == [peer.requests[0].request_id]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_cancelled_wait_aborts_its_request_and_its_late_reply_is_only_counted(backend):
    replies: list[TokenDelta] = []
    peer = ScriptedPeer(lambda n, r: replies.append(final(r)))  # held back until the wait ends

    async def body(client, tg):
        tg.start_soon(peer.serve)
        with anyio.move_on_after(0.3):
            await client.generate([1, 2], turn(5), seed=7)
        assert client.stats.live == 0 and client.stats.aborted == 1
        peer.sock.send_multipart([peer.peer, peer.codec.encode(replies)])  # now it answers
        with anyio.fail_after(5):
            while client.stats.late_replies < 1:
                await anyio.sleep(0.01)
        # The client still serves: the next request completes.
        peer.script = lambda n, r: final(r, (7,))
        return await client.generate([3], turn(5), seed=8)

    gen = with_client(peer.address, body, backend)
    assert gen.token_ids == [7] and peer.aborts == [peer.requests[0].request_id]


def failure_cause(peer, retries):
    async def body(client, tg):
        tg.start_soon(peer.serve)
        with pytest.raises(GenerationFailed) as info:
            await client.generate([1], turn(5), seed=7, retry=Retry(retries, 0.01))
        return info.value.cause

    return with_client(peer.address, body)


def test_retries_are_bounded_and_other_errors_are_not_retried():
    always_full = ScriptedPeer(lambda n, r: GenerateError(r.request_id, TurnError.OVERLOADED, "full"))
    assert failure_cause(always_full, retries=2) == "actor_overloaded"
    assert len(always_full.requests) == 3  # one try and two retries, then the episode fails
    bad = ScriptedPeer(lambda n, r: GenerateError(r.request_id, TurnError.BAD_REQUEST, "no"))
    assert failure_cause(bad, retries=2) == "actor_bad_request"
    assert len(bad.requests) == 1


class SlowStart:
    """Resets take 0.1 s and record how many run at once."""

    system_prompt = ""
    running = peak = 0

    async def reset(self, seed):
        SlowStart.running += 1
        SlowStart.peak = max(SlowStart.peak, SlowStart.running)
        await anyio.sleep(0.1)
        SlowStart.running -= 1
        return Observation("hi", anchor="start")

    async def step(self, action):
        return StepResult(Observation("", anchor="end"), 0.0, True, {"valid": True})


@pytest.mark.slow
def test_environments_start_at_most_max_starting_envs_at_once(synthetic, tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    cfg = EnvPoolConfig(max_tokens=4, max_starting_envs=3)
    results = []

    async def body(client, tg):
        starting = anyio.CapacityLimiter(cfg.max_starting_envs)

        async def one(i):
            spec = EpisodeSpec(f"e{i}", "g0", seed=1, member=i, group_size=12, env_name="slow")
            results.append(await run_episode(spec, SlowStart(), chat, client, cfg, 1024, starting))

        async with anyio.create_task_group() as episodes:
            for i in range(12):
                episodes.start_soon(one, i)

    started = time.monotonic()
    with_client(synthetic, body)
    assert SlowStart.peak == 3
    assert time.monotonic() - started >= 4 * 0.1  # 12 resets, 3 at a time
    assert len(results) == 12 and all(isinstance(r, Trajectory) for r in results)


@pytest.mark.slow
def test_the_synthetic_actor_refuses_beyond_max_live_requests(tiny_model_dir, tmp_path):
    address, proc = helpers.start_synthetic_actor(
        tiny_model_dir,
        tmp_path,
        "actor.max_num_seqs=2",
        "actor.max_live_requests=4",
        "actor.synthetic_step_s=0.05",
        "actor.synthetic_stop_prob=0",
    )
    try:
        causes = []

        async def body(client, tg):
            async def one():
                try:
                    await client.generate([1, 2], turn(30), seed=7)
                    causes.append("ok")
                except GenerationFailed as exc:
                    causes.append(exc.cause)

            async with anyio.create_task_group() as requests:
                for _ in range(10):
                    requests.start_soon(one)

        with_client(address, body)
        assert causes.count("ok") == 4 and causes.count(Cause.ACTOR_OVERLOADED) == 6, causes
    finally:
        stop(proc, grace_s=0)


@pytest.mark.slow
def test_a_worker_started_before_its_actor_waits_for_the_learner_not_the_handshake(tiny_model_dir, tmp_path):
    """As under `millstream run`: vLLM takes a minute to load, the envpool starts at once.

    The worker greets the actor only after the learner's first version (which the learner sends
    once the actor took its weights), so handshake tries shorter than the actor's start-up do
    not fail the run. Here the stand-in learner announces 3 s after the worker started, once the
    actor is up; the handshake alone (2 tries of 0.5 s) would have given up long before.
    """
    from millstream.envpool.worker import run_worker
    from millstream.shared.config import load_config

    learner = helpers.StandInLearner()
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"actor.connect={address}",
            "train.group_size=2",
            *learner.config(),
            "envpool.env=noop",
            "envpool.actor_connect_timeout_s=0.5",
            "envpool.actor_retries=1",
            "envpool.actor_retry_backoff_s=0.1",
        ],
    )
    procs = []

    async def learner_stand_in():
        await anyio.sleep(3)
        procs.append(
            await anyio.to_thread.run_sync(
                lambda: helpers.start_synthetic_actor(tiny_model_dir, tmp_path, address=address)[1]
            )
        )
        while not learner.done:
            learner.announce(0, 1, final=learner.outcomes["trajectory"] == 2)
            learner.drain()
            await anyio.sleep(0.05)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner_stand_in)
            stats = await run_worker(cfg, 0, None)
            with anyio.fail_after(30):
                while not learner.done:
                    await anyio.sleep(0.05)
        return stats

    try:
        stats = anyio.run(main, backend="trio")
    finally:
        for proc in procs:
            stop(proc, grace_s=0)
        learner.close()
    assert stats.finished == 2 and not stats.failed
