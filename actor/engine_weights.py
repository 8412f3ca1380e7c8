"""The vLLM engine's side of the learner link: its workers join the weight group, receive a
broadcast while the engine generates, and load it with generation paused; every call into the
engine has a deadline of its own, and one that misses it means a wedged engine.

actor/link.py drives it (the same exchange as the synthetic actor's); actor/weights.py is the
other side, the methods each vLLM worker runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio

from millstream.shared.wire import AttachLearner, WeightUpdate
from millstream.shared.wire.weightsync import session_tag

__all__ = ["EngineStuck", "VllmWeights"]

log = logging.getLogger(__name__)


class EngineStuck(RuntimeError):
    """A call into the engine that did not come back: the engine is wedged, not dead."""


class VllmWeights:
    """The vLLM engine's side of the learner link: its workers join the group, receive, reload.

    The receive runs in each worker's own thread while the engine generates (actor/weights.py,
    actor/receive.py); this side polls the workers until every piece is in, backing off from
    5 to 20 ms: each poll is one `collective_rpc`, which the engine serves between two steps
    (the longest wait is also the most a push can lose to polling).
    Only the load pauses generation. Pausing with `mode="keep"` leaves live requests queued;
    `clear_cache=True` drops the KV and prefix caches, so live requests are recomputed with the
    new weights and no new request reuses a prefix cached under the old ones (the cost:
    recomputing prompts in flight).

    Every weight call into the engine has a deadline of its own: vLLM's `timeout=` bounds only
    the EngineCore's wait for its workers (and not at all with one worker, whose executor runs
    in the EngineCore), not the actor's wait for the EngineCore. A call that misses its
    deadline (vLLM's bound again, at least `MARGIN_S`, on top of it: a load on NCCL holds the
    broadcast too) means a wedged engine, which no later call would find better: `on_stuck` is
    told (the actor then stops, and its launcher starts it again), the exchange fails with
    `EngineStuck`, and no resume is asked of it. A broadcast that never completes (the learner
    died in the middle) is not that: it fails the update with a TimeoutError.
    """

    #: First and longest wait between two polls of the workers' receive, seconds.
    POLL_S = (0.005, 0.02)
    #: How long past vLLM's own bound a call may take before the engine counts as wedged.
    MARGIN_S = 60.0

    def __init__(
        self, engine: Any, rpc_timeout_s: float, on_stuck: Callable[[EngineStuck], None] = lambda _: None
    ) -> None:
        self.engine = engine
        self.rpc_timeout_s = rpc_timeout_s
        self.on_stuck = on_stuck
        self.stuck = False
        #: Weight calls into the engine under way, and loads from pause to resume: the engine
        #: owes no output meanwhile (a join holds the workers until the group forms; a load
        #: pauses generation), and each has its own deadline (`_call`).
        self.holds = 0
        self.backend = ""  # the weight group's, once joined

    async def _call(self, what: str, timeout_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
        """`engine.<method>(*args, **kwargs)`, given twice `timeout_s` (at least MARGIN_S more)."""
        limit_s = timeout_s + max(self.MARGIN_S, timeout_s)
        self.holds += 1
        try:
            with anyio.fail_after(limit_s):
                return await getattr(self.engine, method)(*args, **kwargs)
        except TimeoutError:
            self.stuck = True
            stuck = EngineStuck(f"the engine's {what} did not return in {limit_s:.0f}s")
            self.on_stuck(stuck)
            raise stuck from None
        finally:
            self.holds -= 1

    async def _rpc(self, name: str, timeout_s: float, *args: Any) -> list[Any]:
        return await self._call(name, timeout_s, "collective_rpc", name, timeout=timeout_s, args=args)

    async def join(self, msg: AttachLearner) -> None:
        # One answer per vLLM worker (one per tensor-parallel rank): the group ranks they took.
        join = (msg.session, msg.host, msg.port, msg.world_size, msg.backend, msg.timeout_s, msg.first_rank)
        ranks = await self._rpc("millstream_join", msg.timeout_s + 30, *join)
        self.backend = msg.backend
        log.info(
            "vLLM workers joined weight group %s as ranks %s of %d",
            session_tag(msg.session),
            ranks,
            msg.world_size,
        )

    async def digest(self) -> tuple[float, float, int]:
        """What the workers loaded last; with tensor parallelism each loaded the whole buffer
        (and kept its shard), so each must have the learner's digest: the first that differs
        is returned, else the common one."""
        parts = await self._rpc("millstream_digest", self.rpc_timeout_s)
        return next((tuple(p) for p in parts if tuple(p) != tuple(parts[0])), tuple(parts[0]))

    async def receive(self, msg: WeightUpdate) -> None:
        timeout_s = self.rpc_timeout_s
        await self._rpc("millstream_receive", timeout_s, msg.session, msg.dtype, msg.numel, msg.piece_ends)
        wait_s, longest_s = self.POLL_S
        end = anyio.current_time() + timeout_s  # the broadcast's; each poll has its own deadline
        while not all(await self._rpc("millstream_received", timeout_s)):
            if anyio.current_time() > end:
                raise TimeoutError(f"the weights did not all arrive in {timeout_s:.0f}s")
            await anyio.sleep(wait_s)
            wait_s = min(2 * wait_s, longest_s)

    async def load(self, msg: WeightUpdate) -> None:
        timeout_s = self.rpc_timeout_s
        self.holds += 1
        try:
            await self._call("pause", timeout_s, "pause_generation", mode="keep", clear_cache=True)
            try:
                specs = [(t.name, list(t.shape), t.offset) for t in msg.tensors]
                # On NCCL the broadcast itself runs in the load (actor/receive.py), with a bound
                # of its own as long as this one: the load's bound is both. Were it one, vLLM could
                # give up first, and the late answer would be read as the next call's.
                bound = 2 * timeout_s if self.backend == "nccl" else timeout_s
                await self._rpc("millstream_load", bound, msg.session, specs)
            finally:  # even a failed update must not freeze generation; a cancelled one neither
                if not self.stuck:  # a wedged engine would not resume: the actor is stopping
                    with anyio.CancelScope(shield=True):
                        await self._call("resume", timeout_s, "resume_generation")
        finally:
            self.holds -= 1
