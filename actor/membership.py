"""A replica's word to its run: "take me" (a replica started by hand) and "I am leaving".

    millstream actor --join RUN_DIR            (this host: the run's config and keys are there)
    millstream actor --join tcp://HOST:PORT --config run.toml transport.keys_dir=...  (elsewhere)

The run's registry is its learner: it keeps the list of replicas that hold its current weights
and announces it to the envpool workers in every `PolicyVersion` (learner/sync/fleet.py). A replica
reaches it on the learner's experience address, the PULL socket every worker pushes episodes to,
with the actor's CURVE key, so joining needs nothing the run does not already serve.

A joining replica says `ReplicaJoin` every few seconds for as long as it runs: the learner
attaches it (weights first, then the announcement), and a restarted learner, which knows only
the replicas of its config, finds it again the same way. Replicas the launcher started need no
join (the learner has their addresses from the config); every replica says `ReplicaLeave` when
it drains on SIGTERM, so no new episode goes to it while its live turns finish.
"""

from __future__ import annotations

import logging
import uuid

import anyio

from millstream.shared.config import Config
from millstream.shared.wire import ReplicaJoin, ReplicaLeave
from millstream.shared.wire.keys import RunKeys
from millstream.shared.wire.replicas import JOIN_EVERY_S
from millstream.shared.wire.transport import Channel, open_channel

__all__ = ["Membership"]

log = logging.getLogger("actor")


class Membership:
    """The replica's PUSH channel to the learner, and what it says on it."""

    def __init__(
        self, cfg: Config, keys: RunKeys | None, name: str, address: str, *, learner: str, join: bool
    ) -> None:
        self.name, self.address, self.join = name, address, join
        self.incarnation = uuid.uuid4().hex[:12]
        self.channel: Channel = open_channel("push", learner, bind=False, cfg=cfg.transport, keys=keys)
        self.learner = learner

    async def run(self) -> None:
        """The channel's I/O, and for a joining replica its repeated `ReplicaJoin`."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.channel.run)
            if self.join:
                log.info("%s joining the run at %s as %s", self.name, self.learner, self.address)
                while self.join:
                    try:
                        self.channel.send_nowait(ReplicaJoin(self.name, self.address, self.incarnation))
                    except anyio.WouldBlock:  # the learner reads nothing: it gets the next one
                        pass
                    await anyio.sleep(JOIN_EVERY_S)

    async def leave(self) -> None:
        """Tell the learner this replica is going (bounded: a learner that is gone is no reason
        to hang the drain)."""
        self.join = False
        try:
            self.channel.send_nowait(ReplicaLeave(self.name, self.incarnation))
        except anyio.WouldBlock:
            return
        await self.channel.flush(timeout=2.0)
