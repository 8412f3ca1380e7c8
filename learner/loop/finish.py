"""The end of a run: how long the final round may take, and the run's closing summary.

After `train.steps` steps the learner announces `final` and waits for every worker's `PoolDone`.
Worker 0 plays the final evaluation round before its `PoolDone`, so the wait covers that round
too (`final_wait_s`). Then the learner saves a last checkpoint (before the drain, so its complete
groups survive a resume), counts what is left in the buffer as dropped ("run_ended") and closes
the accounts (learner/episodes/accounting.py: every episode started has exactly one fate).

The summary is the run's last word: the accounts, the policy version and where its weights are,
what each replica loaded, the evaluation results. It is written twice, as the last metrics
record and as `summary.json` in the run directory, and `accounting_ok` decides the process's
exit status (learner/main.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson

from millstream.learner.episodes.accounting import close_accounts
from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.evals import EvalLog
from millstream.learner.replay import ReplayBuffer
from millstream.learner.sync.fleet import Fleet, replica_weights
from millstream.shared.config import Config
from millstream.shared.obs.dashboards import DashboardMetrics
from millstream.shared.wire import DropCause

__all__ = ["final_wait_s", "close_run", "write_summary"]

log = logging.getLogger("learner")


def final_wait_s(cfg: Config) -> float:
    """How long the final round waits for every worker's `PoolDone`."""
    # Worker 0 plays the final evaluation round before its PoolDone: wait for that too.
    evaluating = cfg.eval.timeout_s + 10 if cfg.eval.every else 0.0
    return cfg.envpool.step_timeout_s + 60 + evaluating


def close_run(
    cfg: Config,
    *,
    version: int,
    checkpoint: Path,
    buffer: ReplayBuffer,
    ledger: WorkerLedger,
    intake: Intake,
    sessions: int,
    decode_errors: int,
    fleet: Fleet,
    evals: EvalLog,
) -> dict[str, Any]:
    """Drain the buffer, close the accounts and return the run's summary."""
    buffer.drain(DropCause.RUN_ENDED)
    accounts = close_accounts(
        buffer,
        ledger,
        intake.done_workers,
        cfg.envpool.workers,
        resumed=bool(cfg.run.resume),
        foreign=intake.foreign,
    )
    summary = {
        "version": version,
        **accounts,
        "learner_sessions": sessions,
        # Pushed again after a learner restart with tokens of the abandoned timeline (intake.py).
        "episodes_relabeled": intake.relabeled,
        "decode_errors": decode_errors,
        "checkpoint": str(checkpoint),
        "final_weights": str(checkpoint / "hf"),
        "replica_weights": replica_weights(
            fleet.digests(), fleet.flat.digest() if fleet.flat.sent_version == version else None
        ),
        **evals.summary(version),
    }
    if not summary["accounting_ok"]:
        log.error("accounting does not add up: %s", summary)
    return summary


def write_summary(run_dir: Path, metrics: DashboardMetrics, summary: dict[str, Any]) -> None:
    """The summary as the last metrics record and as `<run_dir>/summary.json`."""
    metrics.write({"summary": summary})
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
