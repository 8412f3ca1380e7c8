"""DeepSpeed set-up for the learner: import it right on CPU, join or create the process group,
and the engine config.

Why a module of its own: these are the traps of running DeepSpeed without (and with) a launcher
on a CPU machine, kept apart from the training step itself.
- On CPU, DeepSpeed must be told its accelerator before import, and the shared-memory comm op,
  a ~60 s g++ JIT build, is not needed.
- Without torchrun/deepspeed setting RANK and friends, DeepSpeed falls back to MPI discovery;
  we pose as rank 0 of a world of 1 instead, and the caller removes those variables again so
  child processes do not inherit them. The group's store is ours, listening on loopback only.
- gloo's own sockets listen where the host's name resolves (or on `GLOO_SOCKET_IFNAME`), and a
  default group's options cannot say otherwise. A learner whose group meets on loopback pins
  `GLOO_SOCKET_IFNAME` to the loopback interface while the group and DeepSpeed's groups form,
  and the caller puts the variable back as it was: on a machine whose name resolves to a LAN
  address, a data-parallel learner's group listened there, open and unauthenticated.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from millstream.shared.config import LearnerConfig
from millstream.shared.process.runtime import free_port
from millstream.shared.wire.weightsync import on_loopback, open_store

__all__ = ["import_deepspeed", "init_distributed", "ds_config", "loopback_interface"]


def import_deepspeed() -> Any:
    # DeepSpeed picks its accelerator once, at import; say "cpu" explicitly rather than rely on
    # detection. Imported lazily because it takes seconds and `import learner.train.trainer` should not.
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    if not torch.cuda.is_available():
        # The shared-memory comm op is a ~60 s g++ JIT build that a CPU run does not need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed(deepspeed: Any, timeout_s: float | None = None) -> dict[str, str | None]:
    """Join (or, with no launcher, create) the default process group; return the env keys we
    set, each with the value it had before (None: unset), for the caller to put back.

    `timeout_s` bounds every collective of the group (None: torch's default, 10 min on NCCL).
    A follower rank spends rank 0's quiet times inside one (learner/team.py), and they can be
    longer than that: `learner.team.collective_timeout_s` says how long.

    The group's TCPStore is ours, listening on MASTER_ADDR only: DeepSpeed's env:// store, like
    any TCPStore that opens its own socket, would listen on every interface. `millstream run`
    starts the ranks of a data-parallel learner itself for this reason (torchrun's agent store
    has the same problem); under torchrun its store is used as it is.
    """
    ours: dict[str, str | None] = {}
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if not dist.is_initialized() and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # No launcher: be rank 0 of 1 (else DeepSpeed tries MPI discovery through mpi4py).
        env = dict(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        ours = {k: None for k in env if k != "LOCAL_RANK"}  # every engine init reads LOCAL_RANK
        os.environ.update(env)
        ours.update(_gloo_on_loopback(backend, "127.0.0.1"))
        store = open_store("127.0.0.1", 0, 1, is_master=True, timeout_s=300)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    elif not dist.is_initialized() and "TORCHELASTIC_RUN_ID" not in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        ours.update(_gloo_on_loopback(backend, host))
        store = open_store(host, port, world, is_master=rank == 0, timeout_s=300)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if timeout is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:  # under torchrun DeepSpeed makes the group, with a 10-minute default of its own
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return ours


def _gloo_on_loopback(backend: str, host: str) -> dict[str, str | None]:
    """Pin gloo's sockets to the loopback interface when the group meets on loopback (module
    docstring); returns what was changed, with its value before."""
    interface = loopback_interface()
    if backend != "gloo" or not on_loopback(host) or interface is None:
        return {}
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    return {"GLOO_SOCKET_IFNAME": before}


def loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS), or None."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def ds_config(cfg: LearnerConfig, dtype: str) -> dict[str, Any]:
    world = dist.get_world_size()
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        # GAS 1: backward's `loss / GAS` is a no-op, so our token-mean normaliser is the only
        # scaling; train_step marks the accumulation boundary itself (any number of
        # micro-batches per step). train_batch_size only feeds DeepSpeed's sample counter.
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg.micro_batch_size * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,  # torch AdamW as a client optimizer
        "steps_per_print": 1 << 30,  # no progress lines in our logs
        "wall_clock_breakdown": False,
    }
