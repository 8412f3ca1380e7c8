"""The learner's journal: what reached it since its last checkpoint, so a restart loses little.

A checkpoint holds the learner's state as it was when it was saved. What reached it after that
died with it: a restarted learner counted those episodes as `learner_lost` (5% of a chaos run's
episodes). So after each checkpoint of version N, every message the intake takes (episodes,
`GroupStarted`, hellos, `PoolDone`, in arrival order, with the key each came with and whether
it was held for the greeting), each admission limit announced and each step's version are
appended to `journal/after_step_N.bin`. A learner resumed from checkpoint N gives the intake
those messages again, in order, before its own greeting (learner/loop/saving.py): the ledger
learns what the dead session's workers started (a worker that died in it included), the buffer
gets what the dead learner had taken, and the workers' hellos then go on from there.

The file starts with the checkpoint's nonce (a random token in its state): a journal is only
read for the checkpoint it was written after, never for another of the same version (a resumed
run's final checkpoint, or one whose `latest` could not be written).

Cost: one `os.write` per message (its wire bytes: a few kB for an episode, more for an agent's),
no fsync: a killed learner's writes are in the page cache, which survives the process. A power
cut loses the tail, and those episodes are `learner_lost`, as before. A full disk costs records,
counted (`lost`), not the run. Each checkpoint starts a new file and removes the others; a
resumed learner rewrites its file (temporary file, then rename) with what it read, so a second
death before the next checkpoint finds it all again.

Records: a 4-byte big-endian length, then msgpack `[kind, ...]`: ["n", nonce], ["m", sender,
held, wire frame], ["a", admission limit], ["v", version].
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import Codec, Message, ProtocolError

__all__ = ["Journal", "Replayed", "read_journal"]

log = logging.getLogger("learner.journal")

_HEADER = struct.Struct(">I")
FOLDER = "journal"


def _path(run_dir: Path, version: int) -> Path:
    return run_dir / FOLDER / f"after_step_{version:06d}.bin"


def _frame(record: list[Any]) -> bytes:
    body = msgspec.msgpack.encode(record)
    return _HEADER.pack(len(body)) + body


class Journal:
    """Appends the intake's messages, admissions and steps after a checkpoint (`start`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.codec = Codec()
        self.lost = 0  # records the disk refused
        self._errors = RateLog(log)
        self._fd = -1

    def start(self, version: int, nonce: str, carried: Iterable[list[Any]] = ()) -> None:
        """The checkpoint of `version` (with `nonce`) is saved: journal after it from now on,
        beginning with `carried` records (a resume's), and drop every other file."""
        self.close()
        folder = self.run_dir / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        path, staging = _path(self.run_dir, version), folder / ".writing"
        staging.write_bytes(b"".join(_frame(r) for r in (["n", nonce], *carried)))
        os.replace(staging, path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        for other in folder.glob("after_step_*.bin"):
            if other != path:
                other.unlink(missing_ok=True)

    def message(self, message: Message, sender: str | None, held: bool) -> None:
        self._write(["m", sender, held, self.codec.encode([message])])

    def admitted(self, limit: int) -> None:
        self._write(["a", limit])

    def step(self, version: int) -> None:
        self._write(["v", version])

    def _write(self, record: list[Any]) -> None:
        if self._fd < 0:  # no checkpoint yet: a learner that dies now stops the run anyway
            return
        data = _frame(record)
        try:
            written, why = os.write(self._fd, data), "short write"
        except OSError as exc:
            written, why = 0, exc.strerror or str(exc)
        if written < len(data):  # a torn record would end the file for the reader: take it back
            self.lost += 1
            self._errors.event(
                "write_failed", "journal: a record not written (%s); %d so far", why, self.lost
            )
            if written:
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Replayed:
    """A journal read back: its records as written (to carry on) and what they say."""

    records: list[list[Any]] = field(default_factory=list)
    #: (message, sender, held), in arrival order
    messages: list[tuple[Message, str | None, bool]] = field(default_factory=list)
    admitted: int = 0
    last_version: int | None = None
    skipped: int = 0  # records that did not decode (another protocol, a bug): left out


def read_journal(run_dir: Path, version: int, nonce: str) -> Replayed:
    """The journal written after the checkpoint of `version` whose nonce is `nonce`; empty if
    there is none, or if it belongs to another checkpoint. A torn last record ends it."""
    path, out = _path(run_dir, version), Replayed()
    if not nonce or not path.is_file():
        return out
    records = list(_records(path.read_bytes()))
    if not records or records[0] != ["n", nonce]:
        log.warning("%s was written after another checkpoint of version %d: not read", path, version)
        return out
    codec = Codec()
    for record in records[1:]:
        try:
            _take(record, out, codec)
        except (ProtocolError, ValueError, TypeError, IndexError) as exc:
            out.skipped += 1
            log.warning("journal %s: a record left out: %s", path, exc)
            continue
        out.records.append(record)
    return out


def _take(record: list[Any], out: Replayed, codec: Codec) -> None:
    kind = record[0]
    if kind == "m":
        _, sender, held, frame = record
        for message in codec.decode(frame):
            out.messages.append((message, sender, bool(held)))
    elif kind == "a":
        out.admitted = max(out.admitted, int(record[1]))
    elif kind == "v":
        out.last_version = max(int(record[1]), out.last_version or 0)
    else:
        raise ValueError(f"unknown record kind {kind!r}")


def _records(data: bytes) -> Iterator[list[Any]]:
    at = 0
    while at + _HEADER.size <= len(data):
        (size,) = _HEADER.unpack_from(data, at)
        body = data[at + _HEADER.size : at + _HEADER.size + size]
        if len(body) < size:
            return
        try:
            yield msgspec.msgpack.decode(body)
        except msgspec.DecodeError:
            return
        at += _HEADER.size + size
