"""Several learner ranks, one voice: rank 0 leads, the others follow its commands.

With `learner.ranks > 1` the launcher starts one learner process per rank (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set as torchrun would; rank 0 hosts the group's store on loopback) and
DeepSpeed trains data parallel (ZeRO-2/3 shard optimizer state, gradients, parameters across
ranks). Only rank 0 talks
to the outside world: it owns the experience sockets, the replay buffer and the link to the actor.
Every collective step must still be entered by all ranks in the same order, so rank 0 announces
each one as a command, broadcast over the DeepSpeed world (gloo on CPU, NCCL on GPU):

    ("train", samples)   every rank trains on its shard samples[rank::world]
    ("weights", None)    every rank walks `trainer.named_weights()` (ZeRO-3 gathers parameters
                         collectively), rank 0 broadcasts them to the actor
    ("save", path)       every rank writes its part of the DeepSpeed checkpoint
    ("stop", None)       followers return

With one rank the team is a no-op and no collective is ever called.

A follower waits for the next command inside a collective, through all of rank 0's quiet times:
the replicas' start and their weight group before the first push (under ZeRO-2 the followers
walk the weights with no collective and wait for the next command at once), then the first
experience. Those can outlast torch's default bound (10 minutes on NCCL), after which the
follower would be killed and the run stopped; `collective_timeout_s` is the group's bound
instead. A rank that dies does not wait for it: its connections break, and the launcher stops
the run when any rank exits.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from millstream.shared.config import Config

__all__ = ["Team", "collective_timeout_s"]


def collective_timeout_s(cfg: Config) -> float:
    """The longest rank 0 may leave the other ranks waiting in one collective, and a minute to
    spare: the replicas' start, their weight group twice over (one formed again), the wait for
    experience."""
    return cfg.actor.startup_timeout_s + 2 * cfg.learner.sync_timeout_s + cfg.learner.idle_timeout_s + 60


class Team:
    def __init__(self) -> None:
        ready = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if ready else 0
        self.world = dist.get_world_size() if ready else 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def command(self, kind: str, payload: Any = None) -> None:
        """Rank 0: tell the followers what collective step comes next."""
        if self.world > 1:
            dist.broadcast_object_list([(kind, payload)], src=0)

    def next_command(self) -> tuple[str, Any]:
        """Followers: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, items: list) -> list:
        return items[self.rank :: self.world]
