"""Markovian thinking in bounded chunks, after Delethink (Aghajohari et al. 2025, "The Markovian
Thinker").

The task: a chain of arithmetic steps drawn from the seed, "Start at 7. Add 12. Multiply by 3.
Subtract 5. What is the result?" (`steps` operations, default 4), whose answer is one integer.
The model thinks in chunks, one chunk per turn, each at most the runner's `max_tokens` long.

Rules of a chunk (the model's reply for one turn):
- it contains `<answer>N</answer>` with N an integer: the episode ends, reward 1.0 if N is the
  answer (`success=True`), else 0.0 (`valid=True` either way);
- its answer tag holds anything but one integer (empty, "12.5", "a || b", more than 30 digits):
  `valid=False`, reward `format_penalty` (default -0.1), the episode ends: a committed answer
  that cannot be read is a wrong answer with a format fault, as in RAGEN;
- no complete answer tag: unfinished thinking, not a fault: `valid=True`, reward 0.0, and the
  next chunk follows, unless `max_chunks` (default 3) chunks are spent, then the episode ends
  with reward 0.0, `success=False`, `info["truncated"]=True`;
- a chunk containing NUL is no text a model writes (the fault injector sends it): `valid=False`
  and the format penalty, but it is otherwise an unfinished chunk: its answer tag, if any, is
  not read, and the episode goes on or is truncated as above. U+FFFD is tolerated: a chunk cut
  at `max_tokens` may end in the middle of a UTF-8 character, which decodes to U+FFFD, and that
  is the chunking's doing, not the model's.

How the next chunk is built (Delethink's Markovian state): the observation after an unfinished
chunk has `new_context=True` and `carry_tokens` (default 8), and its text is the query again
plus "Continue your reasoning from where it stopped (chunk k of K)." The episode runner then
starts a fresh context, [system prompt + that text], and opens the model's reply with the last
`carry_tokens` token ids it generated, verbatim. So each chunk sees the query and a bounded
carry-over only, and the state never grows with the length of the reasoning. This environment
never pastes the previous chunk's text into an observation and never sees token ids: the
carry-over travels as tokens, through the runner, so nothing is re-tokenised.

Anchors: f"chunk{k}", k = chunks taken ("chunk0" for the first). This is an approximation on
purpose: the true state of chunk k is the query plus its carry-over, and the carry-over differs
between the members of a group, so exact anchors would almost never match. The chunk index groups
steps by how much of the thinking budget is spent, which is what GiGPO can usefully compare.
"""

from __future__ import annotations

import random
import re

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = ["Markovian", "make_chain"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
# Capped so int() never meets Python's digit limit (a reply of 5,000 digits would raise).
_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")
# A query of 32 steps is about 500 characters: the cap keeps the prompt within the demo
# model's budget (~800 characters for a first observation).
MAX_STEPS = 32


def make_chain(rng: random.Random, steps: int) -> tuple[str, int]:
    """A chain "Start at S. Add a. Multiply by m. ..." and its integer answer.

    Only add, subtract and multiply (by 2..5, one step in three) so the answer is an exact
    integer that stays a handful of digits for the default length.
    """
    value = rng.randint(1, 20)
    parts = [f"Start at {value}."]
    for _ in range(steps):
        kind = rng.randrange(3)
        if kind == 0:
            n = rng.randint(1, 20)
            value += n
            parts.append(f"Add {n}.")
        elif kind == 1:
            n = rng.randint(1, 20)
            value -= n
            parts.append(f"Subtract {n}.")
        else:
            m = rng.randint(2, 5)
            value *= m
            parts.append(f"Multiply by {m}.")
    parts.append("What is the result?")
    return " ".join(parts), value


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


@register("markovian")
class Markovian:
    system_prompt = (
        "Solve the arithmetic task step by step, then give the final integer as "
        "<answer>N</answer>. Your thinking may be cut off and resumed in a fresh "
        "context that keeps only its last few tokens."
    )

    def __init__(
        self, steps: int = 4, max_chunks: int = 3, carry_tokens: int = 8, format_penalty: float = -0.1
    ) -> None:
        self.steps = _check_int("steps", steps, 1, MAX_STEPS)
        self.max_chunks = _check_int("max_chunks", max_chunks, 1)
        self.carry_tokens = _check_int("carry_tokens", carry_tokens, 0)
        if (
            isinstance(format_penalty, bool)
            or not isinstance(format_penalty, (int, float))
            or not format_penalty <= 0
        ):
            raise ValueError(f"format_penalty must be a number <= 0, got {format_penalty!r}")
        self.format_penalty = float(format_penalty)
        self.query = ""
        self.answer = 0
        self._chunks = 0

    async def reset(self, seed: int) -> Observation:
        self.query, self.answer = make_chain(random.Random(seed), self.steps)
        self._chunks = 0
        return Observation(self.query, anchor="chunk0")

    async def step(self, action: str) -> StepResult:
        self._chunks += 1
        info = {"chunk": self._chunks}
        tag = _ANSWER.search(action)
        if tag is not None and "\x00" not in action:
            content = tag.group(1).strip()
            if _INTEGER.fullmatch(content) is None:  # a committed answer nobody can read
                return StepResult(
                    self._done(), self.format_penalty, True, {**info, "valid": False, "success": False}
                )
            right = int(content) == self.answer
            return StepResult(
                self._done(), 1.0 if right else 0.0, True, {**info, "valid": True, "success": right}
            )
        valid = "\x00" not in action
        reward = 0.0 if valid else self.format_penalty
        if self._chunks >= self.max_chunks:
            return StepResult(
                self._done(), reward, True, {**info, "valid": valid, "success": False, "truncated": True}
            )
        text = (
            f"{self.query}\nContinue your reasoning from where it stopped "
            f"(chunk {self._chunks + 1} of {self.max_chunks})."
        )
        obs = Observation(
            text, anchor=f"chunk{self._chunks}", new_context=True, carry_tokens=self.carry_tokens
        )
        return StepResult(obs, reward, False, {**info, "valid": valid, "success": False})

    def _done(self) -> Observation:
        return Observation("", anchor="done")
