"""The learner's journal: what reached it since its last checkpoint, so a restart loses little.

A checkpoint holds the replay buffer as it was when it was saved. Everything the learner took
after that (episodes accepted into the buffer, trained on or not) used to die with it: a
restarted learner counted them as `learner_lost` (5% of a chaos run's episodes). Now each
accepted episode is appended to `journal/after_step_<N>.bin`, N the version of the checkpoint
it follows, with the key it came with; so is each step's version. A learner resumed from
checkpoint N reads that file back (`replay`): the episodes go through the intake again as the
greeting's backlog (learner/episodes/intake.py), and the highest version tells how far the
abandoned timeline went.

Cost: one `os.write` of the episode's wire bytes per accepted episode (a few kB), no fsync: a
killed learner's writes are in the page cache, which survives the process. A power cut loses
the journal's tail, and the restart then counts those episodes as `learner_lost`, as before. A
full disk costs journal records, counted, not the run (shared/obs/appendfile.py's rules).
After each checkpoint a new file starts and the older ones go (only the latest checkpoint's
file can be replayed: `latest` names it).

Records: a 4-byte big-endian length, then msgpack `[kind, sender, payload]`: kind "e" (payload:
the message's wire frame), or "v" (payload: the version a step reached).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import Codec, EpisodeFailed, Trajectory

__all__ = ["Journal", "Replayed", "replay"]

log = logging.getLogger("learner.journal")

_HEADER = struct.Struct(">I")
FOLDER = "journal"


def _path(run_dir: Path, version: int) -> Path:
    return run_dir / FOLDER / f"after_step_{version:06d}.bin"


class Journal:
    """Appends accepted episodes and step versions after the checkpoint of `version`."""

    def __init__(self, run_dir: Path, version: int) -> None:
        self.run_dir = run_dir
        self.codec = Codec()
        self.lost = 0  # records the disk refused
        self._errors = RateLog(log)
        self._fd = -1
        self.start(version)

    def start(self, version: int) -> None:
        """A checkpoint of `version` was saved: write after it from now on, drop older files."""
        self.close()
        (self.run_dir / FOLDER).mkdir(parents=True, exist_ok=True)
        path = _path(self.run_dir, version)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        for older in (self.run_dir / FOLDER).glob("after_step_*.bin"):
            if older != path:
                older.unlink(missing_ok=True)

    def episode(self, message: Trajectory | EpisodeFailed, sender: str | None) -> None:
        self._write(["e", sender, self.codec.encode([message])])

    def step(self, version: int) -> None:
        self._write(["v", None, version])

    def _write(self, record: list) -> None:
        body = msgspec.msgpack.encode(record)
        data = _HEADER.pack(len(body)) + body
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            written, why = 0, exc.strerror or str(exc)
        else:
            why = "short write"
        if written < len(data):  # a torn record ends the file for `replay`: start a clean one
            self.lost += 1
            self._errors.event(
                "write_failed", "journal: a record not written (%s); %d so far", why, self.lost
            )
            if written:
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Replayed:
    """What the journal after a checkpoint held."""

    episodes: list[tuple[Trajectory | EpisodeFailed, str | None]] = field(default_factory=list)
    #: The highest version a step reached after the checkpoint (the abandoned timeline's end).
    last_version: int | None = None


def replay(run_dir: Path, version: int) -> Replayed:
    """The journal written after the checkpoint of `version` (empty if there is none). A torn
    last record (a kill mid-write) ends it."""
    path, out = _path(run_dir, version), Replayed()
    if not path.is_file():
        return out
    codec = Codec()
    for kind, sender, payload in _records(path.read_bytes()):
        if kind == "v":
            out.last_version = max(int(payload), out.last_version or 0)
        elif kind == "e":
            for message in codec.decode(payload):
                if isinstance(message, (Trajectory, EpisodeFailed)):
                    out.episodes.append((message, sender))
    return out


def _records(data: bytes) -> Iterator[list]:
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
