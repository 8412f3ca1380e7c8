"""Names and addresses of a run's actor replicas, so launcher, learner and actor agree on them.

A run has `actor.replicas` replicas the launcher starts (and restarts), plus any started by
hand with `millstream actor --join`. Replica 0 is called "actor" (a one-replica run looks as it
always did: `actor.pid`, `logs/actor.log`), replica i is "actor-i". Each binds its own address:
`actor.replica_addresses[i]`, which the launcher fills in from `actor.address` (a free port for
each when the port is 0, else consecutive ports).
"""

from __future__ import annotations

import os
import socket

from millstream.shared.config import Config, ConfigError

__all__ = ["replica_name", "replica_address", "replica_addresses", "joined_name", "JOIN_EVERY_S"]

#: How often a replica started by hand repeats its `ReplicaJoin` (actor/membership.py); the
#: learner forgets a joined replica that is down and silent for ten of these (learner/sync/fleet.py).
JOIN_EVERY_S = 3.0


def replica_name(index: int) -> str:
    return "actor" if index == 0 else f"actor-{index}"


def replica_address(cfg: Config, index: int) -> str:
    """Where replica `index` binds."""
    addresses = cfg.actor.replica_addresses
    if not addresses and index == 0:
        return cfg.actor.address
    if index >= len(addresses):
        raise ConfigError(
            f"actor.replica_addresses has {len(addresses)} addresses, no address for replica "
            f"{index} (the launcher fills it from actor.address and actor.replicas)"
        )
    return addresses[index]


def replica_addresses(cfg: Config) -> list[str]:
    """The addresses of the replicas the run starts, in order (one when none are listed)."""
    return list(cfg.actor.replica_addresses) or [cfg.actor.address]


def joined_name() -> str:
    """The default name of a replica started by hand: host and pid, unique in a run."""
    return f"actor-{socket.gethostname()}-{os.getpid()}"
