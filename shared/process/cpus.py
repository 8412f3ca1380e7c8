"""Which cores each role runs on, and how many threads its math starts.

On GPUs each role owns its device. On a CPU box every role's math runs on the same cores, and
OpenMP threads spin at every barrier: a learner whose torch starts one thread per core, on a
2-core box where vLLM's worker computes too, waits on a descheduled thread at each operation.
Measured here (tiny model, 2 cores, 32 episodes a step): the learner's train step took 2.4-5.2 s
sharing the cores and 0.3 s on a core of its own, and a 6-step run went from 42-46 s to 22 s.

So on a CPU box the roles get cores of their own (`actor.cpus`, `learner.cpus`, `envpool.cpus`):
- `"auto"` (the default): with no GPU on the machine, the actor takes the first half of the
  cores this process may use (rounded up), the learner the rest (all of them on one core), and
  the envpool is not pinned and runs one thread (it is a Python event loop; its tokenizer and
  environments need no thread pool). With a GPU, or under Ray (which reserves CPUs itself),
  `"auto"` changes nothing.
- `"all"`: not pinned, libraries' own thread counts (the behaviour before this setting).
- a core list such as `"0-3,8"`: exactly those cores.

A role's cores are shared out among its processes: actor replica i (and a judge, after the
replicas) and learner rank i each get their own slice when there are enough cores, else all of
them; the threads are the slice's cores (divided among an actor's tensor-parallel workers).
Each role applies its share to itself at start, before its work starts any thread pool: the
affinity and `OMP_NUM_THREADS` are inherited by the processes it starts (vLLM's engine and
workers), and torch, where the role's modules imported it already, is sized directly.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from millstream.shared.config import Config, ConfigError

__all__ = ["CpuShare", "apply_share", "check_cpus", "engine_on_cpu", "has_gpu", "parse_cores", "role_share"]

#: The environment variables thread pools read at start: OpenMP (torch, vLLM-CPU), MKL, and the
#: Rust pool of Hugging Face tokenizers.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")


@dataclass(frozen=True)
class CpuShare:
    """A process's cores (None: not pinned) and thread count (None: the libraries' own)."""

    cores: tuple[int, ...] | None
    threads: int | None


UNCHANGED = CpuShare(None, None)


def parse_cores(spec: str) -> tuple[int, ...]:
    """`"0-3,8"` -> (0, 1, 2, 3, 8); raises ValueError for a range that runs backwards."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"the range {part!r} runs backwards")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def has_gpu() -> bool:
    """An NVIDIA device node on this machine (read without importing torch)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def engine_on_cpu(cfg: Config) -> bool:
    """The actor's vLLM engine runs on the CPU: `auto` does where the machine has no NVIDIA
    device nodes, or where `CUDA_VISIBLE_DEVICES` hides them (Ray does, for a role with no GPU)."""
    if cfg.actor.kind != "vllm" or cfg.actor.device == "cuda":
        return False
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return cfg.actor.device == "cpu" or hidden or not has_gpu()


def _auto_split(available: Sequence[int]) -> dict[str, tuple[int, ...] | None]:
    cores = tuple(sorted(available))
    if len(cores) < 2:
        return {"actor": cores, "learner": cores, "envpool": None}
    half = (len(cores) + 1) // 2
    return {"actor": cores[:half], "learner": cores[half:], "envpool": None}


def _splits(cfg: Config) -> bool:
    """Whether "auto" splits the cores: a local run on a machine without a GPU."""
    gpu = cfg.actor.device == "cuda" or (cfg.actor.device == "auto" and has_gpu())
    return not gpu and cfg.launcher.kind == "local"


def role_share(
    cfg: Config, role: str, index: int = 0, *, judge: bool = False, available: Sequence[int] | None = None
) -> CpuShare:
    """The share of process `index` of `role` ("actor", "learner", "envpool"): actor replica or
    learner rank `index`; `judge` for the judge's engine (the actor's cores, after the replicas)."""
    spec = getattr(cfg, role).cpus
    if spec == "all" or (spec == "auto" and not _splits(cfg)):
        return UNCHANGED
    if spec != "auto":
        cores = parse_cores(spec)
    else:
        mine = _auto_split(sorted(os.sched_getaffinity(0)) if available is None else available)[role]
        if mine is None:  # not pinned, one thread: the envpool's event loop
            return CpuShare(None, 1)
        cores = mine
    processes = {"actor": cfg.actor.replicas + bool(cfg.judge.model_path), "learner": cfg.learner.ranks}
    count = processes.get(role, cfg.envpool.workers)
    slot = cfg.actor.replicas if judge else index
    if len(cores) >= count:  # a slice each, the first ones one core larger when it does not divide
        size, extra = divmod(len(cores), count)
        start = slot * size + min(slot, extra)
        cores = cores[start : start + size + (slot < extra)]
    if role == "envpool":
        return CpuShare(cores, 1)
    workers = cfg.actor.tensor_parallel_size if role == "actor" else 1
    return CpuShare(cores, max(1, len(cores) // workers))


def apply_share(share: CpuShare) -> None:
    """Pin this process and size the thread pools it and its children start. Call it before
    any thread pool runs: threads started earlier keep the cores they had."""
    if share.cores is not None:
        os.sched_setaffinity(0, share.cores)
    if share.threads is not None:
        for name in _THREAD_VARS:
            os.environ[name] = str(share.threads)
        torch = sys.modules.get("torch")
        if torch is not None:  # imported with the role's modules: its pool is sized, not started
            torch.set_num_threads(share.threads)


def check_cpus(cfg: Config, available: Sequence[int] | None = None) -> None:
    """Raise ConfigError naming the key when a role's core list names a core this process may
    not use (a typo would otherwise fail at the role's start, after the others started)."""
    allowed = set(os.sched_getaffinity(0) if available is None else available)
    for role in ("actor", "learner", "envpool"):
        spec = getattr(cfg, role).cpus
        if spec in ("auto", "all"):
            continue
        try:
            missing = sorted(set(parse_cores(spec)) - allowed)
        except ValueError as exc:
            raise ConfigError(f"{role}.cpus = {spec!r}: {exc}") from None
        if missing:
            raise ConfigError(
                f"{role}.cpus = {spec!r}: cores {_ranges(missing)} are not available here "
                f"(this machine offers {_ranges(sorted(allowed))})"
            )


def _ranges(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)
