"""The launcher's stdout, which carries the run's lines and the learner's: when it breaks, the run
stops, as on Ctrl-C.

`millstream run | head`, or a `tee` that dies: the reader is gone, and the launcher's next write
raises BrokenPipeError wherever it happens to be. In the thread that relays the learner's lines
it ended the relay alone, and the run went on with a learner bound to block once its unread
pipe filled; in the watch loop or the final lines it unwound the launcher past its own clean-up
and exited 0, as if the run had finished. `RunOutput` turns the first failed write into what
Ctrl-C does instead: the launcher says so on stderr and sets `stop` (the event its watch loop
waits on), so the run stops in order and the launcher exits 130, as interrupted. Every later
write is dropped, so the relay reads the learner's lines on, and the stream itself is pointed at
/dev/null, so that the interpreter's last flush at exit does not fail again.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import IO

__all__ = ["RunOutput"]


class RunOutput(io.TextIOBase):
    """`out`, whose first failed write or flush stops the run (`stop.set()`) and silences it."""

    def __init__(self, out: IO[str], stop: threading.Event) -> None:
        super().__init__()
        self._out, self._stop = out, stop
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._out.write(text)
            except (OSError, ValueError):  # a broken pipe (ValueError: the stream was closed)
                self._break()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._out.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError, ValueError):  # stderr may be the same pipe
            print("millstream run: stdout is closed: stopping the run", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._out.fileno())
            os.close(devnull)
        self._stop.set()
