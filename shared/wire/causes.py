"""Why something ended without a result: the failure causes every role and report shares.

Causes are enums, not free strings: a typo is an error at the sender, every consumer (the
envpool's accounting, the learner's, `millstream stress`, the docs) matches members rather than
prefixes, and an unknown cause on the wire fails decoding like any malformed field. They travel
as their string values, which are also the keys of metrics (`episodes/failed/env_timeout`).
`shared/wire/protocol.py` re-exports them: they are part of the wire.
"""

from __future__ import annotations

import enum

__all__ = [
    "TurnError",
    "Cause",
    "ACTOR_CAUSES",
    "RETRYABLE_CAUSES",
    "TURN_CAUSE",
    "Truncation",
    "DropCause",
    "ReplyCause",
]


class TurnError(enum.StrEnum):
    """Why the actor ended one generation request with a `GenerateError`."""

    #: The request itself is wrong (empty prompt, ids outside the vocabulary, too long, bad
    #: sampling values, an id already live). Never retried.
    BAD_REQUEST = "bad_request"
    #: The actor holds `actor.max_live_requests` already: try later (the envpool retries).
    OVERLOADED = "overloaded"
    #: The engine failed on this request.
    ENGINE_ERROR = "engine_error"


class Cause(enum.StrEnum):
    """Why an episode ended without a trainable trajectory (`EpisodeFailed.cause`).

    A failure is counted under its cause and never scored as a reward.
    """

    #: `env.reset` or `env.step` raised.
    ENV_ERROR = "env_error"
    #: `env.reset` or `env.step` took longer than `envpool.step_timeout_s`.
    ENV_TIMEOUT = "env_timeout"
    #: No final delta within `envpool.turn_timeout_s`, after `envpool.actor_retries` retries.
    ACTOR_TIMEOUT = "actor_timeout"
    #: The actor refused as overloaded on every retry.
    ACTOR_OVERLOADED = "actor_overloaded"
    #: The actor refused the request as malformed.
    ACTOR_BAD_REQUEST = "actor_bad_request"
    #: The engine failed while generating.
    ACTOR_ENGINE_ERROR = "actor_engine_error"
    #: The actor aborted the request (not asked by the envpool).
    ACTOR_ABORT = "actor_abort"
    #: The connection to the actor dropped while the turn ran (the actor died or restarted); the
    #: turn is retried at once (it waits in the socket until an actor is back).
    ACTOR_LOST = "actor_lost"
    #: The actor broke the protocol for this request (e.g. far more deltas than max_tokens allows).
    ACTOR_PROTOCOL = "actor_protocol"
    #: Part of the reply stream never arrived (`TokenDelta.offset` skipped tokens): the actor
    #: dropped a delta to this worker, which had stopped reading or whose queue stayed full.
    #: Retried from the turn's start.
    ACTOR_GAP = "actor_gap"
    #: The episode's first prompt leaves no room for `envpool.max_tokens` in `actor.max_model_len`.
    PROMPT_TOO_LONG = "prompt_too_long"
    #: The whole episode took longer than `envpool.episode_timeout_s`.
    EPISODE_TIMEOUT = "episode_timeout"
    #: The learner finished (or the worker stopped) while the episode ran.
    RUN_ENDED = "run_ended"
    #: The judge (judge.model_path) gave no judgement: its generation failed after
    #: judge.retries, or it timed out.
    JUDGE_FAILED = "judge_failed"
    #: The judge replied, but judge.score_pattern found no score in the reply.
    JUDGE_UNPARSABLE = "judge_unparsable"
    #: A bug in the envpool itself; the episode is still accounted for.
    ENVPOOL_ERROR = "envpool_error"
    #: The envpool worker running the episode died; the learner closed its group when the
    #: worker's next incarnation said hello (the episode never reported).
    WORKER_LOST = "worker_lost"
    #: The episode's result reached a learner process that died before its next checkpoint;
    #: the restarted learner counts these from the workers' totals (learner/episodes/workers.py).
    LEARNER_LOST = "learner_lost"


#: Failures on the actor's side: a long run of them means the actor is gone, not the episodes.
ACTOR_CAUSES = frozenset(
    {
        Cause.ACTOR_TIMEOUT,
        Cause.ACTOR_OVERLOADED,
        Cause.ACTOR_BAD_REQUEST,
        Cause.ACTOR_ENGINE_ERROR,
        Cause.ACTOR_ABORT,
        Cause.ACTOR_PROTOCOL,
        Cause.ACTOR_LOST,
        Cause.ACTOR_GAP,
    }
)
#: Failures that say "try later", not "this request is wrong": the envpool retries them.
RETRYABLE_CAUSES = frozenset({Cause.ACTOR_TIMEOUT, Cause.ACTOR_OVERLOADED, Cause.ACTOR_LOST, Cause.ACTOR_GAP})
#: The episode cause of each actor-side turn error.
TURN_CAUSE = {
    TurnError.BAD_REQUEST: Cause.ACTOR_BAD_REQUEST,
    TurnError.OVERLOADED: Cause.ACTOR_OVERLOADED,
    TurnError.ENGINE_ERROR: Cause.ACTOR_ENGINE_ERROR,
}


class Truncation(enum.StrEnum):
    """Why an episode that is still trained ended before the environment said done."""

    #: It played `envpool.max_turns` turns.
    MAX_TURNS = "max_turns"
    #: The next turn's prompt plus `envpool.max_tokens` would not fit `actor.max_model_len`.
    CONTEXT_FULL = "context_full"


class DropCause(enum.StrEnum):
    """Why the learner dropped a trajectory untrained (counted, never trained)."""

    #: Its oldest generated token is older than the staleness bound allows.
    STALE = "stale"
    #: Its group completed with fewer than 2 trajectories: no baseline.
    GROUP_TOO_SMALL = "group_too_small"
    #: More members arrived than the group has (an upstream bug, kept visible).
    GROUP_OVERFLOW = "group_overflow"
    #: Its token lists disagree in length (an upstream bug, kept visible).
    MALFORMED = "malformed"
    #: Its group was partial when a learner resumed from a checkpoint, and was dropped then
    #: (checkpoints resume partial groups now: learner/persist/replaystate.py).
    INCOMPLETE_AT_RESUME = "incomplete_at_resume"
    #: The group filter `zero_std` removed its group (all rewards equal).
    FILTERED_ZERO_STD = "filtered_zero_std"
    #: The group filter `starpo_s` removed its group (low reward spread).
    FILTERED_STARPO_S = "filtered_starpo_s"
    #: Refused on arrival by the learner's checks (learner/episodes/validate.py, learner/replay.py); the
    #: reason is counted in `episodes/refused/<reason>`.
    INVALID_TRAJECTORY = "invalid_trajectory"
    #: Still buffered when the run ended.
    RUN_ENDED = "run_ended"


class ReplyCause(enum.StrEnum):
    """Why a frame or a control message was refused (`ErrorReply.cause`)."""

    MALFORMED_FRAME = "malformed_frame"
    UNEXPECTED_MESSAGE = "unexpected_message"
    ATTACH_FAILED = "attach_failed"
    WEIGHT_UPDATE_FAILED = "weight_update_failed"
    #: An attach or weight update from a peer that did not authenticate as the run's learner.
    NOT_LEARNER = "not_learner"
    #: A frame carried more than `actor.max_messages_per_frame` messages; the rest were refused.
    TOO_MANY_MESSAGES = "too_many_messages"
    #: The learner link already runs its most exchanges at once; try again later.
    BUSY = "busy"
    #: An attach or weight update sent to a frozen actor (the judge), which takes no weights.
    FROZEN = "frozen"
