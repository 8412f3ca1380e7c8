"""Any task of reasoning-gym (procedural reasoning datasets with their own scorers), by name.

    envpool.env = "reasoning_gym"
    envpool.env_args = { task = "basic_arithmetic", task_args = { min_terms = 2, max_terms = 3 } }

reasoning-gym (PyPI `reasoning-gym`, the `real` extra) generates each item from the dataset's
seed and the item's index, and scores an answer with the dataset's own `score_answer`: the
reward here is that score, never one of ours. `task` is any of its dataset names (106 in
0.1.25); `task_args` are that dataset's config fields, checked by reasoning-gym itself when the
environment is built, so a wrong name or value fails the preflight naming the key.

Seeds to items: one dataset of `size` items is made from `data_seed`; its first `eval_items`
indices are the held-out eval split, the rest the training split. A training episode of seed
`s` plays item `eval_items + s mod (size - eval_items)`, an eval episode of seed `s` item
`s mod eval_items` (so `[eval]`'s seeds 0..N-1 walk the eval items in order, and a group's
members face the same item). Generated questions can repeat across indices where a task's space
is small; `millstream envpool --check` does not look for that.

`answer = "tag"` (the default) takes what the model writes inside its last
`<answer>...</answer>`, with reasoning-gym's own `extract_answer` (the format asked for by its
default system prompt, `SYSTEM_PROMPTS["default"]`, which is this environment's default too); a
reply without the tags is scored as no answer (`score_answer(None, ...)`: 0 for most tasks) and
marked `valid=False`. A task's scorer that raises on the model's answer (prime_factorization's,
on "2^2 × 3") scores it 0, `valid=False`, with the error in `info["score_error"]`: the answer is
the model's, so is its failure (an env_error would drop the episode from its group instead).
`answer = "final"` takes the reply's final answer as the dataset environment's `math_answer`
does (the last `\\boxed{}`, else the last number): for models too small to follow the tag format
(SmolLM2-135M wrote no tags in any of 4 sampled replies), on tasks whose answers are numbers.
Modes as the dataset environment's: "single" (one attempt), or "feedback" (a wrong answer is
told so and tried again, up to `max_attempts`; the first success ends the episode).
"""

from __future__ import annotations

import warnings
from typing import Any

from millstream.envpool.envs.base import Observation, StepResult, register
from millstream.envpool.envs.tasks.attempts import Attempts
from millstream.envpool.scoring.rewards import extract_answer

__all__ = ["ReasoningGym"]


def _import() -> Any:
    """reasoning_gym, imported on first use (it loads its 106 tasks: 2.5 s)."""
    try:
        with warnings.catch_warnings():
            # One of its dependencies (cellpylib) has `is "literal"` comparisons: a SyntaxWarning
            # when compiled, an error under `-W error`, and none of our business.
            warnings.simplefilter("ignore", SyntaxWarning)
            import reasoning_gym
    except ImportError:
        raise ValueError(
            "envpool.env = 'reasoning_gym' needs the reasoning-gym package: pip install 'millstream[real]'"
        ) from None
    return reasoning_gym


def _create(task: str, task_args: dict[str, Any], size: int, data_seed: int) -> Any:
    reasoning_gym = _import()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = sorted(n for n in DATASETS if task.split("_")[0] in n)[:8]
        hint = f"close: {', '.join(close)}" if close else f"{len(DATASETS)} tasks in reasoning_gym.factory"
        raise ValueError(f"envpool.env_args.task = {task!r}: reasoning-gym has no such task ({hint})")
    try:
        return reasoning_gym.create_dataset(task, seed=data_seed, size=size, **task_args)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"envpool.env_args.task_args for {task!r}: {type(exc).__name__}: {exc}") from None


@register("reasoning_gym")
class ReasoningGym:
    def __init__(
        self,
        task: str = "basic_arithmetic",
        task_args: dict[str, Any] | None = None,
        split: str = "train",
        size: int = 100_000,
        eval_items: int = 200,
        data_seed: int = 0,
        system_prompt: str | None = None,
        mode: str = "single",
        max_attempts: int = 3,
        feedback: str = "That is not right. Try again.",
        success_reward: float = 1.0,
        answer: str = "tag",
    ) -> None:
        if answer not in ("tag", "final"):
            raise ValueError(f"envpool.env_args.answer = {answer!r}: expected 'tag' or 'final'")
        if split not in ("train", "eval"):
            raise ValueError(f"envpool.env_args.split = {split!r}: expected 'train' or 'eval'")
        self.attempts = Attempts(mode, max_attempts, feedback)
        if not 0 < eval_items < size:
            raise ValueError(
                f"envpool.env_args.eval_items = {eval_items!r}: expected 0 < eval_items < size ({size})"
            )
        self.task, self.split, self.eval_items = task, split, eval_items
        self.dataset = _create(task, dict(task_args or {}), size, data_seed)
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self._extract_tag = extract_answer
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self.success_reward = success_reward
        self.answer_format = answer
        self.item: dict[str, Any] = {}
        self.index = -1

    def item_index(self, seed: int) -> int:
        """The dataset index that `seed` plays in this split (see the module's docstring)."""
        if self.split == "eval":
            return seed % self.eval_items
        return self.eval_items + seed % (len(self.dataset) - self.eval_items)

    def answer_of(self, reply: str) -> str | None:
        """The answer the reply gives, as `answer` says to find it; None if it gives none."""
        if self.answer_format == "final":
            return extract_answer(reply)
        answer: str | None = self._extract_tag(reply)  # reasoning-gym's own: the last tag, stripped
        return answer

    async def reset(self, seed: int) -> Observation:
        self.index = self.item_index(seed)
        self.item = self.dataset[self.index]
        self.attempts.start()
        return Observation(str(self.item["question"]), anchor=f"{self.task}/{self.index}/0")

    async def step(self, action: str) -> StepResult:
        self.attempts.take()
        answer = self.answer_of(action)
        info: dict = {"valid": answer is not None, "item": self.index}
        try:
            reward = float(self.dataset.score_answer(answer, self.item))
        except Exception as exc:  # on the model's answer; its absence (None) must score
            if answer is None:
                raise
            reward, info["valid"], info["score_error"] = 0.0, False, f"{type(exc).__name__}: {exc}"[:200]
        success = info["success"] = reward >= self.success_reward
        last, text = self.attempts.outcome(success)
        return StepResult(
            Observation(text, anchor=f"{self.task}/{self.index}/{self.attempts.count}"), reward, last, info
        )
