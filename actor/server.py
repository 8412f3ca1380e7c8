"""The actor: a vLLM engine behind a ZeroMQ ROUTER socket.

Clients (envpool workers, the learner) send `GenerateRequest`s; the actor streams each request's
new tokens back as `TokenDelta`s, with the logprob of every sampled token and the policy version
whose weights produced it. vLLM's `AsyncLLM` does the continuous batching: every request is one
asyncio task reading its own output stream, and the engine packs all live requests into each step.

Weight updates happen in flight. On a `WeightUpdate` the server pauses the scheduler with
`mode="keep"` (live requests stay queued, nothing is lost), the workers receive the broadcast and
reload (`actor/weights.py`), and generation resumes. Pausing also clears the KV and prefix caches:
live requests are recomputed with the new weights instead of continuing on KV written by the old
ones, and a new request can never hit a cached prefix from old weights. Tokens sampled before the
update keep the old version; tokens after it carry the new one.

Version labels are conservative: the new version is adopted only after `resume_generation`
returns, so a token can at worst be labelled one version *older* than the weights that made it,
never newer. The learner's staleness bound therefore never admits a token that is too old.

Every request ends with exactly one final message: a `TokenDelta` with a finish_reason, or a
`GenerateError` naming the cause. A malformed frame is answered with an `ErrorReply` by the
channel, and the server keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import anyio

from millstream.shared.protocol import (
    Abort,
    ActorInfo,
    AttachLearner,
    ErrorReply,
    GenerateError,
    GenerateRequest,
    Hello,
    Message,
    TokenDelta,
    WeightsApplied,
    WeightUpdate,
)
from millstream.shared.transport import Channel

__all__ = ["ActorServer", "ActorStats", "check_request", "refusal"]

log = logging.getLogger(__name__)


def check_request(req: GenerateRequest, max_model_len: int, vocab_size: int) -> str | None:
    """What is wrong with a request, in words, or None. Shared by every actor kind."""
    if not req.prompt_token_ids:
        return "empty prompt"
    if req.max_tokens < 1:
        return f"max_tokens must be >= 1, got {req.max_tokens}"
    total = len(req.prompt_token_ids) + req.max_tokens
    if total > max_model_len:
        return (f"prompt ({len(req.prompt_token_ids)}) + max_tokens ({req.max_tokens}) = "
                f"{total} exceeds max_model_len {max_model_len}")
    bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"prompt token id {bad} outside the vocabulary [0, {vocab_size})"
    if req.temperature < 0 or not 0 < req.top_p <= 1:
        return f"bad sampling parameters temperature={req.temperature} top_p={req.top_p}"
    return None


def refusal(req: GenerateRequest, live: int, max_live: int, max_model_len: int,
            vocab_size: int) -> GenerateError | None:
    """The error that refuses `req`, or None to serve it. Shared by every actor kind.

    `overloaded` (more than `actor.max_live_requests` held) says "try later" and the envpool
    retries it; `bad_request` says the request itself is wrong and is never retried.
    """
    problem = check_request(req, max_model_len, vocab_size)
    if problem is not None:
        return GenerateError(req.request_id, "bad_request", problem)
    if live >= max_live:
        return GenerateError(req.request_id, "overloaded", f"{live} requests live, the limit "
                             f"(actor.max_live_requests) is {max_live}")
    return None


@dataclass
class ActorStats:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    live: int = 0
    tokens: int = 0
    weight_updates: int = 0
    last_update_paused_s: float = 0.0


class ActorServer:
    """Serves one ROUTER channel with one `AsyncLLM`. Run `serve()` inside an asyncio loop."""

    def __init__(self, engine, channel: Channel, *, model: str, dtype: str, weight_ranks: int,
                 max_model_len: int, vocab_size: int, rpc_timeout_s: float = 600.0,
                 stream_interval: int = 1, max_live_requests: int = 65536) -> None:
        self.engine = engine
        self.max_live_requests = max_live_requests
        self.stream_interval = stream_interval
        self.channel = channel
        self.model = model
        self.dtype = dtype
        self.weight_ranks = weight_ranks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.rpc_timeout_s = rpc_timeout_s
        self.version = 0
        self.session = ""
        self.stats = ActorStats()
        self._live: dict[str, str] = {}  # client-scoped id -> engine request id
        self._update_lock = anyio.Lock()
        #: Set when the engine died; `serve` then raises it, and the process exits non-zero.
        self.dead: BaseException | None = None

    async def serve(self, *, stats_every_s: float = 30.0) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.channel.run)
            tg.start_soon(self._report, stats_every_s)
            tg.start_soon(self._watch_engine, tg.cancel_scope)
            async for peer, messages in self.channel:
                for message in messages:
                    self._dispatch(tg, peer, message)
        if self.dead is not None:
            raise RuntimeError(f"the vLLM engine died: {self.dead!r}") from self.dead

    async def _watch_engine(self, scope: anyio.CancelScope) -> None:
        while self.dead is None:
            await anyio.sleep(0.5)
            if self.engine.errored:
                self.dead = self.engine.dead_error
        log.error("the vLLM engine died (%r); stopping the actor", self.dead)
        scope.cancel()

    def _dispatch(self, tg, peer: bytes, message: Message) -> None:
        if isinstance(message, GenerateRequest):
            tg.start_soon(self._generate, peer, message)
        elif isinstance(message, Abort):
            tg.start_soon(self._abort, peer, message.request_id)
        elif isinstance(message, Hello):
            self.channel.send_nowait(self._info(), to=peer)
        elif isinstance(message, AttachLearner):
            tg.start_soon(self._attach, peer, message)
        elif isinstance(message, WeightUpdate):
            tg.start_soon(self._update, peer, message)
        else:
            self.channel.send_nowait(
                ErrorReply("unexpected_message", f"the actor does not take {type(message).__name__}"),
                to=peer,
            )

    def _info(self) -> ActorInfo:
        return ActorInfo(self.model, self.version, self.weight_ranks, self.max_model_len, self.dtype)

    # --- generation ------------------------------------------------------------------------

    async def _generate(self, peer: bytes, req: GenerateRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        key = f"{peer.hex()}/{req.request_id}"
        if key in self._live:
            refused = GenerateError(req.request_id, "bad_request",
                                    f"request id {req.request_id!r} is already live")
        else:
            refused = refusal(req, len(self._live), self.max_live_requests, self.max_model_len,
                              self.vocab_size)
        if refused is not None:
            self.stats.errors += 1
            await self.channel.send(refused, to=peer)
            return
        params = SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_tokens,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids),
            logprobs=0,  # the sampled token's logprob only
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # token in, token out: text is the envpool's business
            skip_special_tokens=False,
        )
        self._live[key] = key
        self.stats.requests += 1
        self.stats.live += 1
        finish: str | None = None
        # Tokens wait in `pending` until `stream_interval` of them are there (fewer, larger
        # messages at scale); a version change sends them first, so each delta's version is the
        # one every token in it was received under.
        pending_ids: list[int] = []
        pending_logprobs: list[float] = []
        pending_version = self.version

        async def flush(finish: str | None) -> None:
            nonlocal pending_ids, pending_logprobs
            await self.channel.send(TokenDelta(req.request_id, pending_ids, pending_logprobs,
                                               pending_version, finish), to=peer)
            pending_ids, pending_logprobs = [], []

        try:
            async for out in self.engine.generate({"prompt_token_ids": list(req.prompt_token_ids)},
                                                  params, key):
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs or (), ids)]
                if len(logprobs) != len(ids):
                    raise RuntimeError(f"engine returned {len(ids)} tokens, {len(logprobs)} logprobs")
                if out.finished:
                    finish = comp.finish_reason or "stop"
                if pending_ids and self.version != pending_version:
                    await flush(None)
                pending_version = self.version
                pending_ids += ids
                pending_logprobs += logprobs
                self.stats.tokens += len(ids)
                if finish or len(pending_ids) >= self.stream_interval:
                    await flush(finish)
            if finish is None:  # the stream ended without a final output: it was aborted
                finish = "abort"
                await self.channel.send(TokenDelta(req.request_id, [], [], self.version, finish),
                                        to=peer)
        except Exception as exc:  # one request's failure never takes the server down...
            if self.engine.errored:  # ...but a dead engine does: serving errors helps nobody
                self.dead = self.engine.dead_error
            log.exception("request %s failed", key)
            self.stats.errors += 1
            finish = "error"
            await self.channel.send(
                GenerateError(req.request_id, "engine_error", f"{type(exc).__name__}: {exc}"[:500]),
                to=peer,
            )
        finally:
            self._live.pop(key, None)
            self.stats.live -= 1
            if finish == "abort":
                self.stats.aborted += 1
            elif finish != "error":
                self.stats.finished += 1

    async def _abort(self, peer: bytes, request_id: str) -> None:
        key = self._live.get(f"{peer.hex()}/{request_id}")
        if key is not None:
            await self.engine.abort(key)

    # --- weights ---------------------------------------------------------------------------

    async def _attach(self, peer: bytes, msg: AttachLearner) -> None:
        async with self._update_lock:
            try:
                await self.engine.collective_rpc(
                    "millstream_join", timeout=msg.timeout_s + 30,
                    args=(msg.session, msg.host, msg.port, msg.world_size, msg.backend, msg.timeout_s),
                )
            except Exception as exc:
                log.exception("attaching learner session %s failed", msg.session)
                await self.channel.send(ErrorReply("attach_failed", str(exc)[:500]), to=peer)
                return
            self.session = msg.session
            log.info("learner session %s attached", msg.session)
            await self.channel.send(self._info(), to=peer)

    async def _update(self, peer: bytes, msg: WeightUpdate) -> None:
        async with self._update_lock:
            started = time.monotonic()
            try:
                if msg.session != self.session:
                    raise RuntimeError(f"session {msg.session!r} is not attached ({self.session!r} is)")
                await self.engine.pause_generation(mode="keep", clear_cache=True)
                try:
                    specs = [(t.name, list(t.shape), t.offset) for t in msg.tensors]
                    await self.engine.collective_rpc(
                        "millstream_receive", timeout=self.rpc_timeout_s,
                        args=(msg.session, msg.dtype, msg.numel, specs),
                    )
                finally:
                    # Even a failed update must not leave generation frozen.
                    await self.engine.resume_generation()
            except Exception as exc:
                log.exception("weight update to version %d failed", msg.version)
                await self.channel.send(ErrorReply("weight_update_failed", str(exc)[:500]), to=peer)
                return
            self.version = msg.version
            paused = time.monotonic() - started
            self.stats.weight_updates += 1
            self.stats.last_update_paused_s = paused
            log.info("now at policy version %d (paused %.3fs)", msg.version, paused)
            await self.channel.send(WeightsApplied(msg.version, paused), to=peer)

    async def _report(self, every_s: float) -> None:
        while True:
            await anyio.sleep(every_s)
            channel = self.channel.statistics()
            log.info("actor stats %s channel sent=%d recv=%d errors=%d send_queue=%d",
                     asdict(self.stats), channel.sent_messages, channel.recv_messages,
                     channel.decode_errors, channel.send_queue)
