"""One episode as one coroutine: reset, then generate / step until done, token in and token out.

    result = await run_episode(spec, env, chat, client, cfg, max_model_len)

Returns a `Trajectory` (the whole context's token ids, a loss mask that is 1 only on generated
tokens, their behaviour logprobs and policy versions, per-turn rewards) or an `EpisodeFailed` with
its `shared.wire.Cause`. Causes are how failures are counted, never how they are scored: an
environment that raises (`env_error`), hangs (`env_timeout`), an actor that fails (`actor_*`), a
first prompt that leaves no room for `max_tokens` in the context (`prompt_too_long`), or an
episode over its time budget (`episode_timeout`) produce no reward at all.

Ending by `max_turns`, or when the next turn's prompt plus `max_tokens` would not fit
`max_model_len`, is not a failure: the episode is *truncated* (`Trajectory.truncated` says why),
and its trajectory is trained on with the rewards it earned. A turn's budget is never silently
cut below `max_tokens`: a shorter turn would look like the policy's choice to the learner.

The environment may shape the next turn through its observation (envpool/envs/base.py): an
untrained turn (`trained=False`) is generated but masked out of the loss, and `new_context=True`
starts a fresh context (Delethink) that opens with the last `carry_tokens` generated ids; the
trajectory then concatenates the contexts and lists where each begins (`segment_starts`).

Sampling seeds derive from the group seed, the member index and the turn, so a run is
reproducible and the members of a group still sample differently.

Time limits: an episode has one cancel scope. Its own deadline (`episode_timeout_s`) and that of
the environment call in progress (`step_timeout_s`) are kept by the worker's timer wheel
(envpool/deadlines.py), which cancels the scope and says why (`_Clock`); a turn's generation has
its deadline in the client. A scope with a deadline per call, two a turn, cost a worker more CPU
than anything else it did.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import anyio

from millstream.envpool.actors.client import TurnClient
from millstream.envpool.actors.generation import Generation, GenerationFailed, Retry, Sampling
from millstream.envpool.chat import ChatFormat
from millstream.envpool.deadlines import Deadlines, now, running_deadlines
from millstream.envpool.envs import Env, Observation, StepResult
from millstream.envpool.record import EpisodeRecord, EpisodeSpec
from millstream.envpool.seeds import sampling_seed
from millstream.shared.config import EnvPoolConfig
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory, Truncation

__all__ = ["EpisodeSpec", "run_episode", "call_env", "EnvFailure"]


class EnvFailure(Exception):
    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class _Clock:
    """An episode's deadlines on its one cancel scope: whichever fires first cancels it and
    leaves its cause and message in `expired`.

    The wheel fires a deadline in its own task, up to a tick late. A call that returns in the
    same scheduler pass as its deadline fires (it took its whole limit, to within a tick) still
    ends the episode as timed out: the scope is cancelled, and a cancel cannot be taken back.
    Two deadlines in one tick fire in the order they were set (the episode's first).
    """

    __slots__ = ("deadlines", "scope", "limit_s", "expired", "calling")

    def __init__(self, deadlines: Deadlines, scope: anyio.CancelScope, limit_s: float) -> None:
        self.deadlines, self.scope, self.limit_s = deadlines, scope, limit_s
        self.expired: tuple[Cause, str] | None = None
        self.calling: tuple[str, float] = ("", 0.0)  # the env call in progress, and its limit

    def expire(self, cause: Cause, message: str) -> None:
        if self.expired is None:
            self.expired = cause, message
            self.scope.cancel()

    def episode_timed_out(self) -> None:
        self.expire(Cause.EPISODE_TIMEOUT, f"episode took longer than {self.limit_s}s")

    def _call_timed_out(self) -> None:
        what, timeout_s = self.calling
        self.expire(Cause.ENV_TIMEOUT, f"env.{what} took longer than {timeout_s}s")

    async def env_call(self, what: str, coro_fn, arg, timeout_s: float):
        """`await coro_fn(arg)` within `timeout_s`: the environment's exception becomes an
        `EnvFailure` (env_error); running out of time cancels the episode (env_timeout)."""
        self.calling = what, timeout_s
        timer = self.deadlines.call_at(now() + timeout_s, self._call_timed_out)
        try:
            return await coro_fn(arg)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the environment's bug ends this episode, nothing else
            raise EnvFailure(Cause.ENV_ERROR, f"env.{what} raised {type(exc).__name__}: {exc}") from None
        finally:
            self.deadlines.cancel(timer)


async def call_env(what: str, coro_fn, arg, timeout_s: float):
    """One environment call with its own timed scope (the debugger's; episodes use `_Clock`)."""
    try:
        # A class-based scope rather than `fail_after` (cheaper, and this runs twice a turn).
        with anyio.CancelScope(deadline=now() + timeout_s) as scope:
            return await coro_fn(arg)
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # the environment's bug ends this episode, nothing else
        raise EnvFailure(Cause.ENV_ERROR, f"env.{what} raised {type(exc).__name__}: {exc}") from None
    assert scope.cancelled_caught  # only a timeout leaves the scope without a return value
    raise EnvFailure(Cause.ENV_TIMEOUT, f"env.{what} took longer than {timeout_s}s")


async def run_episode(
    spec: EpisodeSpec,
    env: Env,
    chat: ChatFormat,
    client: TurnClient,
    cfg: EnvPoolConfig,
    max_model_len: int,
    starting: anyio.CapacityLimiter | None = None,
    *,
    sampling: Sampling | None = None,
    deadlines: Deadlines | None = None,
) -> Trajectory | EpisodeFailed:
    """Play one episode; `starting` (optional) bounds how many environments reset at once.

    `sampling` is the worker's, built once (`Sampling.for_turns`); without it, built here.
    `deadlines` is the worker's running wheel; without one, the episode runs its own.
    """
    if deadlines is None:
        async with running_deadlines() as own:
            return await run_episode(
                spec, env, chat, client, cfg, max_model_len, starting, sampling=sampling, deadlines=own
            )
    turn = sampling or Sampling.for_turns(cfg, chat.stop_token_ids)
    record = EpisodeRecord(spec)
    try:
        with anyio.CancelScope() as scope:
            clock = _Clock(deadlines, scope, cfg.episode_timeout_s)
            timer = deadlines.call_at(now() + clock.limit_s, clock.episode_timed_out)
            try:
                return await _play(record, env, chat, client, cfg, turn, max_model_len, starting, clock)
            finally:
                deadlines.cancel(timer)
        if clock.expired is None:  # only the clock cancels this scope
            raise RuntimeError("the episode's scope was cancelled without a deadline")
        return record.failed(*clock.expired)
    except EnvFailure as exc:
        return record.failed(exc.cause, str(exc))
    except GenerationFailed as exc:
        return record.failed(exc.cause, str(exc), exc)


async def _play(
    record: EpisodeRecord,
    env: Env,
    chat: ChatFormat,
    client: TurnClient,
    cfg: EnvPoolConfig,
    sampling: Sampling,
    max_model_len: int,
    starting: anyio.CapacityLimiter | None,
    clock: _Clock,
) -> Trajectory:
    """Reset, then generate and step until the environment is done or the context is full."""
    spec = record.spec
    async with starting or nullcontext():  # bounds envs starting at once (sandboxes, containers)
        obs = await clock.env_call("reset", env.reset, spec.seed, cfg.step_timeout_s)
    system = getattr(env, "system_prompt", "")
    record.add_prompt(chat.first_prompt(system, obs.text))
    record.texts.append(obs.text)
    if len(record.ids) + sampling.max_tokens > max_model_len:
        raise EnvFailure(
            Cause.PROMPT_TOO_LONG,
            f"the first prompt has {len(record.ids)} tokens; "
            f"with max_tokens {sampling.max_tokens} that exceeds max_model_len {max_model_len}",
        )
    retry = Retry.from_config(cfg)
    carried: list[int] = []  # carry-over ids that open the current reply (Delethink)
    for turn in range(cfg.max_turns):
        # The generation and the step's result go straight into the record (no local keeps
        # them): what an episode holds while it waits is what 10,000 live episodes cost.
        seed = sampling_seed(spec.seed, spec.member, turn)
        response = _take_reply(
            record,
            chat,
            obs,
            await client.generate(
                record.visible(), sampling, seed=seed, retry=retry, affinity=spec.episode_id
            ),
        )
        obs, done = _take_step(record, await clock.env_call("step", env.step, response, cfg.step_timeout_s))
        if done:
            break
        if turn == cfg.max_turns - 1:
            record.truncated = Truncation.MAX_TURNS  # no prompt for a turn that is never played
            break
        if obs.new_context:
            carried = _fresh_context(
                record, chat, system, obs, carried + record.last_reply(), sampling, max_model_len
            )
            if record.truncated is not None:
                break
            continue
        carried = []
        if not _next_prompt(record, chat, obs, sampling, max_model_len):
            record.truncated = Truncation.CONTEXT_FULL  # no room for a whole turn: trained, not failed
            break
    return record.trajectory()


def _take_reply(record: EpisodeRecord, chat: ChatFormat, obs: Observation, gen: Generation) -> str:
    """A generation into the record, as the reply to `obs`; returns its text for the env."""
    record.add_reply(gen, trained=obs.trained, anchor=obs.anchor)
    response = chat.decode(gen.token_ids)
    record.texts.append(response)
    return response


def _take_step(record: EpisodeRecord, result: StepResult) -> tuple[Observation, bool]:
    """The environment's answer to a reply: its reward, validity, success and next text.

    Returns the next observation and whether the episode is done.
    """
    reward = float(result.reward)
    if not math.isfinite(reward):  # the environment's failure, never a score (a NaN mean in eval)
        raise EnvFailure(Cause.ENV_ERROR, f"the environment's step returned the reward {reward}")
    record.rewards.append(reward)
    record.invalid_actions += 0 if result.info.get("valid", True) else 1
    if "success" in result.info:
        record.success = bool(result.info["success"])
    record.texts.append(result.observation.text)
    return result.observation, result.done


def _next_prompt(
    record: EpisodeRecord, chat: ChatFormat, obs: Observation, sampling: Sampling, max_model_len: int
) -> bool:
    """The last reply closed and the next observation opened, as prompt tokens, when a whole
    turn still fits (`max_model_len`); False when it does not."""
    bridge = chat.close_turn(record.last_reply()) + chat.next_prompt(obs.text)
    if record.visible_length() + len(bridge) + sampling.max_tokens > max_model_len:
        return False
    record.add_prompt(bridge)
    return True


def _fresh_context(
    record: EpisodeRecord,
    chat: ChatFormat,
    system: str,
    obs: Observation,
    reply: list[int],
    sampling: Sampling,
    max_model_len: int,
) -> list[int]:
    """Delethink: a fresh context of the prompt plus the reply's last tokens, as ids.

    `reply` includes the carry-over it continued. Returns the new carry-over, or marks the
    record truncated (`context_full`) when the fresh context leaves no room for a turn.
    """
    carry = (
        [t for t in reply if t not in chat.stop_token_ids][-obs.carry_tokens :]
        if obs.carry_tokens > 0
        else []
    )
    fresh = chat.first_prompt(system, obs.text)
    if len(fresh) + len(carry) + sampling.max_tokens > max_model_len:
        record.truncated = Truncation.CONTEXT_FULL
        return []
    record.start_segment()
    record.add_prompt(fresh)
    record.add_prompt(carry)  # model tokens, but trained in the turn that produced them
    return carry
