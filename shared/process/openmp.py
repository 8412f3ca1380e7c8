"""How the actor engine's OpenMP threads wait for each other (`actor.omp_wait`).

vLLM's CPU Worker computes every layer with OpenMP threads that meet at a barrier after each
parallel loop. Without `OMP_WAIT_POLICY`, GNU OpenMP (torch's) spins at a barrier for a while
before it sleeps. On a CPU box the Worker's threads never have their cores to themselves: the
engine's EngineCore polls in a busy loop, and the actor's front end, the envpool and ZeroMQ's
threads wake beside them. A thread that spins waits for a peer another thread has descheduled,
on the core that peer needs.

Measured on this project's 2-core VM (2026-11-28, `python -m millstream.bench.overhead
--concurrency 64 --rounds 4`, bench/README "OpenMP threads that sleep"): with `PASSIVE`, the
Worker used 107 ms of CPU per 1,000 tokens instead of 225, and tokens/s rose for the engine
alone (AsyncLLM) and behind millstream alike. So:

- `"auto"` (the default): `PASSIVE` for the vLLM engine on CPU, unless the environment already
  sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` (an operator's choice wins); nothing for CUDA
  engines and the synthetic actor.
- `"passive"` / `"active"`: that policy.
- `"library"`: OpenMP's own default (spin, then sleep).

OpenMP reads the variable once, when its library loads, and torch loads it on import: so the
actor starts itself again with the variable set (`openmp_environment`, with the allocator's
`LD_PRELOAD`: shared/process/runtime.py), before its engine forks the EngineCore and the Worker,
which inherit it. Benchmarks that start an engine of their own give it the same environment.
"""

from __future__ import annotations

import os

from millstream.shared.config import Config
from millstream.shared.process.cpus import engine_on_cpu

__all__ = ["openmp_environment", "wait_policy"]


def wait_policy(cfg: Config) -> str | None:
    """The `OMP_WAIT_POLICY` the actor's engine should run with; None: leave it as it is."""
    choice = cfg.actor.omp_wait
    if choice == "library":
        return None
    if choice == "auto":
        chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
        return "PASSIVE" if engine_on_cpu(cfg) and not chosen else None
    return choice.upper()


def openmp_environment(cfg: Config) -> dict[str, str]:
    """What this process's environment lacks of `wait_policy` (nothing when it has it)."""
    policy = wait_policy(cfg)
    if policy is None or os.environ.get("OMP_WAIT_POLICY", "").upper() == policy:
        return {}
    return {"OMP_WAIT_POLICY": policy}
