"""A third-party millstream environment, as an outside package would ship one.

It uses only the documented interface (`millstream.envpool.envs.base.Observation` / `StepResult`) and does
NOT call `register`: millstream finds it through the entry point declared in
`millstream_demo_plugin-0.1.dist-info/entry_points.txt` (group `millstream.envs`), which
importlib.metadata discovers once this folder is on `sys.path` / `PYTHONPATH`.

CoinFlip: two coins, drawn from the episode seed, are guessed one per turn. The answer is
`<answer>heads</answer>` or `<answer>tails</answer>`; a right guess pays 1, a wrong one 0, and
anything else gets the format penalty with `valid=False` (the episode goes on to the next coin).
"""

from __future__ import annotations

import random
import re

from millstream.envpool.envs.base import Observation, StepResult

__all__ = ["CoinFlip"]

_ANSWER = re.compile(r"<answer>\s*(heads|tails)\s*</answer>", re.I)


class CoinFlip:
    system_prompt = "Guess each coin. Answer with <answer>heads</answer> or <answer>tails</answer>."

    def __init__(self, flips: int = 2, format_penalty: float = -0.1) -> None:
        if not 1 <= flips <= 2:
            raise ValueError(f"flips must be 1 or 2, got {flips}")
        self.flips, self.format_penalty = flips, format_penalty
        self._coins: list[str] = []
        self._turn = 0

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self._coins = [rng.choice(("heads", "tails")) for _ in range(self.flips)]
        self._turn = 0
        return Observation(f"Coin 1 of {self.flips} is flipped. Heads or tails?", anchor="coin0")

    async def step(self, action: str) -> StepResult:
        match = _ANSWER.search(action)
        coin = self._coins[self._turn]
        self._turn += 1
        done = self._turn >= self.flips
        text = "" if done else f"Coin {self._turn + 1} of {self.flips} is flipped. Heads or tails?"
        obs = Observation(text, anchor="done" if done else f"coin{self._turn}")
        if match is None:
            return StepResult(obs, self.format_penalty, done, {"valid": False, "success": False})
        right = match.group(1).lower() == coin
        return StepResult(obs, 1.0 if right else 0.0, done, {"valid": True, "success": right, "coin": coin})
