"""What `millstream run` says while the run starts and stops, between the learner's step lines.

An engine loads for a minute on a CPU, the learner builds DeepSpeed and pushes the first weights,
and only then does the first step come: without word in between, a person cannot tell a slow
start from a stuck one. Each role writes a ready file once it serves (`--ready-file`,
`<run.dir>/logs/<name>.ready`: the actor when its engine is loaded and bound, the learner when
the first weights reached every replica, a worker when its sockets are up); the launcher's watch
loop calls `StartupProgress.poll` ten times a second, which prints a line as each role gets ready
(again after a restart) and, while some are not, a line every `NOTICE_EVERY_S` naming them and
the log to look at.

Only for roles on this host (`launcher.kind = "local"`): on Ray the roles' files are on the hosts
they run on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

from millstream.shared.process.runtime import ready_file

__all__ = ["StartupProgress", "NOTICE_EVERY_S"]

#: Seconds between two "still starting" lines while some role is not ready.
NOTICE_EVERY_S = 30.0

#: What each kind of role has done when it says ready.
_DONE = {
    "actor": "engine loaded, serving",
    "judge": "engine loaded, serving",
    "learner": "first weights pushed to the actor",
    "envpool": "connected, waiting for the learner",
}


def _kind(name: str) -> str:
    return next((k for k in _DONE if name.startswith(k)), name)


class StartupProgress:
    """Lines for roles getting ready; `started(name)` again after a restart."""

    def __init__(self, run_dir: Path, names: list[str], out: IO[str], now: float | None = None) -> None:
        self.run_dir, self.out = run_dir, out
        now = time.monotonic() if now is None else now
        self.names = set(names)
        self.waiting: dict[str, float] = dict.fromkeys(names, now)  # name -> when it was started
        self.last_notice = now
        self.all_ready = False  # said once: a restarted role's line stands alone

    def started(self, name: str, now: float | None = None) -> None:
        """`name` was (re)started: its ready file is stale until it writes a new one."""
        if name in self.names:  # roles that write no ready file (a learner's follower ranks) are not awaited
            self.waiting[name] = time.monotonic() if now is None else now

    def poll(self, now: float | None = None) -> None:
        """Print a line for each role that got ready since the last poll, and a reminder of
        those still starting every NOTICE_EVERY_S."""
        if not self.waiting:
            return
        now = time.monotonic() if now is None else now
        for name, since in list(self.waiting.items()):
            if ready_file(self.run_dir, name).exists():
                del self.waiting[name]
                self._say(f"{name} ready in {now - since:.0f}s ({_DONE.get(_kind(name), 'serving')})")
                self.last_notice = now
        if self.waiting and now - self.last_notice >= NOTICE_EVERY_S:
            self.last_notice = now
            slowest = min(self.waiting, key=self.waiting.__getitem__)
            self._say(
                f"still starting: {', '.join(sorted(self.waiting))} "
                f"({now - self.waiting[slowest]:.0f}s; log: {self.run_dir / 'logs' / f'{slowest}.log'})"
            )
        if not self.waiting and not self.all_ready:
            self.all_ready = True
            self._say("every role is ready; training lines follow as batches fill")

    def _say(self, line: str) -> None:
        print(f"millstream run: {line}", file=self.out, flush=True)
