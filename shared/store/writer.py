"""The trajectory store's writer: episodes go to `RUN_DIR/store.sqlite` on their own thread.

    writer = StoreWriter(run_dir / STORE_FILE, keep_success=1.0, max_mb=2048)
    writer.put(episode_from_trajectory(traj, fate="trained", step=7, advantages=adv))
    writer.flush()            # each step and checkpoint: everything queued so far is committed
    writer.close()

The database itself (tables, writing one episode, reading them back) is shared/store/trajstore.py.

Why a writer thread: the learner's loop must not wait on the disk. `put` never blocks: records
go through a bounded queue to one thread that commits them in batches. If the queue is full the
record is dropped and counted (`statistics()["dropped"]`), and the run goes on; the learner's
accounting, not the store, is the record of what happened.

Retention: every failed, dropped and forked episode is kept; trained ones are kept with
probability `keep_success` (decided from the episode id, so a rerun keeps the same ones). Past
`max_mb`, the oldest trained episodes are deleted in batches to make room (their pages are
reused, so the file stops growing); failures are only deleted when nothing else is left.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
import zlib
from pathlib import Path

from millstream.shared.store.rows import EpisodeRow
from millstream.shared.store.trajstore import last_id, open_store, write_episode

__all__ = ["StoreWriter", "keeps"]

log = logging.getLogger(__name__)


def keeps(episode_id: str, share: float) -> bool:
    """Whether a trained episode is kept at `share`: a stable function of its id."""
    if share >= 1.0:
        return True
    return (zlib.crc32(episode_id.encode()) % 10_000) < share * 10_000


class StoreWriter:
    """Writes episodes on its own thread, in batches; `put` never blocks (see the module doc)."""

    def __init__(
        self,
        path: Path,
        *,
        keep_success: float = 1.0,
        max_mb: float = 0.0,
        capacity: int = 4096,
        batch_s: float = 0.5,
    ) -> None:
        self.path = path
        self.keep_success = keep_success
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.batch_s = batch_s
        self._queue: queue.Queue[EpisodeRow | None] = queue.Queue(maxsize=capacity)
        self._written = threading.Event()
        self._hurry = threading.Event()
        self._pending = 0
        self._lock = threading.Lock()
        self.stats = {"written": 0, "dropped": 0, "skipped": 0, "evicted": 0, "errors": 0, "queue_peak": 0}
        self._db = open_store(path)
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def put(self, row: EpisodeRow) -> bool:
        """Queue one episode; False if the retention rule skips it or the queue is full."""
        if row.fate == "trained" and not keeps(row.episode_id, self.keep_success):
            self.stats["skipped"] += 1
            return False
        row.created = row.created or time.time()
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self.stats["dropped"] += 1
            return False
        with self._lock:
            self._pending += 1
        self.stats["queue_peak"] = max(self.stats["queue_peak"], self._queue.qsize())
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is committed (each step and checkpoint calls
        this); the writer commits at once instead of waiting to fill its batch."""
        deadline = time.monotonic() + timeout_s
        self._hurry.set()
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    if self._pending == 0:
                        return True
                self._written.wait(0.01)
                self._written.clear()
            return False
        finally:
            self._hurry.clear()

    def last_id(self) -> int:
        self.flush()
        return last_id(self.path)

    def statistics(self) -> dict[str, int]:
        return {**self.stats, "queued": self._queue.qsize(), "capacity": self._queue.maxsize}

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch: list[EpisodeRow | None] = [self._queue.get()]
            deadline = time.monotonic() + self.batch_s
            while batch[-1] is not None and len(batch) < 512:
                try:  # short waits: a flush must not wait out the whole batch time
                    batch.append(self._queue.get(timeout=max(0.0, min(0.02, deadline - time.monotonic()))))
                except queue.Empty:
                    if self._hurry.is_set() or time.monotonic() >= deadline:
                        break
            rows = [r for r in batch if r is not None]
            self._commit(rows)
            with self._lock:
                self._pending -= len(rows)
            self._written.set()
            if batch[-1] is None:
                self._db.close()
                return

    def _commit(self, rows: list[EpisodeRow]) -> None:
        try:
            with self._db:
                for row in rows:
                    write_episode(self._db, row)
            self.stats["written"] += len(rows)
            if self.max_bytes:
                self._enforce_cap()
        except sqlite3.Error as exc:  # the store is a record, not the run: count and go on
            self.stats["errors"] += len(rows)
            log.warning("trajectory store: %d episodes not written: %s", len(rows), exc)

    def _enforce_cap(self) -> None:
        """Past the size cap, delete the oldest trained episodes (then the oldest of any kind)."""
        for _ in range(64):  # bounded: a cap below one batch's size must not spin forever
            if self._used_bytes() <= self.max_bytes:
                return
            for where in ("fate = 'trained'", "1"):
                with self._db:
                    oldest = f"SELECT id FROM episodes WHERE {where} ORDER BY id LIMIT 64"
                    cursor = self._db.execute(f"DELETE FROM episodes WHERE id IN ({oldest})")
                if cursor.rowcount:
                    self.stats["evicted"] += cursor.rowcount
                    break
            else:
                return

    def _used_bytes(self) -> int:
        pages, size, free = (
            self._db.execute(f"PRAGMA {p}").fetchone()[0]
            for p in ("page_count", "page_size", "freelist_count")
        )
        return int((pages - free) * size)
