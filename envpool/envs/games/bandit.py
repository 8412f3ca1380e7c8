"""RAGEN's two-armed bandit: a safe arm and a risky arm with the higher expectation.

The safe ("low") arm always pays 0.1; the risky ("high") arm pays 1.0 with probability 0.25 and
0 otherwise (expectation 0.25). The arms carry names (default "phoenix" for low, "dragon" for
high, as in RAGEN) and `swap_names=True` exchanges them, to test whether a policy learned the
payoffs or a semantic bias of the names. One turn. The answer is `<answer>NAME</answer>`; an
answer that is not an arm name gets the format penalty and `valid=False`.

The seed decides the risky arm's payoff, so every episode of a group sees the same outcome for
the same choice (GRPO compares choices, not luck), and the order in which the arms are listed.
"""

from __future__ import annotations

import random

from millstream.envpool.envs.base import Observation, StepResult, parse_answer, register

__all__ = ["Bandit"]


@register("bandit")
class Bandit:
    system_prompt = "You are playing a bandit game. Think, then answer with <answer>ARM</answer>."

    def __init__(
        self,
        low_name: str = "phoenix",
        high_name: str = "dragon",
        swap_names: bool = False,
        low_reward: float = 0.1,
        high_reward: float = 1.0,
        high_prob: float = 0.25,
        format_penalty: float = -0.1,
    ) -> None:
        if swap_names:
            low_name, high_name = high_name, low_name
        if low_name == high_name:
            raise ValueError("the two arms need different names")
        self.low_name, self.high_name = low_name, high_name
        self.low_reward, self.high_reward, self.high_prob = low_reward, high_reward, high_prob
        self.format_penalty = format_penalty
        self._payout = 0.0
        self._order: list[str] = []

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self._payout = self.high_reward if rng.random() < self.high_prob else 0.0
        self._order = [self.low_name, self.high_name]
        rng.shuffle(self._order)
        text = (
            f"There are two arms: {self._order[0]} and {self._order[1]}. "
            "Each pull pays a reward. Which arm do you pull?"
        )
        return Observation(text, anchor="start")

    async def step(self, action: str) -> StepResult:
        answer = parse_answer(action)
        choice = answer[0].strip().lower() if answer else None
        done = Observation("", anchor="done")
        if choice == self.low_name.lower():
            return StepResult(done, self.low_reward, True, {"valid": True, "success": False, "arm": "low"})
        if choice == self.high_name.lower():
            reward = self._payout
            return StepResult(done, reward, True, {"valid": True, "success": reward > 0, "arm": "high"})
        return StepResult(done, self.format_penalty, True, {"valid": False, "success": False})
