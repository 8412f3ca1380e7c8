"""Which GPUs each role's processes see under the local launcher (`actor.gpus`, `learner.gpus`).

Every process of a machine sees every GPU and computes on the first one it sees. Left at that,
a run's actor engines, its judge and its learner all compute on GPU 0 while any other GPU idles,
and the learner and the actor share a GPU, which NCCL refuses to connect (the weights then go
over gloo: shared/wire/weightsync.py `pick_backend`). So the launcher gives each role GPUs of
its own, through `CUDA_VISIBLE_DEVICES` in the role's environment, set before the process starts
(CUDA reads it once, at its first call, and a library may make that call at import):

- `"auto"` (the default): where the machine has a GPU for every process that computes on one,
  the actor's engines take the first ones (`actor.tensor_parallel_size` for each replica, then
  the judge's engine), the learner the next ones (one per rank). With fewer, they share: the
  engines take turns on all of them and the learner takes the last ones, as a one-GPU run plans
  (examples/gpu-instruct.toml: the actor takes `actor.gpu_memory_utilization` of it, the learner
  the rest); the launcher says which GPUs are shared (`shared_gpus`). "auto" keeps clear of
  GPUs the other role's list names.
- `"all"`: unchanged, every process sees every GPU.
- a list such as `"0,1"` or `"2-3"`: those GPUs, numbered as CUDA numbers them for the launcher.
  The actor's replicas (then the judge) take `tensor_parallel_size` of them each, taking turns
  when there are fewer than that; the learner's ranks all see the list, and rank r
  computes on its r-th GPU (LOCAL_RANK), so the list holds one per rank at least.

The GPUs are those CUDA would show the launcher: its `CUDA_VISIBLE_DEVICES` where set, else the
machine's NVIDIA device nodes. CUDA numbers them fastest first unless
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, which on a machine of mixed GPU models can differ from
nvidia-smi's order. Under Ray, Ray sets each role's (`launcher.*_gpus`), and a role started by
hand keeps the environment it was given.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from millstream.shared.config import Config, ConfigError
from millstream.shared.process.cpus import engine_on_cpu, parse_cores
from millstream.shared.wire.replicas import replica_name

__all__ = ["check_gpus", "gpu_plan", "role_gpus", "shared_gpus", "visible_gpus", "weights_share_gpu"]

ROLES = ("actor", "learner")


def visible_gpus() -> list[str]:
    """The GPUs CUDA would show this process, as `CUDA_VISIBLE_DEVICES` names them (indices,
    or UUIDs where it names them so); read without importing torch."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [] if named.strip() in ("", "-1") else [gpu.strip() for gpu in named.split(",")]
    return [str(i) for i in range(len(glob.glob("/dev/nvidia[0-9]*")))]


def _needs(cfg: Config) -> tuple[int, int]:
    """(engines the launcher starts on GPUs: replicas and judge, each of tensor_parallel_size
    GPUs; learner ranks, one GPU each)."""
    on_gpu = cfg.actor.kind == "vllm" and not engine_on_cpu(cfg)
    engines = 0 if cfg.actor.connect or not on_gpu else cfg.actor.replicas
    if on_gpu and cfg.judge.model_path and not cfg.judge.connect:
        engines += 1
    return engines, cfg.learner.ranks


def role_gpus(
    cfg: Config, role: str, index: int = 0, *, judge: bool = False, visible: Sequence[str] | None = None
) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for process `index` of `role` (actor replica `index`, or the judge's
    engine with `judge`; for the learner, every rank alike), or None: leave it as it is."""
    if cfg.launcher.kind != "local" or role not in ROLES or getattr(cfg, role).gpus == "all":
        return None
    gpus = list(visible_gpus() if visible is None else visible)
    engines, ranks = _needs(cfg)
    if not gpus or (role == "actor" and engines == 0):
        return None
    actor, learner = _pools(cfg, gpus, engines, ranks)
    if role == "learner":
        return ",".join(learner) if len(learner) >= ranks else None
    tp = cfg.actor.tensor_parallel_size
    groups = len(actor) // tp  # engines that fit side by side; more take turns on them
    if not groups:
        return None  # fewer GPUs than one engine needs: vLLM says so
    slot = (engines - 1 if judge else index) % groups  # the judge's engine comes after the replicas
    return ",".join(actor[slot * tp : (slot + 1) * tp])


def shared_gpus(cfg: Config, visible: Sequence[str] | None = None) -> list[str]:
    """The GPUs that two of the run's GPU processes (engines, learner ranks) will compute on."""
    used = [gpu for _, gpus in _placed(cfg, visible) for gpu in gpus]
    return sorted({gpu for gpu in used if used.count(gpu) > 1})


def weights_share_gpu(cfg: Config, visible: Sequence[str] | None = None) -> str | None:
    """The GPU that learner rank 0 (the weight group's rank 0) shares with an actor replica's
    engine, which the weights then cannot cross over NCCL; None if it shares none. The judge
    is not in the weight group."""
    placed = dict(_placed(cfg, visible))
    learner = placed.get("learner", [])[:1]
    replicas = [gpu for name, gpus in placed.items() if name.startswith("actor") for gpu in gpus]
    return next((gpu for gpu in learner if gpu in replicas), None)


def gpu_plan(cfg: Config, visible: Sequence[str] | None = None) -> str:
    """Which GPUs each GPU process computes on, in a line ("actor 0, judge 1, learner 2,3"; ""
    when none does), for the launcher to say at start."""
    return ", ".join(f"{name} {','.join(gpus)}" for name, gpus in _placed(cfg, visible))


def _placed(cfg: Config, visible: Sequence[str] | None) -> list[tuple[str, list[str]]]:
    """(process, the GPUs it computes on) for every engine (its first tensor_parallel_size
    GPUs) and the learner (rank r on its r-th), as `role_gpus` places them."""
    gpus = list(visible_gpus() if visible is None else visible)
    if not gpus or cfg.launcher.kind != "local":
        return []
    engines, ranks = _needs(cfg)
    tp = cfg.actor.tensor_parallel_size
    judge = engines > 0 and bool(cfg.judge.model_path) and not cfg.judge.connect
    names = [replica_name(i) for i in range(engines - judge)] + ["judge"] * judge
    placed = [
        (name, (role_gpus(cfg, "actor", slot, visible=gpus) or ",".join(gpus)).split(",")[:tp])
        for slot, name in enumerate(names)
    ]
    learner = (role_gpus(cfg, "learner", visible=gpus) or ",".join(gpus)).split(",")[:ranks]
    return placed + [("learner", learner)]


def _pools(cfg: Config, gpus: list[str], engines: int, ranks: int) -> tuple[list[str], list[str]]:
    """(the actor's GPUs, the learner's). A list names them. "auto" keeps clear of the other
    role's list, and takes GPUs of its own where there are enough for every process; else it
    shares: the engines go round all of them, the learner takes the last ones."""
    actor, learner = (_listed(getattr(cfg, role).gpus, gpus) for role in ROLES)
    need = engines * cfg.actor.tensor_parallel_size
    if actor is None and learner is None and need + ranks <= len(gpus):
        return gpus[:need], gpus[need : need + ranks]
    # Sharing, the learner takes the last GPUs, last first: its rank 0, the weight group's,
    # as far as it goes from the first engine.
    last = gpus[len(gpus) - min(ranks, len(gpus)) :][::-1]
    if actor is None:
        free = [gpu for gpu in gpus if gpu not in (learner or [])]
        actor = free if learner is not None and len(free) >= need else gpus
    if learner is None:
        free = [gpu for gpu in gpus if gpu not in actor]
        learner = free[:ranks] if len(free) >= ranks and actor != gpus else last
    return actor, learner


def _listed(spec: str, gpus: list[str]) -> list[str] | None:
    """The GPUs a list names (as the launcher's environment numbers them); None for "auto" and
    "all". Indices past the machine's are left out: `check_gpus` refuses them first."""
    if spec in ("auto", "all"):
        return None
    return [gpus[i] for i in parse_cores(spec) if i < len(gpus)]


def check_gpus(cfg: Config, visible: Sequence[str] | None = None) -> None:
    """Raise ConfigError naming the key when a role's GPU list cannot be honoured here: a GPU
    this machine does not show, fewer GPUs than one engine or the learner's ranks need."""
    if cfg.launcher.kind != "local":
        return
    gpus = list(visible_gpus() if visible is None else visible)
    engines, ranks = _needs(cfg)
    least = {"actor": cfg.actor.tensor_parallel_size if engines else 0, "learner": ranks}
    keys = {"actor": "actor.tensor_parallel_size", "learner": "learner.ranks"}
    for role, key in keys.items():  # each engine, and the learner, need that many GPUs at least
        if gpus and least[role] > len(gpus):
            raise ConfigError(
                f"{key} = {least[role]}: this machine shows {len(gpus)} GPU{'s' * (len(gpus) != 1)}, "
                f"and each {'engine' if role == 'actor' else 'rank'} computes on GPUs of its own"
            )
    for role in ROLES:
        spec = getattr(cfg, role).gpus
        if spec in ("auto", "all"):
            continue
        try:
            listed = parse_cores(spec)
        except ValueError as exc:
            raise ConfigError(f"{role}.gpus = {spec!r}: {exc}") from None
        missing = [i for i in listed if i >= len(gpus)]
        if missing:
            raise ConfigError(
                f"{role}.gpus = {spec!r}: GPU {', '.join(map(str, missing))} is not visible here "
                f"(this machine shows {len(gpus)} GPU{'s' * (len(gpus) != 1)})"
            )
        if len(listed) < least[role]:
            raise ConfigError(
                f"{role}.gpus = {spec!r}: {len(listed)} GPU{'s' * (len(listed) != 1)} for "
                f"{keys[role]} = {least[role]}; list one for each"
            )
