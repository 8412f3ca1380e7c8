"""The learner's side of evaluation: `EvalResult`s become `eval/...` metrics and a summary part.

Evaluation rounds are played by envpool worker 0 (envpool/scoring/evaluator.py) and arrive on the
experience socket. Each becomes one metrics.jsonl record at `step` = the evaluated version:

    eval/version, eval/reward_mean, eval/success, eval/pass@<k>, eval/episodes (finished),
    eval/failed/<cause>, eval/duration_s, eval/timed_out, eval/token_version_min/max

and the run's summary.json gets `eval` (the last round: the final version's when it arrived in
time, `eval_final` says whether it did), `eval_rounds` and `eval_episodes`, counted apart from
the training episodes (evaluation episodes never enter the replay buffer or its accounting).
"""

from __future__ import annotations

from typing import Any

import msgspec

from millstream.shared.wire import EvalResult

__all__ = ["EvalLog", "eval_record"]


def eval_record(result: EvalResult) -> dict[str, Any]:
    """One round's metrics record."""
    record: dict[str, Any] = {
        "step": result.version,
        "eval/version": result.version,
        "eval/reward_mean": result.reward_mean,
        "eval/success": result.success,
        f"eval/pass@{result.samples}": result.pass_at_k,
        f"eval/pass@{result.samples}_problems": result.pass_at_k_problems,
        "eval/episodes": result.finished,
        "eval/problems": result.problems,
        "eval/duration_s": result.duration_s,
        "eval/timed_out": result.timed_out,
    }
    record.update({f"eval/failed/{cause}": n for cause, n in result.failed.items()})
    if result.token_versions:
        record["eval/token_version_min"], record["eval/token_version_max"] = result.token_versions
    return record


class EvalLog:
    """Every round received; `summary(final_version)` is what summary.json says of them."""

    def __init__(self) -> None:
        self.last: EvalResult | None = None
        self.rounds = 0
        self.episodes = 0

    def take(self, result: EvalResult) -> dict[str, Any]:
        """Count a round; returns its metrics record."""
        self.rounds += 1
        self.episodes += result.finished + sum(result.failed.values())
        if self.last is None or result.version >= self.last.version:
            self.last = result
        return eval_record(result)

    def summary(self, final_version: int) -> dict[str, Any]:
        if self.last is None:
            return {"eval": None, "eval_final": False, "eval_rounds": 0, "eval_episodes": 0}
        return {
            "eval": msgspec.structs.asdict(self.last),
            "eval_final": self.last.version == final_version,
            "eval_rounds": self.rounds,
            "eval_episodes": self.episodes,
        }
