"""Episodes of agent environments: an agent talks to an OpenAI-compatible endpoint, not to us.

An *agent environment* is any environment with a `run` method (instead of reset/step):

    class MyAgentEnv:
        async def run(self, seed: int, base_url: str, api_key: str) -> AgentResult: ...

It runs its own agent (LangGraph, smolagents, the OpenAI Agents SDK, a plain loop over the
`openai` client...) against `base_url` (this episode's endpoint, envpool/openai_api.py) with
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

import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from millstream.shared.config import EnvPoolConfig
from millstream.shared.protocol import Cause, EpisodeFailed, Scene, Trajectory, Truncation

from .client import Generation, GenerationFailed
from .envs.agent import AgentEnv, AgentResult, is_agent_env

if TYPE_CHECKING:
    from .episode import EpisodeSpec

__all__ = ["AgentEnv", "AgentResult", "EpisodeRecord", "is_agent_env", "run_agent_episode"]


class EpisodeRecord:
    """The token record of one agent episode: parallel lists, one per context segment."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.segment = 0  # where the current context begins in `ids`
        self.segment_starts: list[int] = []
        self.turn_starts: list[int] = []
        self.turn_ends: list[int] = []
        self.texts: list[str] = []
        self.request_ids: list[str] = []
        self.calls = 0
        self.format_errors = 0
        self.truncated: Truncation | None = None
        #: Set when the episode ended: the trajectory holds these lists, nothing may append.
        self.closed = False

    def visible(self) -> list[int]:
        return self.ids[self.segment :]

    def extends(self, prompt_ids: list[int]) -> bool:
        """Does `prompt_ids` continue the current context token for token?"""
        seen = self.visible()
        return len(prompt_ids) >= len(seen) and prompt_ids[: len(seen)] == seen

    def _add(self, ids: list[int], mask: int, logprobs: list[float], versions: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def add_call(self, prompt_ids: list[int], gen: Generation, text: str) -> bool:
        """Record one model call; returns whether it started a new segment."""
        if self.closed:
            return False
        fresh = bool(self.ids) and not self.extends(prompt_ids)
        if fresh:
            self.segment = len(self.ids)
            self.segment_starts.append(self.segment)
        new = prompt_ids[len(self.visible()) :]
        self._add(new, 0, [0.0] * len(new), [-1] * len(new))
        self.turn_starts.append(len(self.ids))
        self._add(gen.token_ids, 1, gen.logprobs, gen.versions)
        self.turn_ends.append(len(self.ids))
        # Trajectory.texts alternates observation and reply; an agent's "observation" is the
        # messages it sent, which are in the tokens: left empty here, not decoded again.
        self.texts += ["", text]
        self.request_ids.append(gen.request_id)
        self.calls += 1
        return fresh

    def scene(self, spec: EpisodeSpec, started: float, failed: GenerationFailed | None = None) -> Scene:
        """What the agent had done when the episode failed: its calls so far."""
        request = failed.as_request(self.calls) if failed is not None else None
        return Scene(
            spec.env_name,
            spec.seed,
            self.ids,
            self.mask,
            self.logprobs,
            self.versions,
            [0.0] * self.calls,
            self.turn_starts,
            self.turn_ends,
            self.texts,
            self.request_ids,
            time.monotonic() - started,
            request,
        )


async def run_agent_episode(
    spec: EpisodeSpec, env: Any, endpoint: Any, cfg: EnvPoolConfig
) -> Trajectory | EpisodeFailed:
    """Run the env's agent against this episode's endpoint; build the trajectory it recorded.

    `endpoint` is envpool/openai_api.py's `Endpoint` (it opens and closes the episode's route).
    """
    started = time.monotonic()
    record: EpisodeRecord | None = None
    try:
        with endpoint.episode(spec) as (base_url, api_key, record):
            result = await _run_agent(spec, env, base_url, api_key, cfg.episode_timeout_s)
    except GenerationFailed as exc:  # the actor failed one of the agent's calls: its cause wins
        return _failed(spec, exc.cause, str(exc), record.scene(spec, started, exc) if record else None)
    if isinstance(result, EpisodeFailed):
        return msgspec.structs.replace(result, scene=record.scene(spec, started))
    if not isinstance(result, AgentResult):
        return _failed(spec, Cause.ENV_ERROR, f"agent returned {type(result).__name__}, not AgentResult")
    if record.calls == 0:
        return _failed(spec, Cause.ENV_ERROR, "the agent never called the model: nothing to train")
    info = result.info
    return Trajectory(
        episode_id=spec.episode_id,
        group_id=spec.group_id,
        seed=spec.seed,
        env=spec.env_name,
        token_ids=record.ids,
        loss_mask=record.mask,
        logprobs=record.logprobs,
        versions=record.versions,
        reward=float(result.reward),
        # The whole reward on the last call: the env judges the episode, not each call.
        turn_rewards=[0.0] * (record.calls - 1) + [float(result.reward)],
        num_turns=record.calls,
        group_size=spec.group_size,
        duration_s=time.monotonic() - started,
        turn_starts=record.turn_starts,
        turn_ends=record.turn_ends,
        anchors=[f"call{i}" for i in range(record.calls)],
        texts=record.texts,
        segment_starts=record.segment_starts,
        invalid_actions=record.format_errors + (0 if info.get("valid", True) else 1),
        truncated=record.truncated,
        success=bool(info["success"]) if "success" in info else None,
        request_ids=record.request_ids,
    )


async def _run_agent(
    spec: EpisodeSpec, env: Any, base_url: str, api_key: str, timeout_s: float
) -> AgentResult | EpisodeFailed:
    try:
        with anyio.fail_after(timeout_s):
            return await env.run(spec.seed, base_url, api_key)
    except TimeoutError:
        return _failed(spec, Cause.EPISODE_TIMEOUT, f"the agent took longer than {timeout_s}s")
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # the agent's bug ends this episode, nothing else
        return _failed(spec, Cause.ENV_ERROR, f"agent raised {type(exc).__name__}: {exc}")


def _failed(spec: EpisodeSpec, cause: Cause, message: str, scene: Scene | None = None) -> EpisodeFailed:
    return EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size, cause, message[:500], scene)
