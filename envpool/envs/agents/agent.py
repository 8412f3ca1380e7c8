"""What an *agent* environment is: it runs an agent against an OpenAI-compatible endpoint.

    class MyAgentEnv:
        async def run(self, seed: int, base_url: str, api_key: str) -> AgentResult: ...

Instead of reset/step, the environment runs its own agent (any framework that speaks the OpenAI
API) against `base_url` with `api_key`, on the task its `seed` picks (episodes of one group get
the same seed), and returns the episode's reward and an `info` dict (`valid`, `success`, anything
else for inspection). envpool/agents/episode.py runs it and records what the model generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["AgentEnv", "AgentResult", "is_agent_env"]


@dataclass(frozen=True)
class AgentResult:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AgentEnv(Protocol):
    async def run(self, seed: int, base_url: str, api_key: str) -> AgentResult: ...


def is_agent_env(env: object) -> bool:
    """An environment with `run` and no `step` is an agent environment."""
    return callable(getattr(env, "run", None)) and not callable(getattr(env, "step", None))
