"""One episode as one coroutine: reset, then generate / step until done, token in and token out.

    result = await run_episode(spec, env, chat, client, cfg, max_model_len)

Returns a `Trajectory` (the whole context's token ids, a loss mask that is 1 only on generated
tokens, their behaviour logprobs and policy versions, per-turn rewards) or an `EpisodeFailed` with
its `shared.protocol.Cause`. Causes are how failures are counted, never how they are scored: an
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
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import anyio

from millstream.shared.config import EnvPoolConfig
from millstream.shared.protocol import Cause, EpisodeFailed, Scene, Trajectory, Truncation

from .chat import ChatFormat
from .client import GenerationFailed, TurnClient
from .envs import Env

__all__ = ["EpisodeSpec", "run_episode", "sampling_seed", "call_env", "EnvFailure"]


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    group_id: str
    seed: int
    member: int
    group_size: int
    env_name: str


def sampling_seed(seed: int, member: int, turn: int) -> int:
    return (seed * 1_000_003 + member * 10_007 + turn) % (2**31 - 1)


class EnvFailure(Exception):
    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


async def call_env(what: str, coro_fn, arg, timeout_s: float):
    try:
        # A class-based scope rather than `fail_after` (cheaper, and this runs twice a turn).
        with anyio.CancelScope(deadline=anyio.current_time() + timeout_s) as scope:
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
) -> Trajectory | EpisodeFailed:
    """Play one episode; `starting` (optional) bounds how many environments reset at once."""
    started = time.monotonic()
    ctx = _Context()
    try:
        with anyio.CancelScope(deadline=anyio.current_time() + cfg.episode_timeout_s):
            return await _play(spec, env, chat, client, cfg, max_model_len, started, starting, ctx)
        message = f"episode took longer than {cfg.episode_timeout_s}s"
        return _failed(spec, Cause.EPISODE_TIMEOUT, message, ctx.scene(spec, started))
    except EnvFailure as exc:
        return _failed(spec, exc.cause, str(exc), ctx.scene(spec, started))
    except GenerationFailed as exc:
        return _failed(spec, exc.cause, str(exc), ctx.scene(spec, started, exc))


def _failed(spec: EpisodeSpec, cause: Cause, message: str, scene: Scene | None = None) -> EpisodeFailed:
    return EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size, cause, message[:500], scene)


class _Context:
    """The growing record of one episode: every context it used, concatenated, and its turns.

    Token lists are parallel: ids, loss mask, behaviour logprobs, policy versions. `segment`
    is where the context the model currently sees begins (0 unless the environment asked for a
    fresh context). Per turn: where its reply starts and ends, its reward, the request that
    made it; `texts` alternates observation and reply. A failed episode sends all of it as its
    `Scene`, so the trajectory store shows what happened up to the failure.
    """

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.segment = 0
        self.segment_starts: list[int] = []
        self.rewards: list[float] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.texts: list[str] = []
        self.request_ids: list[str] = []

    def scene(
        self, spec: EpisodeSpec, started: float, failed: GenerationFailed | None = None
    ) -> Scene | None:
        """What the episode had done, and the request that failed, if one did."""
        if not self.ids and failed is None:
            return None  # it failed before its first prompt: there is nothing to see
        request = failed.as_request(len(self.rewards)) if failed is not None else None
        return Scene(
            spec.env_name,
            spec.seed,
            self.ids,
            self.mask,
            self.logprobs,
            self.versions,
            self.rewards,
            self.starts,
            self.ends,
            self.texts,
            self.request_ids,
            time.monotonic() - started,
            request,
        )

    def add_prompt(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def add_generation(self, gen, trained: bool) -> None:
        self.ids.extend(gen.token_ids)
        self.mask.extend([1 if trained else 0] * len(gen.token_ids))
        self.logprobs.extend(gen.logprobs)
        self.versions.extend(gen.versions)

    def visible(self) -> list[int]:
        return self.ids[self.segment :]

    def start_segment(self) -> None:
        self.segment = len(self.ids)
        self.segment_starts.append(self.segment)


async def _play(
    spec: EpisodeSpec,
    env: Env,
    chat: ChatFormat,
    client: TurnClient,
    cfg: EnvPoolConfig,
    max_model_len: int,
    started: float,
    starting: anyio.CapacityLimiter | None,
    ctx: _Context,
) -> Trajectory:
    async with starting or nullcontext():  # bounds envs starting at once (sandboxes, containers)
        obs = await call_env("reset", env.reset, spec.seed, cfg.step_timeout_s)
    system = getattr(env, "system_prompt", "")
    ctx.add_prompt(chat.first_prompt(system, obs.text))
    rewards, starts, ends, texts = ctx.rewards, ctx.starts, ctx.ends, ctx.texts
    anchors: list[str] = []
    texts.append(obs.text)
    invalid = 0
    truncated: Truncation | None = None
    success: bool | None = None
    carried: list[int] = []  # carry-over ids that open the current reply (Delethink)
    if len(ctx.ids) + cfg.max_tokens > max_model_len:
        raise EnvFailure(
            Cause.PROMPT_TOO_LONG,
            f"the first prompt has {len(ctx.ids)} tokens; "
            f"with max_tokens {cfg.max_tokens} that exceeds max_model_len "
            f"{max_model_len}",
        )
    for turn in range(cfg.max_turns):
        gen = await client.generate(
            ctx.visible(),
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=sampling_seed(spec.seed, spec.member, turn),
            stop_token_ids=chat.stop_token_ids,
            timeout_s=cfg.turn_timeout_s,
            retries=cfg.actor_retries,
            backoff_s=cfg.actor_retry_backoff_s,
            affinity=spec.episode_id,
        )
        starts.append(len(ctx.ids))
        ctx.request_ids.append(gen.request_id)
        anchors.append(obs.anchor)
        ctx.add_generation(gen, obs.trained)
        ends.append(len(ctx.ids))
        response = chat.decode(gen.token_ids)
        texts.append(response)
        result = await call_env("step", env.step, response, cfg.step_timeout_s)
        rewards.append(float(result.reward))
        invalid += 0 if result.info.get("valid", True) else 1
        if "success" in result.info:
            success = bool(result.info["success"])
        texts.append(result.observation.text)
        if result.done:
            break
        if turn == cfg.max_turns - 1:
            truncated = Truncation.MAX_TURNS  # no prompt for a turn that is never played
            break
        obs = result.observation
        if obs.new_context:
            # Delethink: a fresh context of the prompt plus the reply's last tokens, as ids.
            reply = carried + gen.token_ids  # a reply that continued a carry-over includes it
            carry = (
                [t for t in reply if t not in chat.stop_token_ids][-obs.carry_tokens :]
                if obs.carry_tokens > 0
                else []
            )
            fresh = chat.first_prompt(system, obs.text)
            if len(fresh) + len(carry) + cfg.max_tokens > max_model_len:
                truncated = Truncation.CONTEXT_FULL
                break
            ctx.start_segment()
            ctx.add_prompt(fresh)
            ctx.add_prompt(carry)  # model tokens, but trained in the turn that produced them
            carried = carry
            continue
        carried = []
        bridge = chat.close_turn(gen.token_ids) + chat.next_prompt(obs.text)
        if len(ctx.visible()) + len(bridge) + cfg.max_tokens > max_model_len:
            truncated = Truncation.CONTEXT_FULL  # no room for a whole turn: trained, not failed
            break
        ctx.add_prompt(bridge)
    return Trajectory(
        episode_id=spec.episode_id,
        group_id=spec.group_id,
        seed=spec.seed,
        env=spec.env_name,
        token_ids=ctx.ids,
        loss_mask=ctx.mask,
        logprobs=ctx.logprobs,
        versions=ctx.versions,
        reward=sum(rewards),
        turn_rewards=rewards,
        num_turns=len(rewards),
        group_size=spec.group_size,
        duration_s=time.monotonic() - started,
        turn_starts=starts,
        turn_ends=ends,
        anchors=anchors,
        texts=texts,
        segment_starts=ctx.segment_starts,
        invalid_actions=invalid,
        truncated=truncated,
        success=success,
        request_ids=ctx.request_ids,
    )
