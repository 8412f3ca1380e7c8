"""One episode as one coroutine: reset, then generate / step until done, token in and token out.

    result = await run_episode(spec, env, chat, client, cfg, max_model_len)

Returns a `Trajectory` (the whole context's token ids, a loss mask that is 1 only on generated
tokens, their behaviour logprobs and policy versions, per-turn rewards) or an `EpisodeFailed` with
a short cause. Causes are how failures are counted, never how they are scored: an environment that
raises (`env_error`), hangs (`env_timeout`), an actor that fails (`actor_*`), a first prompt
longer than the context (`prompt_too_long`), or an episode over its time budget
(`episode_timeout`) produce no reward at all.

Ending by `max_turns` or by a full context is not a failure: the episode is *truncated*, and its
trajectory is trained on with the rewards it earned.

Sampling seeds derive from the group seed, the member index and the turn, so a run is
reproducible and the members of a group still sample differently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from shared.config import EnvPoolConfig
from shared.protocol import EpisodeFailed, Trajectory

from .chat import ChatFormat
from .client import ActorClient, GenerationFailed
from .envs import Env

__all__ = ["EpisodeSpec", "run_episode", "sampling_seed"]


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


class _EnvFailure(Exception):
    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


async def _call_env(what: str, coro_fn, arg, timeout_s: float):
    try:
        with anyio.fail_after(timeout_s):
            return await coro_fn(arg)
    except TimeoutError:
        raise _EnvFailure("env_timeout", f"env.{what} took longer than {timeout_s}s") from None
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # the environment's bug ends this episode, nothing else
        raise _EnvFailure("env_error", f"env.{what} raised {type(exc).__name__}: {exc}") from None


async def run_episode(spec: EpisodeSpec, env: Env, chat: ChatFormat, client: ActorClient,
                      cfg: EnvPoolConfig, max_model_len: int) -> Trajectory | EpisodeFailed:
    started = time.monotonic()
    try:
        with anyio.fail_after(cfg.episode_timeout_s):
            return await _play(spec, env, chat, client, cfg, max_model_len, started)
    except TimeoutError:
        return _failed(spec, "episode_timeout", f"episode took longer than {cfg.episode_timeout_s}s")
    except _EnvFailure as exc:
        return _failed(spec, exc.cause, str(exc))
    except GenerationFailed as exc:
        return _failed(spec, exc.cause, str(exc))


def _failed(spec: EpisodeSpec, cause: str, message: str) -> EpisodeFailed:
    return EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size, cause, message[:500])


async def _play(spec: EpisodeSpec, env: Env, chat: ChatFormat, client: ActorClient,
                cfg: EnvPoolConfig, max_model_len: int, started: float) -> Trajectory:
    obs = await _call_env("reset", env.reset, spec.seed, cfg.step_timeout_s)
    ids = chat.first_prompt(getattr(env, "system_prompt", ""), obs.text)
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    versions = [-1] * len(ids)
    rewards: list[float] = []
    starts: list[int] = []
    ends: list[int] = []
    anchors: list[str] = []
    texts: list[str] = [obs.text]
    for turn in range(cfg.max_turns):
        budget = min(cfg.max_tokens, max_model_len - len(ids))
        if budget < 1:  # only possible before the first turn (later ones are checked below)
            raise _EnvFailure("prompt_too_long", f"the first prompt has {len(ids)} tokens, "
                              f"max_model_len is {max_model_len}")
        gen = await client.generate(
            list(ids), max_tokens=budget, temperature=cfg.temperature, top_p=cfg.top_p,
            seed=sampling_seed(spec.seed, spec.member, turn), stop_token_ids=chat.stop_token_ids,
            timeout_s=cfg.turn_timeout_s)
        starts.append(len(ids))
        anchors.append(obs.anchor)
        ids.extend(gen.token_ids)
        ends.append(len(ids))
        mask.extend([1] * len(gen.token_ids))
        logprobs.extend(gen.logprobs)
        versions.extend(gen.versions)
        response = chat.decode(gen.token_ids)
        result = await _call_env("step", env.step, response, cfg.step_timeout_s)
        rewards.append(float(result.reward))
        texts += [response, result.observation.text]
        if result.done:
            break
        obs = result.observation
        bridge = chat.close_turn(gen.token_ids) + chat.next_prompt(obs.text)
        if len(ids) + len(bridge) >= max_model_len:
            break  # no room to generate another turn: truncated, not failed
        ids.extend(bridge)
        mask.extend([0] * len(bridge))
        logprobs.extend([0.0] * len(bridge))
        versions.extend([-1] * len(bridge))
    return Trajectory(
        episode_id=spec.episode_id, group_id=spec.group_id, seed=spec.seed, env=spec.env_name,
        token_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions,
        reward=sum(rewards), turn_rewards=rewards, num_turns=len(rewards),
        group_size=spec.group_size, duration_s=time.monotonic() - started,
        turn_starts=starts, turn_ends=ends, anchors=anchors, texts=texts)
