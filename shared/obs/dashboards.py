"""The learner's metrics, to `metrics.jsonl` and to the dashboards people use (`metrics.backends`).

`metrics.jsonl` is the record of the run (resumes and `millstream plot` read it), so it is always
on. TensorBoard and W&B are optional extras (`pip install 'millstream[dashboards]'`):

- tensorboard: event files in `<run.dir>/tensorboard`, written with tensorboard's own event file
  writer (no torch needed, so this module stays role-free);
- wandb: a run in `<run.dir>/wandb`, offline by default (`metrics.wandb_mode`: offline never
  touches the network, and `wandb sync` uploads it later if wanted; online logs live).

Both receive every per-step record's flat numeric keys exactly as `metrics.jsonl` has them
(`reward/mean`, `train/entropy`, ...) at step = the training step; event records (checkpoints,
warnings) and the summary stay in the JSONL only. A dashboard is never worth a run: a backend
that fails is logged once and switched off, and training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from millstream.shared.obs.metrics import MetricsWriter

__all__ = ["BACKENDS", "backend_problem", "step_scalars", "DashboardMetrics", "open_metrics"]

log = logging.getLogger(__name__)

#: Backend name -> the module it needs (None: built in).
BACKENDS: dict[str, str | None] = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}


def backend_problem(backends: Sequence[str]) -> str | None:
    """What is wrong with `metrics.backends` (a line naming the key), or None; imports nothing."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        return f"metrics.backends: unknown backend {unknown[0]!r}; choose from {sorted(BACKENDS)}"
    if "jsonl" not in backends:
        return (
            f"metrics.backends = {list(backends)}: 'jsonl' is required (plot and resume read metrics.jsonl)"
        )
    if len(set(backends)) != len(backends):
        return f"metrics.backends = {list(backends)}: a backend is named twice"
    for name in backends:
        module = BACKENDS[name]
        if module and importlib.util.find_spec(module) is None:
            return (
                f"metrics.backends includes {name!r} but the {module!r} package is not installed: "
                "pip install 'millstream[dashboards]' (or drop it from metrics.backends)"
            )
    return None


def step_scalars(record: dict[str, Any]) -> dict[str, float] | None:
    """A per-step record's numeric keys (bools as 0/1), or None for an event or summary record."""
    if "step" not in record or "event" in record or "summary" in record:
        return None
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time") and isinstance(v, int | float) and v == v  # v == v: not NaN
    }


class _Backend(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(run_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(
        self,
        run_dir: Path,
        project: str,
        name: str,
        tags: list[str],
        config: dict,
        mode: Literal["offline", "online"],
    ) -> None:
        os.environ["WANDB_MODE"] = mode  # before the import: wandb reads it at init
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=mode,
            dir=str(run_dir),
            project=project,
            name=name or run_dir.name,
            tags=tags,
            config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        # Records are logged in arrival order against their own step keys, never with wandb's
        # `step=`: an evaluation record arrives after training went on (its step is the version
        # it evaluated, already behind), and wandb drops a `step=` lower than its last one.
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self._run.define_metric("eval/*", step_metric="eval/version")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log({**scalars, "step": step})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # Stops wandb's service process now: otherwise the role's leftover-child cleanup
        # (shared/process/lifecycle.py) kills it first and wandb's exit hook prints a traceback.
        wandb.teardown()


class DashboardMetrics:
    """`MetricsWriter` (same methods) that also sends per-step records to the dashboards."""

    def __init__(self, jsonl: MetricsWriter, backends: dict[str, _Backend]) -> None:
        self.jsonl = jsonl
        self.backends = backends

    @property
    def lost(self) -> int:
        """Records the file did not take (a full disk)."""
        return self.jsonl.lost

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        scalars = step_scalars(record)
        if scalars is None:
            return
        for name, backend in list(self.backends.items()):
            try:
                backend.log(scalars, int(record["step"]))
            except Exception as exc:  # a dashboard is never worth the run
                self._disable(name, "writing", exc)

    def position(self) -> int:
        return self.jsonl.position()

    def close(self) -> None:
        self.jsonl.close()
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as exc:
                self._disable(name, "closing", exc)

    def _disable(self, name: str, doing: str, exc: Exception) -> None:
        log.error(
            "metrics backend %s failed %s (%s: %s); switched off, training goes on",
            name,
            doing,
            type(exc).__name__,
            exc,
        )
        self.backends.pop(name, None)


def open_metrics(
    run_dir: str | Path,
    backends: Sequence[str],
    *,
    wandb_mode: Literal["offline", "online"] = "offline",
    wandb_project: str = "millstream",
    wandb_name: str = "",
    wandb_tags: list[str] | None = None,
    config: dict | None = None,
) -> DashboardMetrics:
    """`<run_dir>/metrics.jsonl` plus the named dashboards; one that cannot start is logged and skipped."""
    run_dir = Path(run_dir)
    jsonl = MetricsWriter(run_dir / "metrics.jsonl")
    opened: dict[str, _Backend] = {}
    for name in backends:
        try:
            if name == "tensorboard":
                opened[name] = _TensorBoard(run_dir)
            elif name == "wandb":
                opened[name] = _Wandb(
                    run_dir, wandb_project, wandb_name, wandb_tags or [], config or {}, wandb_mode
                )
        except Exception as exc:
            log.error(
                "metrics backend %s could not start (%s: %s); running without it",
                name,
                type(exc).__name__,
                exc,
            )
    return DashboardMetrics(jsonl, opened)
