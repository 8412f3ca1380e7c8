"""Where the learner records each episode's fate: the trajectory store, and optionally JSON lines.

Every episode the run accounts for gets one record here: trained (with its per-token advantages
and the version it was trained at), dropped (stale, group too small, run ended: with the cause),
or failed (with its cause and, where the envpool sent it, the scene of the failure). The store
(shared/store/trajstore.py) is written by its own thread (shared/store/writer.py), so recording
never waits on the disk but once a step (see `trained`);
`trajectories.jsonl` is written only with `store.jsonl = true` (the format before the store).

A checkpoint records `positions()`: the store's last row id and the JSON lines' byte offset. A
resume from it marks everything after those rolled back (shared/store/rundir.py `mark_rolled_back`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import orjson

from millstream.shared.config import Config
from millstream.shared.obs.appendfile import AppendFile
from millstream.shared.store.trajstore import (
    STORE_FILE,
    episode_from_failure,
    episode_from_trajectory,
)
from millstream.shared.store.writer import StoreWriter
from millstream.shared.wire import EpisodeFailed, Trajectory

__all__ = ["EpisodeRecords", "JSONL_FILE"]

JSONL_FILE = "trajectories.jsonl"


class EpisodeRecords:
    """The learner's record of every episode's fate (see the module doc)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        store = cfg.store
        self.default_env = cfg.envpool.env
        self.store: StoreWriter | None = None
        if store.enabled:
            path = run_dir / STORE_FILE
            self.store = StoreWriter(
                path, keep_success=store.keep_success, max_mb=store.max_mb, capacity=store.queue
            )
        self.jsonl = AppendFile(run_dir / JSONL_FILE) if store.jsonl else None  # a full disk costs lines

    def trained(self, scored: list[tuple[Trajectory, list[float]]], step: int, version: int) -> None:
        """The episodes of one training step, each with its per-token advantages."""
        for traj, adv in scored:
            if self.store is not None:
                self.store.put(
                    episode_from_trajectory(
                        traj, fate="trained", step=step, trained_version=version, advantages=adv
                    )
                )
            if self.jsonl is not None:
                first = next((a for a, m in zip(adv, traj.loss_mask) if m), 0.0)
                record = {"fate": "trained", "step": step, "trained_version": version, "advantage": first}
                self._line({**record, **msgspec.structs.asdict(traj)})
        # Committed before the step's metrics record is written, so that record never counts an
        # episode a kill could lose. A commit takes milliseconds; a stuck disk waits at most 10 s,
        # then the step goes on (the writer keeps the episodes queued).
        if self.store is not None:
            self.store.flush(timeout_s=10.0)

    def failed(self, message: EpisodeFailed, version: int) -> None:
        if self.store is not None:
            self.store.put(episode_from_failure(message, step=version, env=self.default_env))
        if self.jsonl is not None:
            fields = msgspec.structs.asdict(message)
            fields.pop("scene", None)  # the store keeps scenes; the lines stay as they were
            self._line({"fate": "failed", "version": version, **fields})

    def dropped(self, trajectories: list[Trajectory], cause: str, step: int) -> None:
        if self.store is not None:
            for traj in trajectories:
                self.store.put(episode_from_trajectory(traj, fate="dropped", step=step, cause=cause))

    def positions(self) -> dict[str, int]:
        """How far each record has been written (a checkpoint keeps this; see the module doc)."""
        out = {}
        if self.store is not None:
            out[STORE_FILE] = self.store.last_id()  # flushes the writer first
        if self.jsonl is not None:
            out[JSONL_FILE] = self.jsonl.position()
        return out

    def statistics(self) -> dict[str, Any]:
        out = {} if self.store is None else {f"store/{k}": v for k, v in self.store.statistics().items()}
        if self.jsonl is not None and self.jsonl.lost:
            out["store/jsonl_lost"] = self.jsonl.lost
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.jsonl is not None:
            self.jsonl.close()

    def _line(self, record: dict) -> None:
        assert self.jsonl is not None
        self.jsonl.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
