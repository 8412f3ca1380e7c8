"""The vLLM EngineCore's scheduling priority on a CPU box (`actor.engine_core_priority`).

On CPU, vLLM runs its model in a Worker process and its scheduler in the EngineCore, which
waits for each step's result by polling shared memory in a loop that only calls
`sched_yield()` (vLLM's `SpinCondition`, busy for a second after every read, so always while
it generates). On a box where the engine shares its cores, that loop is a whole core of
runnable work at normal priority. Whoever else needs a core waits behind it: measured on this
project's 2-core VM (2026-11-28, closed loop of 64 requests, tiny model), the envpool's side
of the hop (a trio process sending 2% of the CPU's work) spent 3.9 s of 10.5 s runnable and
not running, with stalls up to 0.5 s; its requests reached the actor up to 0.5 s late, the
engine's slots idled meanwhile, and the time to first token had a tail of 0.25-0.6 s.

At nice 19 the loop still takes every idle cycle, but yields to any other runnable thread: the
same envpool waited 0.4 s in 10.5 s, the tail went (p90 77 ms), and tokens/s rose (bench/README
"The EngineCore's busy loop"). The EngineCore's real work (scheduling, the outputs) is short and
mostly runs while the other threads sleep; the Worker, which computes, keeps its priority.

- `"auto"` (the default): nice 19 for the vLLM engine on CPU; unchanged on GPU (each engine
  has its device; the loop still spins, but not on cores another role computes on) and for the
  synthetic actor.
- `"low"`: nice 19 wherever the engine runs. `"normal"`: unchanged.

Where the learner computes on the actor's cores (a one-core box, or `actor.cpus=all` with a
learner on the same cores), a nice-19 EngineCore gets about 1.5% of a core against a learner
that never yields, and generation all but stops while it trains: set `"normal"` there.

Raising a nice value needs no privilege. Linux keeps the value per thread, and a thread starts
with its creator's: so every thread of the EngineCore is set once it runs (`lower_engine_cores`),
and those it starts later inherit it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from millstream.shared.config import Config
from millstream.shared.process.cpus import engine_on_cpu
from millstream.shared.process.lifecycle import descendants

__all__ = ["LOW", "engine_core_nice", "lower_engine_cores"]

log = logging.getLogger(__name__)

#: The nice value of a low-priority EngineCore: the lowest priority short of SCHED_IDLE.
LOW = 19


def _title_prefix() -> bytes:
    """The process title vLLM gives its EngineCore (`<prefix>::EngineCore`, with `_DP<n>` under
    data parallelism); the prefix is `VLLM_PROCESS_NAME_PREFIX`'s. Without the setproctitle
    package vLLM sets no title, and nothing is found."""
    return os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM").encode() + b"::EngineCore"


def engine_core_nice(cfg: Config) -> int | None:
    """The nice value the actor's EngineCore should run at; None: leave it."""
    choice = cfg.actor.engine_core_priority
    if choice == "normal" or cfg.actor.kind != "vllm":
        return None
    return LOW if choice == "low" or engine_on_cpu(cfg) else None


def lower_engine_cores(nice: int, root: int | None = None) -> list[int]:
    """Set every thread of each vLLM EngineCore process under `root` (default: this process)
    to `nice`; returns their process ids (none found: none changed, and the caller says so)."""
    prefix = _title_prefix()
    cores = [pid for pid in descendants(root) if _title(pid).startswith(prefix)]
    for pid in cores:
        for tid in _threads(pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except (ProcessLookupError, PermissionError) as exc:  # a thread that just ended
                log.debug("could not set thread %d of EngineCore %d to nice %d: %s", tid, pid, nice, exc)
    return cores


def _title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:  # it ended meanwhile
        return b""


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
