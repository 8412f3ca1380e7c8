"""The actor: a vLLM engine behind a ZeroMQ ROUTER socket.

Clients (envpool workers, the learner) send `GenerateRequest`s; the actor streams each request's
new tokens back as `TokenDelta`s, with the logprob of every sampled token and the policy version
whose weights produced it. vLLM's `AsyncLLM` does the continuous batching: every request is one
asyncio task reading its own output stream, and the engine packs all live requests into each step.

Weight updates happen in flight (the exchange itself is `actor/link.py`, shared with the
synthetic actor). On a `WeightUpdate` the workers receive the broadcast into a buffer they keep,
while the engine goes on generating; then the engine pauses the scheduler with `mode="keep"`
(live requests stay queued, nothing is lost), the workers reload from that buffer
(`actor/weights.py`), and generation resumes. Pausing also clears the KV and prefix caches:
live requests are recomputed with the new weights instead of continuing on KV written by the old
ones, and a new request can never hit a cached prefix from old weights. Tokens sampled before the
update keep the old version; tokens after it carry the new one, except the first two engine
outputs of each request after the update (`Deltas`, actor/stream.py).

Version labels are conservative: the new version is adopted only after `resume_generation`
returns, and an output is labelled with the version of two reads before, so a token can at
worst be labelled one version *older* than the weights that made it, never newer. The
learner's staleness bound therefore never admits a token that is too old.

Every request ends with exactly one final message: a `TokenDelta` with a finish_reason, or a
`GenerateError` naming the cause. A malformed frame is answered with an `ErrorReply` by the
channel, and the server keeps serving. Each message is inside the error boundary of
`actor/boundary.py`: requests are admitted (or refused, by the rules of `actor/admission.py`) as
they are read, so the live bound holds even within one frame; refusals never wait for room in
the send queue; a request's task never ends the server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from millstream.actor.admission import refusal, unexpected
from millstream.actor.boundary import Boundary
from millstream.actor.engine_weights import EngineStuck, VllmWeights
from millstream.actor.link import LearnerLink
from millstream.actor.stream import Deltas, sampling_params
from millstream.shared.wire import (
    Abort,
    ActorInfo,
    GenerateError,
    GenerateRequest,
    Message,
    TurnError,
)
from millstream.shared.wire.transport import Channel

__all__ = ["ActorServer", "ActorStats"]

log = logging.getLogger(__name__)


@dataclass
class ActorStats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    live: int = 0
    tokens: int = 0


class ActorServer:
    """Serves one ROUTER channel with one `AsyncLLM`. Run `serve()` inside an asyncio loop."""

    def __init__(
        self,
        engine: Any,
        channel: Channel,
        *,
        model: str,
        dtype: str,
        weight_ranks: int,
        max_model_len: int,
        vocab_size: int,
        gpus: list[str] | None = None,
        rpc_timeout_s: float = 600.0,
        stall_timeout_s: float = 300.0,
        stream_interval: int = 1,
        max_live_requests: int = 65536,
        max_messages_per_frame: int = 4096,
    ) -> None:
        self.engine = engine
        self.channel = channel
        self.max_live_requests = max_live_requests
        self.stream_interval = stream_interval
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stall_timeout_s = stall_timeout_s
        self.boundary = Boundary(channel, max_messages_per_frame)
        self.weights = VllmWeights(engine, rpc_timeout_s, on_stuck=self._engine_stuck)
        self.link = LearnerLink(
            channel,
            self.weights,
            lambda version: ActorInfo(model, version, weight_ranks, max_model_len, dtype, gpus or []),
            self.boundary,
            tokens=lambda: self.stats.tokens,
        )
        self.stats = ActorStats()
        self._live: set[str] = set()  # engine request ids: "<peer hex>/<client request id>"
        self._aborting: set[str] = set()  # live requests whose abort is under way
        self._output_at = time.monotonic()  # the engine's last output, or the last idle moment
        #: Set when the engine died; `serve` then raises it, and the process exits non-zero.
        self.dead: BaseException | None = None
        #: Set by `drain`: new requests are refused (as overloaded: the router sheds them).
        self.draining = False

    @property
    def version(self) -> int:
        return self.link.version

    async def serve(self, *, stats_every_s: float = 30.0) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.channel.run)
            tg.start_soon(self._report, stats_every_s)
            tg.start_soon(self._watch_engine, tg.cancel_scope)
            async for peer, messages in self.channel:
                for message in self.boundary.frame(peer, messages):
                    self._dispatch(tg, peer, message)
        if self.dead is not None:
            what = "is wedged" if isinstance(self.dead, EngineStuck) else "died"
            raise RuntimeError(f"the vLLM engine {what}: {self.dead}") from self.dead

    def _engine_stuck(self, exc: EngineStuck) -> None:
        """A call into the engine never came back: stop as if it had died (`_watch_engine`),
        so that the launcher starts the actor again; serving on would only time out."""
        self.dead = self.dead or exc

    async def _watch_engine(self, scope: anyio.CancelScope) -> None:
        while self.dead is None:
            await anyio.sleep(0.5)
            # `dead` may have been set meanwhile (`_engine_stuck`, a request that saw it die).
            self.dead = self.dead or (self.engine.dead_error if self.engine.errored else self._stalled())
        what = "is wedged" if isinstance(self.dead, EngineStuck) else "died"
        log.error("the vLLM engine %s (%s); stopping the actor", what, self.dead)
        scope.cancel()

    def _stalled(self) -> EngineStuck | None:
        """A wedged engine, seen from its requests: requests are live, no weight call holds
        the engine (`VllmWeights.holds`), and no tokens have come for `stall_timeout_s`.

        vLLM bounds a step of its worker processes (and dies past it: `engine.errored`), not
        one run inside a single-process engine (one GPU). A working engine hands over tokens
        at least every `stream_interval` steps; an idle one owes nothing. An abort's final
        output is made by vLLM's front end, so it has no tokens and does not count: clients
        aborting what times out would keep a dead engine looking alive. A request held up by
        a full send queue reads nothing for up to a minute (`Channel.send`): hence the floor of 90 s."""
        now = time.monotonic()
        if not self._live or self.weights.holds:
            self._output_at = now
            return None
        quiet_s = now - self._output_at
        if quiet_s <= self.stall_timeout_s:
            return None
        return EngineStuck(
            f"no output from the engine in {quiet_s:.0f}s with {len(self._live)} requests live "
            f"(actor.stall_timeout_s = {self.stall_timeout_s:g})"
        )

    def _dispatch(self, tg: TaskGroup, peer: bytes, message: Message) -> None:
        """Admit, refuse or answer one message now; only admitted work becomes a task."""
        if isinstance(message, GenerateRequest):
            key = f"{peer.hex()}/{message.request_id}"
            refused = self._refusal(key, message)
            if refused is not None:
                self.stats.errors += 1
                self.boundary.refuse(peer, str(refused.cause), refused, refused.message)
                return
            self._live.add(key)  # now, not in the task: the next message of the frame sees it
            tg.start_soon(self.boundary.guarded, self._generate, peer, message, key)
        elif isinstance(message, Abort):
            key = f"{peer.hex()}/{message.request_id}"
            if key in self._live and key not in self._aborting:  # one abort task per live request
                self._aborting.add(key)
                tg.start_soon(self.boundary.guarded, self._abort, key)
        elif self.link.handles(message):
            self.link.dispatch(tg, peer, message)
        else:
            self.boundary.refuse_once(peer, unexpected(message))

    # --- generation: admit, stream, account -------------------------------------------------

    async def _generate(self, peer: bytes, req: GenerateRequest, key: str) -> None:
        """Serve one admitted request: exactly one final TokenDelta or one GenerateError reaches
        `peer` (unless the send queue is full: then it is counted as dropped)."""
        self.stats.requests += 1
        self.stats.live += 1
        finish = "error"
        try:
            finish = await self._stream(peer, req, key)
        except Exception as exc:  # one request's failure never takes the server down...
            if self.engine.errored:  # ...but a dead engine does: serving errors helps nobody
                self.dead = self.engine.dead_error
            if isinstance(exc, TimeoutError):  # a peer that reads nothing: counted, sampled
                self.boundary.bad.event("send_timeout", "request %s failed: %s", key, exc)
            else:
                log.exception("request %s failed", key)
            self.stats.errors += 1
            self.boundary.reply(
                peer,
                GenerateError(req.request_id, TurnError.ENGINE_ERROR, f"{type(exc).__name__}: {exc}"[:500]),
            )
        finally:
            self._live.discard(key)
            self._aborting.discard(key)
            self.stats.live -= 1
            if finish == "abort":
                self.stats.aborted += 1
            elif finish != "error":
                self.stats.finished += 1

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait (at most `timeout_s`) for the live ones to finish;
        returns how many were still live (their clients retry them elsewhere once this replica's
        connection drops)."""
        self.draining = True
        with anyio.move_on_after(timeout_s):
            while self._live:
                await anyio.sleep(0.05)
        return len(self._live)

    def _refusal(self, key: str, req: GenerateRequest) -> GenerateError | None:
        if self.draining:
            return GenerateError(req.request_id, TurnError.OVERLOADED, "this replica is draining")
        if key in self._live:
            return GenerateError(
                req.request_id, TurnError.BAD_REQUEST, f"request id {req.request_id!r} is already live"
            )
        return refusal(req, len(self._live), self.max_live_requests, self.max_model_len, self.vocab_size)

    async def _stream(self, peer: bytes, req: GenerateRequest, key: str) -> str:
        """Forward the engine's output stream as TokenDeltas (labelled as `Deltas` says);
        returns the finish reason."""
        pending = Deltas(req.request_id, self.version)
        finish: str | None = None
        async for out in self.engine.generate(
            {"prompt_token_ids": list(req.prompt_token_ids)},
            sampling_params(req, self.stream_interval),
            key,
        ):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            if ids:  # the engine stepped (`_stalled`: an abort's empty output is no sign of it)
                self._output_at = time.monotonic()
            logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs or (), ids)]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"engine returned {len(ids)} tokens, {len(logprobs)} logprobs")
            if out.finished:
                finish = comp.finish_reason or "stop"
            top = _top_logprobs(comp.logprobs, len(ids), req.top_logprobs) if req.top_logprobs else None
            first = pending.add(ids, logprobs, self.version, top)
            if first is not None:
                await self.channel.send(first, to=peer)
            self.stats.tokens += len(ids)
            if finish or pending.due(self.stream_interval):
                load = len(self._live) if finish else -1
                await self.channel.send(pending.take(finish, load), to=peer)
        if finish is None:  # the stream ended without a final output: it was aborted
            finish = "abort"
            if not pending.ids:
                pending.version = self.version
            await self.channel.send(pending.take(finish, len(self._live)), to=peer)
        return finish

    async def _abort(self, key: str) -> None:
        if key in self._live:
            await self.engine.abort(key)

    async def _report(self, every_s: float) -> None:
        while True:
            await anyio.sleep(every_s)
            channel = self.channel.statistics()
            log.info(
                "actor stats %s refused=%s version=%d updates=%d channel sent=%d recv=%d errors=%d "
                "send_queue=%d",
                asdict(self.stats),
                self.boundary.statistics(),
                self.version,
                self.link.updates,
                channel.sent_messages,
                channel.recv_messages,
                channel.decode_errors,
                channel.send_queue,
            )


def _top_logprobs(steps: Any, n: int, k: int) -> list[list[tuple[int, float]]]:
    """The `k` most likely (token id, logprob) of each of the last `n` steps, most likely first
    (vLLM's per-step dict holds them with their rank, and the sampled token whatever its rank)."""
    return [
        [
            (tid, lp.logprob)
            for tid, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)
            if lp.rank is not None and lp.rank <= k
        ]
        for step in list(steps or ())[-n:]
    ]
