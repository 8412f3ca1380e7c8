"""A generation as an episode sees it: how it is sampled, what comes back, how it is retried.

`Generation` is what one request produced (tokens, logprobs, per-token policy versions) and
`GenerationFailed` how it failed, with its `Cause` and what had streamed before.

`Sampling` holds what every request of a run's turns shares (token budget, temperature, top-p,
stop ids, the turn's time limit); only the seed changes per turn, and it is an argument of its
own. The worker builds it once from `[envpool]` with `Sampling.for_turns`, and the agent endpoint
and the debugger do the same; the endpoint changes only a call's `max_tokens` (with
`msgspec.structs.replace`). The judge samples by its own `[judge]` section, so it builds its own.

`Retry` is the one retry policy of a generation, used by `ActorClient.generate` (one actor,
through `with_retries`) and `Router.generate` (the run's replicas, in a loop of its own: the hot
path) alike: a request that got no final delta in time, or that the actor refused as
overloaded, or that a lost connection took down (`RETRYABLE_CAUSES`), is sent again up to
`retries` more times after `backoff_s`, then twice that, and so on (`Retry.allows`). The retry
carries the same seed, so the run stays reproducible. Other failures
are never retried: resending a bad request, or one that killed the engine, helps nobody.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import msgspec

from millstream.shared.wire import RETRYABLE_CAUSES, Cause, FailedRequest

if TYPE_CHECKING:
    from millstream.shared.config import EnvPoolConfig

__all__ = ["Generation", "GenerationFailed", "Sampling", "Retry", "NO_RETRY", "with_retries"]

T = TypeVar("T")


@dataclass(slots=True)
class Generation:
    """What one request produced: tokens, their logprobs and per-token policy versions.

    Slotted: one is live per request in flight, 10,000 at a time in a large envpool.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: Per token, the most likely (token id, logprob) pairs, when `Sampling.top_logprobs` > 0.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    #: The id the request had on the wire (a turn's record names it, to find the call later).
    request_id: str = ""
    #: Seconds from sending the request to its first token's arrival (None before it arrives).
    first_token_s: float | None = None


class GenerationFailed(Exception):
    """A generation ended without a final delta; `cause` is the episode's failure cause."""

    def __init__(self, cause: Cause, message: str, *, retryable: bool = True) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause
        #: False where sending the request again cannot help whatever its cause says (no
        #: replica became available within the whole wait: a retry would only wait again).
        self.retryable = retryable
        #: The request that failed and what it had streamed before (the trajectory store keeps
        #: them as the failed episode's scene); set where the request was made.
        self.request_id: str | None = None
        self.partial: Generation | None = None

    def as_request(self, turn: int) -> FailedRequest | None:
        """The failed request as a scene records it: what had streamed, and why it ended."""
        if self.request_id is None:
            return None
        partial = self.partial or Generation()
        return FailedRequest(
            self.request_id, turn, partial.token_ids, partial.logprobs, partial.versions, str(self)[:500]
        )


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """What every request of a kind of turn shares; the seed is per turn and passed apart."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = ()
    #: The turn's time limit: no final delta by then fails it as `actor_timeout` (and may retry).
    timeout_s: float = 60.0
    #: Benchmarks only: generate exactly `max_tokens` (`ignore_eos`) or at least `min_tokens`.
    ignore_eos: bool = False
    min_tokens: int = 0
    #: The agent endpoint's `top_logprobs`: the most likely tokens per step, besides the sampled.
    top_logprobs: int = 0

    @classmethod
    def for_turns(cls, cfg: EnvPoolConfig, stop_token_ids: Sequence[int]) -> Sampling:
        """The run's turns as `[envpool]` configures them, stopping at the chat's stop ids."""
        return cls(
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=tuple(stop_token_ids),
            timeout_s=cfg.turn_timeout_s,
        )


class Retry(msgspec.Struct, frozen=True):
    """Send a failed request again up to `retries` more times, backing off from `backoff_s`."""

    retries: int = 0
    backoff_s: float = 1.0

    @classmethod
    def from_config(cls, cfg: EnvPoolConfig) -> Retry:
        return cls(cfg.actor_retries, cfg.actor_retry_backoff_s)

    def delay(self, attempt: int) -> float:
        """The wait before retry number `attempt + 1` (exponential backoff)."""
        return self.backoff_s * 2**attempt

    def allows(self, failure: GenerationFailed, attempt: int) -> bool:
        """Whether try number `attempt` (0 the first) that failed so may be sent again."""
        return failure.retryable and failure.cause in RETRYABLE_CAUSES and attempt < self.retries


NO_RETRY = Retry()


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    retry: Retry,
    before_retry: Callable[[GenerationFailed, float], Awaitable[None]],
) -> T:
    """`await attempt()` until it returns, retrying the retryable failures as `retry` allows.

    `before_retry(failure, delay_s)` runs between attempts: it counts the retry and waits (the
    router may not wait at all, when another replica can take the request at once).
    """
    for n in range(retry.retries + 1):
        try:
            return await attempt()
        except GenerationFailed as exc:
            if not retry.allows(exc, n):
                raise
            await before_retry(exc, retry.delay(n))
    raise AssertionError("unreachable")
