"""Rank 0's link to the envpool: PULL for episodes, PUB for policy versions, stdout for the launcher.

Both bind as CURVE servers with the run's keys (`shared/wire/keys.py`): only the run's envpool can
push an episode or read a version. The learner is a synchronous training loop, so these are
plain blocking pyzmq sockets with poll timeouts: there is nothing else for it to do while it
waits. A frame that does not decode is counted (`codec.errors`) and dropped; a PULL socket
cannot answer.

`say` writes a progress line for the launcher to relay. If the launcher is gone its pipe is
closed: rather than die on a BrokenPipeError traceback, the learner stops as if told to
(KeyboardInterrupt, exit status 130), and its checkpoint stays resumable.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator

import zmq

from millstream.shared.config import Config
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import (
    Codec,
    Message,
    PolicyVersion,
    ProtocolError,
    ReplicaJoin,
    ReplicaLeave,
    ReplicaRef,
    Settled,
)
from millstream.shared.wire.keys import RunKeys, secure
from millstream.shared.wire.transport import limit_socket

__all__ = ["Experience", "say"]

log = logging.getLogger("learner")


class Experience:
    """Rank 0's sockets: PULL for episodes, PUB for versions."""

    def __init__(self, cfg: Config, keys: RunKeys | None) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.codec = Codec()
        self.secure = keys is not None
        self.pull = ctx.socket(zmq.PULL)
        limit_socket(self.pull, cfg.transport)  # any local process may connect and send
        self.pull.setsockopt(zmq.RCVHWM, cfg.transport.high_water_mark)
        secure(self.pull, keys, bind=True)
        self.pull.bind(cfg.learner.experience_address)
        self.pub = ctx.socket(zmq.PUB)
        limit_socket(self.pub, cfg.transport)
        secure(self.pub, keys, bind=True)
        self.pub.bind(cfg.learner.version_address)
        self.last_announce = 0.0
        self.bad = RateLog(log)  # bad frames: counted in codec.errors, a sample logged

    def announce(
        self,
        version: int,
        limit: int,
        group_base: int,
        final: bool = False,
        next_groups: list[int] | None = None,
        session: str = "",
        replicas: list[ReplicaRef] | None = None,
        settled: list[Settled] | None = None,
    ) -> None:
        message = PolicyVersion(
            version, limit, group_base, final, next_groups or [], session, replicas, settled
        )
        self.pub.send(self.codec.encode([message]))
        self.last_announce = time.monotonic()

    #: How long past its deadline `receive` goes on taking frames that are already queued.
    DRAIN_S = 1.0

    def receive(self, timeout_s: float) -> Iterator[tuple[Message, str | None]]:
        """Yield the messages that arrive within `timeout_s`, and those queued by then, each
        with the identity of the key that sent it ("envpool-3", "actor", ...; None without
        CURVE): the intake takes a worker's messages only from that worker's key.

        Queued frames are taken past the deadline, but for `DRAIN_S` at most: envpool workers
        that send as fast as this loop reads would otherwise hold it here, away from its
        version heartbeat, its steps and its replicas' weights."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left < -self.DRAIN_S or not self.pull.poll(max(0, int(left * 1000))):
                return
            frame = self.pull.recv(copy=False)
            try:
                messages = self.codec.decode(frame.buffer)
            except ProtocolError as exc:  # counted in codec.errors; a PULL cannot answer
                self.bad.event("malformed_frame", "dropped a bad experience frame: %s", exc)
                continue
            sender = str(frame.get("User-Id")) if self.secure else None
            for message in messages:
                if isinstance(message, (ReplicaJoin, ReplicaLeave)) and sender not in (None, "actor"):
                    # Only the actor key may add or remove replicas (a replica gets the weights,
                    # so a worker's key must not name one).
                    self.bad.event("not_actor", "dropped %s from a non-actor key", type(message).__name__)
                    continue
                yield message, sender

    def close(self) -> None:
        self.pull.close(linger=0)
        self.pub.close(linger=0)


def say(line: str) -> None:
    """One line on stdout, which the launcher relays; a closed pipe means the launcher is gone."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (nobody is listening any more)
        raise KeyboardInterrupt("stdout is closed: the launcher is gone") from None
