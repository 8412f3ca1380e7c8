"""The synthetic actor: a timing model of a continuously batching engine, on the real protocol.

    millstream actor actor.kind=synthetic [actor.synthetic_step_s=0.002 ...]

It is NOT a language model and never claims to be one. It exists so that envpool, learner and
benchmarks can run at scale (thousands of episodes) without vLLM or a GPU. It speaks exactly the
actor's protocol (`GenerateRequest` in, `TokenDelta` / `GenerateError` out, `Abort`, and the weight
sync messages), so the client code under test is the production code.

The model of the engine:
- at most `actor.max_num_seqs` sequences run at once; the rest wait in arrival order;
- each engine step first admits waiting requests into free slots, paying
  `synthetic_prefill_s_per_token` per prompt token, then decodes one token for every running
  sequence, taking `synthetic_step_s + synthetic_step_s_per_seq * running`;
- a token is the end-of-turn token with probability `synthetic_stop_prob` (geometric, long-tailed
  lengths), otherwise a uniformly random id; its logprob is the log of the probability it was
  drawn with, so the numbers are honest for the sampler that made them;
- or, with `synthetic_length_median` > 0, each request draws its output length once from a
  lognormal (median, `synthetic_length_sigma`): a heavy tail like reasoning outputs, where a few
  turns run to the cap (max_tokens) and decide how long a synchronous batch waits; the token at
  that length is the end-of-turn token (logprob 0: it was certain), the others uniform over
  the rest of the vocabulary;
- sampling is seeded per request when the request carries a seed (reproducible runs).

Weight updates are real on the wire, through the same learner link as the vLLM actor
(`actor/link.py`): the actor joins the learner's broadcast group (`shared/wire/weightsync.py`),
receives the flat buffer while it goes on making tokens (so sync time and bytes are measured),
and then adopts the version. The weights themselves are kept only for their digest: there is no
model to load.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from millstream.actor.admission import refusal, unexpected
from millstream.actor.boundary import Boundary
from millstream.actor.link import LearnerLink
from millstream.shared.config import Config
from millstream.shared.wire import (
    Abort,
    ActorInfo,
    AttachLearner,
    GenerateError,
    GenerateRequest,
    Message,
    TokenDelta,
    TurnError,
    WeightUpdate,
)
from millstream.shared.wire.transport import Channel

__all__ = ["SyntheticActor", "model_vocab"]

log = logging.getLogger(__name__)


def model_vocab(model_dir: str) -> tuple[int, int]:
    """(vocab size, end-of-turn token id) from a model directory's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    return int(config["vocab_size"]), int(eos[0] if isinstance(eos, list) else eos)


@dataclass
class _Seq:
    peer: bytes
    req: GenerateRequest
    rng: random.Random
    produced: int = 0
    stop: set[int] = field(default_factory=set)
    #: The drawn output length (lognormal lengths), 0: stop by `synthetic_stop_prob`.
    length: int = 0
    #: Tokens produced but not yet streamed (the first at once, then `actor.stream_interval`).
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)


class SyntheticActor:
    def __init__(self, channel: Channel, cfg: Config, *, model: str, vocab_size: int, eos_id: int) -> None:
        self.channel, self.cfg, self.model = channel, cfg, model
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.boundary = Boundary(channel, cfg.actor.max_messages_per_frame)
        self.link = LearnerLink(
            channel, _SyntheticWeights(self), self._describe, self.boundary, tokens=lambda: self.tokens
        )
        self._waiting: deque[_Seq] = deque()
        self._queued: set[tuple[bytes, str]] = set()  # keys of `_waiting`, for aborts
        self._running: dict[tuple[bytes, str], _Seq] = {}
        self._aborted: set[tuple[bytes, str]] = set()
        self._work = anyio.Event()
        self.steps = 0
        self.tokens = 0
        #: Set by `drain`: new requests are refused (as overloaded: the router sheds them).
        self.draining = False

    @property
    def version(self) -> int:
        return self.link.version

    def _describe(self, version: int) -> ActorInfo:
        a = self.cfg.actor
        return ActorInfo(self.model, version, 1, a.max_model_len, self.cfg.model.dtype)

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.channel.run)
            tg.start_soon(self._engine)
            async for peer, messages in self.channel:
                for message in self.boundary.frame(peer, messages):
                    self._dispatch(tg, peer, message)

    def _dispatch(self, tg: TaskGroup, peer: bytes, message: Message) -> None:
        """Admit, refuse or note one message now (inside actor/boundary.py's boundary)."""
        if isinstance(message, GenerateRequest):
            a = self.cfg.actor
            refused = refusal(
                message,
                len(self._waiting) + len(self._running),
                a.max_live_requests,
                a.max_model_len,
                self.vocab_size,
            )
            key = (peer, message.request_id)
            if refused is None and self.draining:
                refused = GenerateError(message.request_id, TurnError.OVERLOADED, "this replica is draining")
            if refused is None and message.top_logprobs:
                refused = GenerateError(
                    message.request_id,
                    TurnError.BAD_REQUEST,
                    "the synthetic actor has no model to rank tokens by: top_logprobs must be 0",
                )
            if refused is None and (key in self._queued or key in self._running):
                refused = GenerateError(
                    message.request_id,
                    TurnError.BAD_REQUEST,
                    f"request id {message.request_id!r} is already live",
                )
            if refused is not None:
                self.boundary.refuse(peer, str(refused.cause), refused, refused.message)
                return
            stop = set(message.stop_token_ids) | {self.eos_id}
            rng = random.Random(message.seed)
            self._waiting.append(_Seq(peer, message, rng, stop=stop, length=self._draw_length(rng)))
            self._queued.add(key)
            self._work.set()
        elif isinstance(message, Abort):
            key = (peer, message.request_id)
            if key in self._queued or key in self._running:  # an unknown id must not grow the set
                self._aborted.add(key)
                self._work.set()
        elif self.link.handles(message):
            self.link.dispatch(tg, peer, message)
        else:
            self.boundary.refuse_once(peer, unexpected(message))

    def _draw_length(self, rng: random.Random) -> int:
        """A lognormal output length (at least 1), or 0 when lengths come from the stop chance."""
        a = self.cfg.actor
        if a.synthetic_length_median <= 0:
            return 0
        return max(
            1, round(rng.lognormvariate(math.log(a.synthetic_length_median), a.synthetic_length_sigma))
        )

    async def drain(self, timeout_s: float) -> int:
        """As `ActorServer.drain`: refuse new requests, wait for the live ones; returns how many
        were left."""
        self.draining = True
        with anyio.move_on_after(timeout_s):
            while self._waiting or self._running:
                await anyio.sleep(0.05)
        return len(self._waiting) + len(self._running)

    async def _engine(self) -> None:
        a = self.cfg.actor
        stop_p = a.synthetic_stop_prob
        other_lp = math.log((1 - stop_p) / self.vocab_size) if stop_p < 1 else -math.inf
        stop_lp = math.log(stop_p) if stop_p > 0 else -math.inf
        while True:
            if not self._waiting and not self._running:
                self._work = anyio.Event()
                with anyio.move_on_after(1.0):  # idle; bounded so aborts of queued work drain
                    await self._work.wait()
                continue
            prefill = 0
            while self._waiting and len(self._running) < a.max_num_seqs:
                seq = self._waiting.popleft()
                self._queued.discard((seq.peer, seq.req.request_id))
                self._running[(seq.peer, seq.req.request_id)] = seq
                prefill += len(seq.req.prompt_token_ids)
            await anyio.sleep(
                a.synthetic_step_s
                + a.synthetic_step_s_per_seq * len(self._running)
                + a.synthetic_prefill_s_per_token * prefill
            )
            self.steps += 1
            async with self.link.swap:  # no token is produced while weights are being swapped in
                for key, seq in list(self._running.items()):
                    await self._decode_one(key, seq, stop_p, stop_lp, other_lp)

    async def _decode_one(
        self, key: tuple[bytes, str], seq: _Seq, stop_p: float, stop_lp: float, other_lp: float
    ) -> None:
        if key in self._aborted:
            self._aborted.discard(key)
            del self._running[key]
            await self._flush(seq, "abort")
            return
        if seq.length:  # lognormal lengths: the end-of-turn token exactly at the drawn length
            if seq.produced + 1 >= seq.length:
                token, logprob = self.eos_id, 0.0
            else:  # any token but the end-of-turn one, which would cut the drawn length
                token = seq.rng.randrange(self.vocab_size - 1)
                token, logprob = token + (token >= self.eos_id), -math.log(self.vocab_size - 1)
        elif seq.rng.random() < stop_p:
            token, logprob = self.eos_id, stop_lp
        else:
            token, logprob = seq.rng.randrange(self.vocab_size), other_lp
        seq.produced += 1
        self.tokens += 1
        seq.pending_ids.append(token)
        seq.pending_logprobs.append(logprob)
        stops = token in seq.stop and not seq.req.ignore_eos and seq.produced >= seq.req.min_tokens
        finish = "stop" if stops else "length" if seq.produced >= seq.req.max_tokens else None
        if finish:
            del self._running[key]
        # The first token goes at once, as the vLLM actor's does (actor/stream.py, Deltas.due).
        if finish or seq.produced == 1 or len(seq.pending_ids) >= self.cfg.actor.stream_interval:
            await self._flush(seq, finish)

    async def _flush(self, seq: _Seq, finish: str | None) -> None:
        """Stream the pending tokens of `seq` (all made under `self.version`)."""
        ids, logprobs = seq.pending_ids, seq.pending_logprobs
        seq.pending_ids, seq.pending_logprobs = [], []
        load = len(self._waiting) + len(self._running) if finish else -1
        # The offset counts tokens made, not sent: a delta dropped below leaves a gap the client
        # sees (and fails the turn for) instead of a short output that looks whole.
        offset = seq.produced - len(ids)
        delta = TokenDelta(seq.req.request_id, ids, logprobs, self.version, finish, load, offset=offset)
        try:  # waits for room (backpressure), but a queue full for a minute drops, counted
            await self.channel.send(delta, to=seq.peer)
        except TimeoutError as exc:
            self.boundary.refused["reply_dropped"] += 1
            self.boundary.bad.event("reply_dropped", "dropped a delta: %s", exc)

    async def flush_all(self) -> None:
        """Stream every running sequence's pending tokens (before the version changes)."""
        for seq in self._running.values():
            if seq.pending_ids:
                await self._flush(seq, None)


class _SyntheticWeights:
    """The synthetic engine's side of the learner link: join the group for real, receive the
    broadcast for real into a kept buffer (actor/receive.py, so its time and bytes are measured
    as a real engine's are), while tokens go on being made; then load nothing."""

    def __init__(self, actor: SyntheticActor) -> None:
        from millstream.actor.receive import WeightReceiver

        self.actor = actor
        self._group: Any = None
        self._store: Any = None
        self._timeout_s = 0.0
        # All this engine keeps of the weights: the buffer, for its digest (`digest`), so a test
        # or a user can check that every replica received what the learner sent.
        self._receiver = WeightReceiver()

    async def join(self, msg: AttachLearner) -> None:
        from millstream.shared.wire.weightsync import make_group, open_store

        def join() -> tuple[Any, Any]:
            store = open_store(msg.host, msg.port, msg.world_size, is_master=False, timeout_s=msg.timeout_s)
            rank = msg.first_rank
            return make_group(store, rank, msg.world_size, msg.backend, msg.timeout_s, msg.session), store

        self._group, self._store = await anyio.to_thread.run_sync(join)
        self._timeout_s = msg.timeout_s

    async def receive(self, msg: WeightUpdate) -> None:
        self._receiver.start(self._group, msg.dtype, msg.numel, msg.piece_ends, "cpu", self._timeout_s)
        await anyio.to_thread.run_sync(self._receiver.wait, self._timeout_s)

    async def load(self, msg: WeightUpdate) -> None:
        await self.actor.flush_all()  # tokens made under the old version go out first
        self._receiver.loaded()

    async def digest(self) -> tuple[float, float, int]:
        return await anyio.to_thread.run_sync(self._receiver.digest)
