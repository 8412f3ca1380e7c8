"""How many tries a question-and-answer episode gets: the attempt rule the dataset and
reasoning_gym environments share.

"single" ends the episode after the first answer, right or wrong. "feedback" answers a wrong
answer with `feedback` and lets the model try again, up to `max_attempts`; the first success ends
the episode. The rule lives here once so that both environments check their arguments the same
way and end episodes on the same turn.
"""

from __future__ import annotations

__all__ = ["Attempts"]


class Attempts:
    """One episode's attempts at one question: `start()` at reset; at each step `take()` before
    scoring the answer and `outcome(success)` after it."""

    def __init__(self, mode: str, max_attempts: int, feedback: str) -> None:
        # Checked at construction, so a typo fails in the launcher's env check (before any engine
        # starts), with the config key named.
        if mode not in ("single", "feedback"):
            raise ValueError(f"envpool.env_args.mode = {mode!r}: expected 'single' or 'feedback'")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"envpool.env_args.max_attempts = {max_attempts!r}: expected an integer >= 1")
        self.mode, self.max_attempts, self.feedback = mode, max_attempts, feedback
        self.count = 0
        self.done = True

    def start(self) -> None:
        """A new question: no attempts yet."""
        self.count, self.done = 0, False

    def take(self) -> None:
        """Count one answer; refuse it (before it is scored) when the episode has ended."""
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        self.count += 1

    def outcome(self, success: bool) -> tuple[bool, str]:
        """Whether the episode ends with this answer, and the text to show the model next ("" when
        it ends)."""
        self.done = self.mode == "single" or success or self.count >= self.max_attempts
        return self.done, "" if self.done else self.feedback
