"""Which memory allocator the actor's engine runs on (`actor.allocator`).

vLLM's CPU backend allocates its step's tensors through malloc, in sizes that change with every
batch: logits, log-probabilities and sampling buffers are a row of the vocabulary per sequence
(0.6 MB a row for Qwen2's 151,936 tokens in float32), so a step of b sequences asks for b rows.
glibc's malloc serves those sizes from its main heap once its mmap threshold has risen past
them, and that heap only shrinks from its top: with sizes shifting every step it fragments and
grows, slower and slower, for about a quarter of an hour. Measured in the engine's Worker
(bench/README.md, "Soak"): its heap went from 700 to 960 MiB in the first 6 minutes of a run,
all of the actor's growth. tcmalloc, which vLLM's CPU documentation asks for, keeps size-class
free lists and gives memory back; vLLM's CPU wheel may bundle it (vllm/libs) but 0.32's does not.

A library has to be loaded before the process starts allocating, so it is named in `LD_PRELOAD`
and the process started again: the actor does that itself at its start (`preload_allocator`),
before its engine forks its EngineCore and Worker, which inherit it. Whoever starts the actor
(the launcher, Ray, a shell) needs to do nothing, and one that already set `LD_PRELOAD` with the
library is not started twice.

- `"auto"` (the default): tcmalloc where the machine has it (Debian: `libtcmalloc-minimal4`,
  which `make setup` installs as root), for the vLLM actor on CPU; otherwise glibc's, said in
  one line at the actor's start. The synthetic actor and CUDA engines keep glibc's.
- `"system"`: glibc's malloc.
- a path: that library (missing: a ConfigError before anything starts).
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
import sys
from pathlib import Path

from millstream.shared.config import Config, ConfigError

__all__ = ["allocator_library", "check_allocator", "preload_allocator"]

log = logging.getLogger("actor")

#: Where distributions put tcmalloc (the minimal build: no heap profiler, what vLLM asks for).
_TCMALLOC_GLOBS = (
    "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def find_tcmalloc() -> str | None:
    """The path of tcmalloc on this machine, or None."""
    for pattern in _TCMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    name = ctypes.util.find_library("tcmalloc_minimal")  # elsewhere on the loader's path
    return name or None


def allocator_library(cfg: Config) -> str | None:
    """The library the actor process should preload, or None for glibc's malloc."""
    choice = cfg.actor.allocator
    if choice == "system":
        return None
    if choice != "auto":
        return choice
    if cfg.actor.kind != "vllm" or cfg.actor.device == "cuda" or glob.glob("/dev/nvidia[0-9]*"):
        return None
    return find_tcmalloc()


def check_allocator(cfg: Config) -> None:
    """Raise ConfigError naming `actor.allocator` when it names a file that is not there."""
    choice = cfg.actor.allocator
    if choice not in ("auto", "system") and not Path(choice).is_file():
        raise ConfigError(f"actor.allocator = {choice!r}: no such file (or 'auto', 'system')")


def preload_allocator(cfg: Config) -> None:
    """Start this process again with the configured allocator preloaded, unless it already is
    (or none is configured or found). Call it first thing: nothing before it survives."""
    library = allocator_library(cfg)
    if library is None:
        if cfg.actor.allocator == "auto" and cfg.actor.kind == "vllm" and cfg.actor.device != "cuda":
            log.info("glibc's malloc: no tcmalloc here (Debian: apt-get install libtcmalloc-minimal4)")
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    if library in preloaded.split(":"):
        log.info("memory allocator: %s", library)
        return
    check_allocator(cfg)
    env = dict(os.environ, LD_PRELOAD=":".join(filter(None, (library, preloaded))))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
