"""An agent written only against the official `openai` client, with one tool, as an environment.

The agent (`EvenWordAgent.run`) is what a user would write: it knows nothing of millstream, only
an OpenAI-compatible `base_url` and an API key (envpool/agents/episode.py runs it against the
episode's endpoint, envpool/agents/endpoint.py). Two calls, three messages deep:

1. the user asks for a word to score; the model must call the tool `score_word(text)`
   (`tool_choice` forces the call: the model writes the argument);
2. the agent runs the tool, which returns the share of characters of `text` whose code point is
   even, and sends the result back as a `tool` message;
3. the model writes its final answer.

Reward = half the tool's score (the model's choice of argument) plus half the even share of the
final answer (the model's choice of words), in [0, 1]. As in envpool/envs/checks/evenchars.py, a random
policy scores about 0.5 and every generated character moves the reward, so the tiny random-weight
model learns it in tens of steps, and "reward rose" tests the whole loop through the endpoint.
`valid` says whether the tool call came back well formed.

    envpool.env = "openai_agent"
"""

from __future__ import annotations

import json
from typing import Any

from millstream.envpool.envs.agents.agent import AgentResult
from millstream.envpool.envs.base import register
from millstream.envpool.envs.checks.evenchars import even_share

__all__ = ["EvenWordAgent", "SCORE_TOOL"]

SCORE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "score_word",
        "description": "Score a word: the share of its characters with an even code point.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "the word to score"}},
            "required": ["text"],
        },
    },
}

# Typed loosely: the client's TypedDicts would only restate the schema above.
TOOLS: Any = [SCORE_TOOL]
#: `tool_choice` naming the function: the endpoint forces the call, the model writes the argument.
FORCE_SCORE: Any = {"type": "function", "function": {"name": "score_word"}}


@register("openai_agent")
class EvenWordAgent:
    system_prompt = "You are a helpful assistant with tools."

    # The endpoint bounds each call itself (envpool.turn_timeout_s, retries) and the episode is
    # bounded by envpool.episode_timeout_s; a shorter client timeout only turns a slow first
    # generation (vLLM taking the first weights) into an agent error.
    def __init__(self, request_timeout_s: float = 600.0, model: str = "millstream-policy") -> None:
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.request_timeout_s, self.model = request_timeout_s, model

    async def run(self, seed: int, base_url: str, api_key: str) -> AgentResult:
        from openai import AsyncOpenAI  # the agents extra; only agent runs need it

        client = AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=self.request_timeout_s
        )
        async with client:
            messages: list[Any] = [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": f"Task {seed % 97}: pick a word and score it with score_word."},
            ]
            first = await client.chat.completions.create(
                model=self.model,
                messages=messages,
                tools=TOOLS,
                tool_choice=FORCE_SCORE,
            )
            reply = first.choices[0].message
            calls = reply.tool_calls or []
            word = _argument(calls[0].function.arguments) if calls else None  # type: ignore[union-attr]
            score = even_share(word) if word is not None else 0.0
            messages.append(reply.model_dump(exclude_none=True))
            if calls:
                messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": f"{score:.2f}"})
            final = await client.chat.completions.create(
                model=self.model,
                messages=messages,
                tools=TOOLS,
            )
            answer = final.choices[0].message.content or ""
        reward = 0.5 * score + 0.5 * even_share(answer)
        info = {"valid": word is not None, "success": reward > 0.9, "word": word, "answer": answer}
        return AgentResult(reward, info)


def _argument(arguments: str) -> str | None:
    try:
        value = json.loads(arguments).get("text")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
