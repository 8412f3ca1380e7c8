"""Episodes of agent environments: an agent talks to an OpenAI-compatible endpoint, not to us.

An *agent environment* is any environment with a `run` method (instead of reset/step):

    class MyAgentEnv:
        async def run(self, seed: int, base_url: str, api_key: str) -> AgentResult: ...

It runs its own agent (LangGraph, smolagents, the OpenAI Agents SDK, a plain loop over the
`openai` client...) against `base_url` (this episode's endpoint, envpool/agents/endpoint.py) with
`api_key`, on the task its `seed` picks, and returns the episode's reward with an `info` dict
(`success`, `valid`, anything else for inspection). Episodes of one group get the same seed.

The endpoint records every model call the agent makes into an `EpisodeRecord`: prompt ids,
generated ids, logprobs and policy versions, token in / token out. When a call's prompt extends
the context so far (previous prompt + previous generation, plus what the template adds) token for
token, it is appended; otherwise a new segment begins (`Trajectory.segment_starts`): the learner
trains each segment as its own sequence, and only generated tokens carry loss. The model's text
is never re-tokenized into the record.

An agent that raises ends the episode as `env_error`, one that overruns
`envpool.episode_timeout_s` as `episode_timeout` (the agent is the whole episode), one that never
called the model as `env_error` too: failures are counted, never scored as reward 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from millstream.envpool.actors.generation import GenerationFailed
from millstream.envpool.envs.agents.agent import AgentEnv, AgentResult, is_agent_env
from millstream.envpool.record import EpisodeRecord, EpisodeSpec, episode_failed
from millstream.shared.config import EnvPoolConfig
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory

if TYPE_CHECKING:
    from millstream.envpool.agents.endpoint import Endpoint

__all__ = ["AgentEnv", "AgentResult", "is_agent_env", "run_agent_episode"]


async def run_agent_episode(
    spec: EpisodeSpec, env: Any, endpoint: Endpoint, cfg: EnvPoolConfig
) -> Trajectory | EpisodeFailed:
    """Run the env's agent against this episode's endpoint; build the trajectory it recorded."""
    record: EpisodeRecord | None = None
    try:
        with endpoint.episode(spec) as (base_url, api_key, record):
            result = await _run_agent(spec, env, base_url, api_key, cfg.episode_timeout_s)
    except GenerationFailed as exc:  # the actor failed one of the agent's calls: its cause wins
        if record is None:
            return episode_failed(spec, exc.cause, str(exc))
        return record.failed(exc.cause, str(exc), exc)
    if isinstance(result, EpisodeFailed):
        return msgspec.structs.replace(result, scene=record.scene(always=True))
    if not isinstance(result, AgentResult):
        return episode_failed(
            spec, Cause.ENV_ERROR, f"agent returned {type(result).__name__}, not AgentResult"
        )
    if record.turns == 0:
        return episode_failed(spec, Cause.ENV_ERROR, "the agent never called the model: nothing to train")
    info = result.info
    # The whole reward on the last call: the env judges the episode, not each call.
    reward = float(result.reward)
    if not math.isfinite(reward):  # the environment's failure, never a score
        return episode_failed(spec, Cause.ENV_ERROR, f"the agent environment returned the reward {reward}")
    record.rewards[-1] = reward
    record.invalid_actions += 0 if info.get("valid", True) else 1
    if "success" in info:
        record.success = bool(info["success"])
    return record.trajectory()


async def _run_agent(
    spec: EpisodeSpec, env: Any, base_url: str, api_key: str, timeout_s: float
) -> AgentResult | EpisodeFailed:
    try:
        with anyio.fail_after(timeout_s):
            return await env.run(spec.seed, base_url, api_key)
    except TimeoutError:
        return episode_failed(spec, Cause.EPISODE_TIMEOUT, f"the agent took longer than {timeout_s}s")
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # the agent's bug ends this episode, nothing else
        return episode_failed(spec, Cause.ENV_ERROR, f"agent raised {type(exc).__name__}: {exc}")
