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
    ("save", extra)      every rank writes its part of the DeepSpeed checkpoint (`extra`: what
                         rank 0 saves beside it, the run directory among it)
    ("load", path)       every rank loads its part of the checkpoint at `path` (a resume)
    ("wait", None)       nothing: rank 0 is waiting (for experience), and says so now and then
    ("stop", None)       followers return

With one rank the team is a no-op and no collective is ever called.

A follower waits for the next command inside a collective, through rank 0's quiet times, which
could outlast torch's default bound (10 minutes on NCCL); the follower would then be killed and
the run stopped. So the quiet times are bounded on both sides. While rank 0 waits for
experience, however long, it sends "wait" every `BEAT_S` (`beat`). The one wait it cannot break
up is the start, which `collective_timeout_s`, the group's bound, covers: the replicas' start
and their weight group before the first push (under ZeRO-2 the followers walk the weights with
no collective and wait for the next command at once). A rank that dies does not wait for any
of this: its connections break, and the launcher stops the run when any rank exits.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from millstream.shared.config import Config

__all__ = ["BEAT_S", "Team", "collective_timeout_s"]


#: Rank 0 says "wait" when it has said nothing for this long (`Team.beat`).
BEAT_S = 60.0


def collective_timeout_s(cfg: Config) -> float:
    """The longest rank 0 may leave the other ranks waiting in one collective: the replicas'
    start and their weight group twice over (one formed again), a beat, and a minute to spare."""
    return cfg.actor.startup_timeout_s + 2 * cfg.learner.sync_timeout_s + BEAT_S + 60


class Team:
    def __init__(self) -> None:
        ready = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if ready else 0
        self.world = dist.get_world_size() if ready else 1
        self.said = time.monotonic()  # when rank 0 last sent a command

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def command(self, kind: str, payload: Any = None) -> None:
        """Rank 0: tell the followers what collective step comes next."""
        if self.world > 1:
            dist.broadcast_object_list([(kind, payload)], src=0)
        self.said = time.monotonic()

    def beat(self) -> None:
        """Rank 0, once per pass of its loop: "wait" if it has said nothing for `BEAT_S`, so
        that no follower sits in one collective longer than that while rank 0 waits."""
        if self.world > 1 and time.monotonic() - self.said > BEAT_S:
            self.command("wait")

    def next_command(self) -> tuple[str, Any]:
        """Followers: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, items: list) -> list:
        return items[self.rank :: self.world]
