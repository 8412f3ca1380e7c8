"""The envpool side of the actor connection: many episodes, one DEALER socket.

Every episode task calls `client.generate(...)` and reads its own stream of `TokenDelta`s; all of
them share one socket, one reader task and one writer task (`shared.transport.Channel`), which
packs the requests of a tick into one frame. Replies are routed back to the right episode by
request id through a small bounded stream per request.

Request ids are `<worker>-<counter>`, so they never repeat within a worker and a late reply for a
finished request is recognised and counted (`late_replies`), never delivered to the wrong episode.

A generation either ends with a final delta (finish_reason set) or raises `GenerationFailed`
naming the cause: the actor's `GenerateError`, a timeout, or the episode's own cancellation (which
sends `Abort` so the actor stops spending compute on it).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from shared.protocol import (
    Abort,
    ErrorReply,
    GenerateError,
    GenerateRequest,
    TokenDelta,
)
from shared.transport import Channel

__all__ = ["ActorClient", "Generation", "GenerationFailed", "ClientStats"]

log = logging.getLogger(__name__)


class GenerationFailed(Exception):
    """A generation ended without a final delta; `cause` is stable and short."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


@dataclass
class Generation:
    """What one request produced: tokens, their logprobs and per-token policy versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class ClientStats:
    requests: int = 0
    live: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    late_replies: int = 0
    error_replies: int = 0


class ActorClient:
    """Multiplexes generation requests of many tasks over one DEALER `Channel`.

    Run `client.run()` in a task group; it reads replies and routes them. Each live request holds
    a stream bounded by `per_request_buffer` deltas; the actor coalesces deltas, so a handful is
    plenty, and a slow episode then backs up only its own stream (the reader waits on it, which
    bounds memory rather than dropping tokens).
    """

    def __init__(self, channel: Channel, worker: str, *, per_request_buffer: int = 64) -> None:
        self.channel = channel
        self.worker = worker
        self._ids = itertools.count()
        self._routes: dict[str, MemoryObjectSendStream[TokenDelta | GenerateError]] = {}
        self._buffer = per_request_buffer
        self.stats = ClientStats()

    async def run(self) -> None:
        async for _, messages in self.channel:
            for message in messages:
                if isinstance(message, (TokenDelta, GenerateError)):
                    route = self._routes.get(message.request_id)
                    if route is None:
                        self.stats.late_replies += 1
                        continue
                    try:
                        await route.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        self.stats.late_replies += 1  # its episode ended meanwhile
                elif isinstance(message, ErrorReply):
                    # The actor could not read one of our frames: a bug worth shouting about.
                    self.stats.error_replies += 1
                    log.error("actor rejected a frame: %s: %s", message.cause, message.message)
                else:
                    log.warning("unexpected %s from the actor", type(message).__name__)

    async def generate(self, prompt_token_ids: list[int], *, max_tokens: int, temperature: float,
                       top_p: float, seed: int | None, stop_token_ids: list[int],
                       timeout_s: float) -> Generation:
        """Request a generation and collect its stream; raises `GenerationFailed`."""
        request_id = f"{self.worker}-{next(self._ids)}"
        tx, rx = anyio.create_memory_object_stream[TokenDelta | GenerateError](self._buffer)
        self._routes[request_id] = tx
        self.stats.requests += 1
        self.stats.live += 1
        out = Generation()
        done = False
        try:
            with anyio.fail_after(timeout_s):
                await self.channel.send(GenerateRequest(
                    request_id, prompt_token_ids, max_tokens, temperature, top_p, seed,
                    stop_token_ids))
                async for reply in rx:
                    if isinstance(reply, GenerateError):
                        done = True
                        raise GenerationFailed(f"actor_{reply.cause}", reply.message)
                    out.token_ids.extend(reply.token_ids)
                    out.logprobs.extend(reply.logprobs)
                    out.versions.extend([reply.version] * len(reply.token_ids))
                    if reply.finish_reason is not None:
                        out.finish_reason = reply.finish_reason
                        done = True
                        break
            if out.finish_reason == "abort":
                raise GenerationFailed("actor_abort", "the actor aborted the request")
            self.stats.completed += 1
            return out
        except TimeoutError:
            raise GenerationFailed("actor_timeout", f"no final delta within {timeout_s}s") from None
        finally:
            del self._routes[request_id]
            tx.close()
            rx.close()
            self.stats.live -= 1
            if not done:
                # Cancelled or timed out: tell the actor to stop generating for nobody.
                self.stats.aborted += 1
                try:
                    self.channel.send_nowait(Abort(request_id))
                except anyio.WouldBlock:
                    pass
            elif out.finish_reason is None or out.finish_reason == "abort":
                self.stats.failed += 1
