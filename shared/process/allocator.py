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
and the process started again: the actor does that itself at its start (`allocator_environment`,
with OpenMP's settings: shared/process/runtime.py),
before its engine forks its EngineCore and Worker, which inherit it. Whoever starts the actor
(the launcher, Ray, a shell) needs to do nothing, and one that already set `LD_PRELOAD` with the
library is not started twice.

- `"auto"` (the default): tcmalloc where the machine has it (Debian: `libtcmalloc-minimal4`,
  which `make install` adds as root), for the vLLM actor on CPU; otherwise glibc's, said in
  one line at the actor's start. The synthetic actor and CUDA engines keep glibc's.
- `"system"`: glibc's malloc.
- a path: that library (missing: a ConfigError before anything starts); a bare name
  (`libjemalloc.so.2`): the loader finds it.
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
from pathlib import Path

from millstream.shared.config import Config, ConfigError
from millstream.shared.process.cpus import engine_on_cpu

__all__ = [
    "allocator_environment",
    "allocator_library",
    "check_allocator",
    "find_tcmalloc",
    "loaded",
]

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
    """The library the actor process should preload, or None for glibc's malloc. A path is
    made absolute (the actor may run in another directory); a bare name is the loader's to find."""
    choice = cfg.actor.allocator
    if choice == "system":
        return None
    if choice != "auto":
        return os.path.abspath(choice) if "/" in choice else choice
    return find_tcmalloc() if engine_on_cpu(cfg) else None


def check_allocator(cfg: Config) -> None:
    """Raise ConfigError naming `actor.allocator` when it names a path that is not a file."""
    choice = cfg.actor.allocator
    if "/" in choice and not Path(choice).is_file():
        raise ConfigError(
            f"actor.allocator = {choice!r}: no such file (or 'auto', 'system', a library's name)"
        )


def loaded(library: str) -> bool:
    """Whether this process has `library` mapped: a mapped file whose name starts with the
    library's (a soname such as `libtcmalloc_minimal.so.4` maps its versioned file)."""
    names = (os.path.basename(library), os.path.basename(os.path.realpath(library)))
    try:
        with open("/proc/self/maps") as maps:
            mapped = {
                os.path.basename(line.split()[-1])
                for line in maps
                if line.rstrip().endswith(".so") or ".so." in line
            }
    except OSError:  # not Linux: nothing to compare against
        return False
    return any(m.startswith(name) for m in mapped for name in names)


def allocator_environment(cfg: Config) -> dict[str, str]:
    """`LD_PRELOAD` as this process needs it to run under the configured allocator, or nothing
    when it does already (or none is configured or found, or the loader ignored the name).
    Starting again with it costs the imports before it (about 2 s of torch)."""
    library = allocator_library(cfg)
    if library is None:
        if cfg.actor.allocator == "auto" and engine_on_cpu(cfg):
            log.info("glibc's malloc: no tcmalloc here (Debian: apt-get install libtcmalloc-minimal4)")
        return {}
    preloaded = os.environ.get("LD_PRELOAD", "")
    if loaded(library):
        log.info("memory allocator: %s", library)
        return {}
    if library in preloaded.split(":"):  # named, and the loader ignored it: do not loop
        log.warning("memory allocator: %s is in LD_PRELOAD but not loaded; glibc's malloc", library)
        return {}
    check_allocator(cfg)
    return {"LD_PRELOAD": ":".join(filter(None, (library, preloaded)))}
