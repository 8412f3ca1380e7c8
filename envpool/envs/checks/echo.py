"""The cheapest multi-turn environment: it echoes the model's reply back, for transport stress.

An episode has exactly `turns` turns (default 2). Each observation after the first quotes the
model's last valid reply, cut to `max_echo_chars` characters (default 64), so the envpool,
the chat context and the transport carry real model text in both directions at almost no
environment cost.

A reply is valid when it is non-empty and contains neither NUL nor U+FFFD (the replacement
character that decoding puts where the tokens were not valid UTF-8): a valid turn earns
1/turns, so a fully valid episode returns 1.0. An invalid reply gets `format_penalty`
(default -0.1) and `valid=False`, and, as in RAGEN (Wang et al. 2025, "RAGEN: Understanding
Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning"), the episode goes on with
the state unchanged: the observation keeps quoting the last valid reply, so invalid bytes are
never echoed into the next prompt. The turn still counts: the episode's length is fixed.
`success` is per turn: the reply was valid.

Anchors: f"turn{k}", k = turns taken. The quoted text is left out on purpose: rewards depend on
the turn and the reply only, never on what is quoted, so the turn index is the whole state that
matters for GiGPO's comparison across a group.
"""

from __future__ import annotations

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = ["Echo", "is_clean_reply"]


def is_clean_reply(text: str) -> bool:
    """Non-empty, no NUL, no U+FFFD (undecodable bytes)."""
    return bool(text) and "\x00" not in text and "\ufffd" not in text


@register("echo")
class Echo:
    system_prompt = ""

    def __init__(
        self,
        turns: int = 2,
        max_echo_chars: int = 64,
        format_penalty: float = -0.1,
        prompt: str = "Say something short.",
    ) -> None:
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        if isinstance(max_echo_chars, bool) or not isinstance(max_echo_chars, int) or max_echo_chars < 0:
            raise ValueError(f"max_echo_chars must be an integer >= 0, got {max_echo_chars!r}")
        if (
            isinstance(format_penalty, bool)
            or not isinstance(format_penalty, (int, float))
            or not format_penalty <= 0
        ):
            raise ValueError(f"format_penalty must be a number <= 0, got {format_penalty!r}")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {prompt!r}")
        self.turns, self.max_echo_chars = turns, max_echo_chars
        self.format_penalty, self.prompt = float(format_penalty), prompt
        self._turn = 0
        self._echo = ""

    async def reset(self, seed: int) -> Observation:
        self._turn, self._echo = 0, ""
        return Observation(self.prompt, anchor="turn0")

    async def step(self, action: str) -> StepResult:
        self._turn += 1
        valid = is_clean_reply(action)
        if valid:
            self._echo = action[: self.max_echo_chars]
        done = self._turn >= self.turns
        text = "" if done else f"You said: {self._echo}\nSay something else."
        reward = 1.0 / self.turns if valid else self.format_penalty
        return StepResult(
            Observation(text, anchor=f"turn{self._turn}"), reward, done, {"valid": valid, "success": valid}
        )
