"""A dense, trivially learnable environment for checking that the whole loop learns.

Reward of a turn = the share of characters of the model's response whose Unicode code point is
even ("b", "d", " ", "\\n", ...), split evenly over the turns so an episode's return lies in
[0, 1]. An empty response scores 0.

Why this task: a random policy scores about 0.5, every token has an immediate, unambiguous effect,
and the optimum (only even characters) is reachable by any tokenizer. A sign error anywhere in the
loop (advantages, loss, logprobs, the weight broadcast) makes the reward fall toward 0 instead of
rising toward 1, so "the reward rose" really tests the loop. It is multi-turn (`turns`, default
2) so the token-in/token-out context handling is exercised too.
"""

from __future__ import annotations

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = ["EvenChars", "even_share"]


def even_share(text: str) -> float:
    if not text:
        return 0.0
    return sum(1 for c in text if ord(c) % 2 == 0) / len(text)


@register("evenchars")
class EvenChars:
    system_prompt = ""

    def __init__(self, turns: int = 2, prompt: str = "Write anything.") -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.turns = turns
        self.prompt = prompt
        self._turn = 0

    async def reset(self, seed: int) -> Observation:
        self._turn = 0
        return Observation(self.prompt, anchor="turn0")

    async def step(self, action: str) -> StepResult:
        self._turn += 1
        share = even_share(action)
        done = self._turn >= self.turns
        obs = Observation("" if done else "Again.", anchor=f"turn{self._turn}")
        return StepResult(
            obs, share / self.turns, done, {"valid": True, "success": share > 0.9, "even_share": share}
        )
