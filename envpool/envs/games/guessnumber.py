"""Guess the number: find a secret number in 1..`high` from "higher" / "lower" hints.

The classic binary-search game, as TextArena's GuessTheNumber plays it. The seed draws the
secret uniformly from 1..`high`. Each turn the answer is one integer, `<answer>8</answer>`, and
the environment replies whether the secret is higher or lower. A correct guess pays 1 and ends
the episode (success); after `max_guesses` wrong guesses it ends with 0. The defaults,
`high=15` and `max_guesses=4`, fit the default 4 turns and leave no slack: binary search finds
any of 2**4 - 1 = 15 numbers in 4 guesses, so only a policy that halves the interval every time
always wins.

An answer that is missing, not a single integer, or outside 1..`high` is invalid: it gets
`format_penalty` (default -0.1), `valid=False`, and does not count as a guess (nothing changes,
as for every invalid action in these environments); the turn limit still bounds the episode. A
guess inside 1..`high` but outside what the hints already allow is valid: it costs a guess and
teaches nothing.

Anchor: what the player knows, "lo-hi/left": the interval the hints leave and the guesses left,
so two episodes that reached the same knowledge by different guesses (8 then 4, or 4 then 8)
share it; "solved" once the number is found.
"""

from __future__ import annotations

import random
import re

from millstream.envpool.envs.base import Observation, StepResult, parse_answer, register

__all__ = ["GuessNumber"]

#: A guess: an integer of at most 6 digits (longer ones are out of range anyway, and int() of a
#: huge string is slow).
_INTEGER = re.compile(r"[+-]?\d{1,6}", re.ASCII)


@register("guessnumber")
class GuessNumber:
    system_prompt = (
        "Guess the secret number. After each guess you are told whether the number is "
        "higher or lower. Answer with one number, like <answer>8</answer>."
    )

    def __init__(self, high: int = 15, max_guesses: int = 4, format_penalty: float = -0.1) -> None:
        if not isinstance(high, int) or not 2 <= high <= 1_000_000:
            raise ValueError(f"high must be an integer in [2, 1000000], got {high!r}")
        if not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"max_guesses must be an integer >= 1, got {max_guesses!r}")
        self.high, self.max_guesses, self.format_penalty = high, max_guesses, format_penalty
        self.secret = 0
        self.lo, self.hi, self.left = 1, high, max_guesses
        self._done = True

    async def reset(self, seed: int) -> Observation:
        self.secret = random.Random(seed).randint(1, self.high)
        self.lo, self.hi, self.left = 1, self.high, self.max_guesses
        self._done = False
        text = f"The number is between 1 and {self.high}. You have {self.max_guesses} guesses."
        return Observation(text, anchor=self.anchor())

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        guess = self._parse(action)
        if guess is None:
            obs = Observation(f"Invalid answer; give one number from 1 to {self.high}.", anchor=self.anchor())
            return StepResult(obs, self.format_penalty, False, {"valid": False, "success": False})
        self.left -= 1
        if guess == self.secret:
            self._done = True
            return StepResult(
                Observation(f"{guess} is correct!", anchor="solved"),
                1.0,
                True,
                {"valid": True, "success": True},
            )
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            hint = f"{guess} is too low: the number is higher."
        else:
            self.hi = min(self.hi, guess - 1)
            hint = f"{guess} is too high: the number is lower."
        self._done = self.left == 0
        tail = f" Out of guesses; it was {self.secret}." if self._done else f" {self.left} guesses left."
        return StepResult(
            Observation(hint + tail, anchor=self.anchor()), 0.0, self._done, {"valid": True, "success": False}
        )

    def _parse(self, action: str) -> int | None:
        answer = parse_answer(action)
        if answer is None or len(answer) != 1 or not _INTEGER.fullmatch(answer[0]):
            return None
        guess = int(answer[0])
        return guess if 1 <= guess <= self.high else None

    def anchor(self) -> str:
        return f"{self.lo}-{self.hi}/{self.left}"
