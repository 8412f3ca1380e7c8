"""The envpool's router (envpool/actors/router.py) against two real actor processes (synthetic ones:
the routing rules do not depend on the engine): episodes stick to a replica, new ones spread by
load, an overloaded replica sheds, a dead one's turns move and it gets nothing until the
learner announces it again."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import anyio
import pytest
from helpers import keys_for, start_synthetic_actor

from millstream.bench.kit.spawn import stop
from millstream.envpool.actors.generation import GenerationFailed, Retry, Sampling
from millstream.envpool.actors.router import Router
from millstream.shared.config import TransportConfig
from millstream.shared.process.runtime import free_port
from millstream.shared.wire import Cause, ReplicaRef

SLOW = "actor.synthetic_step_s=0.01"  # turns last long enough to overlap


async def _episodes(router: Router, count: int, turns: int, log: dict[str, list[str]]) -> None:
    async def one(i: int) -> None:
        episode = f"e{i}"
        for turn in range(turns):
            await router.generate(
                [1, 2, 3, 4],
                Sampling(max_tokens=8, timeout_s=30),
                seed=i * 100 + turn,
                retry=Retry(3, 0.1),
                affinity=episode,
            )
            log[episode].append(router._sticky[episode])
        router.release(episode)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)


async def _with_router(refs: list[ReplicaRef], body):
    router = Router(TransportConfig(), "test", keys_for("envpool"), refs[0].address)
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        await anyio.sleep(0)
        router.update(refs)
        with anyio.fail_after(20):
            while not all(router.usable(r) for r in router.replicas.values()):
                await anyio.sleep(0.05)
        result = await body(router)
        tg.cancel_scope.cancel()
    return result


@pytest.mark.slow
def test_episodes_stick_to_one_replica_and_spread_by_load(tiny_model_dir, tmp_path):
    a, pa = start_synthetic_actor(tiny_model_dir, tmp_path, SLOW)
    b, pb = start_synthetic_actor(tiny_model_dir, tmp_path, SLOW)
    try:
        served: dict[str, list[str]] = defaultdict(list)

        async def body(router: Router) -> dict:
            await _episodes(router, 40, 3, served)
            return router.statistics()

        stats = anyio.run(_with_router, [ReplicaRef("r0", a, 1), ReplicaRef("r1", b, 1)], body)
    finally:
        stop(pa, grace_s=0)
        stop(pb, grace_s=0)
    assert len(served) == 40 and all(len(set(turns)) == 1 for turns in served.values())  # sticky
    first = Counter(turns[0] for turns in served.values())
    assert min(first.values()) >= 12, first  # least loaded: neither replica takes most of them
    per_replica = stats["replicas"]
    assert per_replica["r0"]["requests"] + per_replica["r1"]["requests"] == 120
    assert stats["retries_by_cause"] == {} and stats["episodes_moved"] == 0


@pytest.mark.slow
def test_an_overloaded_replica_sheds_to_the_other(tiny_model_dir, tmp_path):
    tight, pa = start_synthetic_actor(tiny_model_dir, tmp_path, SLOW, "actor.max_live_requests=2")
    roomy, pb = start_synthetic_actor(tiny_model_dir, tmp_path, SLOW)
    try:
        served: dict[str, list[str]] = defaultdict(list)

        async def body(router: Router) -> dict:
            await _episodes(router, 30, 2, served)
            return router.statistics()

        stats = anyio.run(_with_router, [ReplicaRef("tight", tight, 1), ReplicaRef("roomy", roomy, 1)], body)
    finally:
        stop(pa, grace_s=0)
        stop(pb, grace_s=0)
    assert sum(len(t) for t in served.values()) == 60  # every turn was served
    assert stats["replicas"]["tight"]["refusals"] > 0
    assert stats["retries_by_cause"].get("actor_overloaded", 0) == stats["replicas"]["tight"]["refusals"]
    assert stats["replicas"]["roomy"]["requests"] > stats["replicas"]["tight"]["requests"]


@pytest.mark.slow
def test_a_dead_replicas_turns_move_and_it_waits_for_a_new_epoch(tiny_model_dir, tmp_path):
    """Kill one replica mid-turn: its turns finish on the other. Restarted at its address, it
    gets no request until the learner announces it with a larger epoch (it would otherwise
    generate with version-0 weights before the learner re-attached it)."""
    a, pa = start_synthetic_actor(tiny_model_dir, tmp_path, "actor.synthetic_step_s=0.05")
    b, pb = start_synthetic_actor(tiny_model_dir, tmp_path, "actor.synthetic_step_s=0.05")
    restarted = None
    try:

        async def body(router: Router) -> tuple[dict, dict, dict]:
            nonlocal restarted
            served: dict[str, list[str]] = defaultdict(list)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_episodes, router, 20, 2, served)
                with anyio.fail_after(20):  # turns are live on both
                    while not all(router.replicas[r].client.stats.live for r in ("r0", "r1")):
                        await anyio.sleep(0.01)
                stop(pa, grace_s=0)
            after_kill = router.statistics()
            _, restarted = await anyio.to_thread.run_sync(
                lambda: start_synthetic_actor(tiny_model_dir, tmp_path, address=a)
            )
            with anyio.fail_after(20):  # its connection is back...
                while not router.replicas["r0"].client.connected:
                    await anyio.sleep(0.05)
            await _episodes(router, 10, 1, defaultdict(list))
            before_epoch = router.statistics()  # ...but it got nothing
            router.update([ReplicaRef("r0", a, 2), ReplicaRef("r1", b, 1)])
            await _episodes(router, 20, 1, defaultdict(list))
            return after_kill, before_epoch, router.statistics()

        after_kill, before_epoch, final = anyio.run(
            _with_router, [ReplicaRef("r0", a, 1), ReplicaRef("r1", b, 1)], body
        )
    finally:
        for proc in (pa, pb, restarted):
            if proc is not None:
                stop(proc, grace_s=0)
    assert after_kill["retries_by_cause"].get("actor_lost", 0) >= 1
    assert after_kill["replicas"]["r0"]["lost"] == 1
    assert before_epoch["replicas"]["r0"]["requests"] == after_kill["replicas"]["r0"]["requests"]
    assert final["replicas"]["r0"]["requests"] > before_epoch["replicas"]["r0"]["requests"]


def test_a_replica_connected_while_the_loop_was_busy_is_used(synthetic):
    """The connection's handshake may finish before the client's monitor task first runs (at
    once on loopback without CURVE; with CURVE when the worker's loop is busy right after a new
    replica list): the monitor is attached before the socket connects, so the replica still
    becomes usable. It stayed unusable for good when the monitor came later."""

    async def main() -> bool:
        router = Router(TransportConfig(), "test", keys_for("envpool"), synthetic)
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.run)
            await anyio.sleep(0)
            router.update([ReplicaRef("r0", synthetic, 1)])
            time.sleep(1.0)  # a busy event loop: the handshake completes meanwhile
            with anyio.move_on_after(20):
                while not router.usable(router.replicas["r0"]):
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        return router.usable(router.replicas["r0"])

    assert anyio.run(main)


def test_no_usable_replica_fails_the_turn_once_without_retrying():
    """A replica that never connects: the pick waits out the turn's time limit and the turn
    fails as `actor_timeout`, once. Retrying would wait as long again for the same nothing."""
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens

    async def main():
        router = Router(TransportConfig(), "test", keys_for("envpool"), address)
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.run)
            await anyio.sleep(0)
            router.update([ReplicaRef("r0", address, 1)])
            with pytest.raises(GenerationFailed) as info:
                await router.generate(
                    [1, 2], Sampling(max_tokens=2, timeout_s=0.3), seed=1, retry=Retry(3, 0.01)
                )
            tg.cancel_scope.cancel()
        return info.value, dict(router.retries_by_cause)

    failure, retries = anyio.run(main, backend="trio")
    assert failure.cause == Cause.ACTOR_TIMEOUT and "no actor replica" in str(failure)
    assert retries == {}
