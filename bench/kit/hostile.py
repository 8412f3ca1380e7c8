"""A hostile local peer that attacks a live run, bounded in count and time.

`Attacker(run_dir)` waits for the run's config, then every `every_s` tries what any process on
the machine could (the probes of tests/test_hostile.py, repeated while the run lives):

- garbage frames, and an attach as the learner, to the actor with the envpool tools' key (a
  peer inside the run, but not the learner);
- a forged episode pushed to the learner with no key (no handshake: never delivered);
- with the tools' key, a `WorkerHello` as worker 0 with a new incarnation and a failure for one
  of its groups (a key that speaks for no worker: refused, `wrong_worker` / `not_a_worker`);
- a keyless connection that sends a CURVE greeting and declares a 2 GiB handshake frame (the
  actor must close it at the header, not buffer it).

`sent` counts each kind, `answers` the actor's replies by cause. Used by tests/test_run.py (a
learning run under attack) and bench/soak (an hour of it).
"""

from __future__ import annotations

import socket
import struct
import threading
import tomllib
from collections import Counter
from pathlib import Path

import zmq

from millstream.shared.config import Config, TransportConfig
from millstream.shared.wire import (
    AttachLearner,
    Cause,
    Codec,
    EpisodeFailed,
    Message,
    Trajectory,
    WorkerHello,
)
from millstream.shared.wire.keys import load_keys, secure

__all__ = ["Attacker"]


def _curve_greeting() -> bytes:
    """ZMTP 3.0's greeting as a client asking for CURVE: what libzmq sends first."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" * 32


class Attacker:
    """While a run lives, the attacks of the module docstring every `every_s`, `rounds` times."""

    def __init__(self, run_dir: Path, *, every_s: float = 0.5, rounds: int = 60) -> None:
        self.run_dir, self.every_s, self.rounds = run_dir, every_s, rounds
        self.sent: Counter[str] = Counter()
        self.answers: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        config = self.run_dir / "config.toml"
        while not config.exists() and not self.stop.wait(0.2):
            pass
        if self.stop.is_set():
            return
        self.stop.wait(2.0)  # the roles bind their sockets
        resolved = tomllib.loads(config.read_text())
        tools = load_keys(
            Config(transport=TransportConfig(keys_dir=resolved["transport"]["keys_dir"])), "envpool"
        )
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        actor_address = resolved["actor"]["connect"] or resolved["actor"]["address"]
        experience = resolved["learner"]["experience_address"]
        actor = self._socket(ctx, zmq.DEALER, actor_address, tools)
        keyless = self._socket(ctx, zmq.PUSH, experience, None)
        as_tools = self._socket(ctx, zmq.PUSH, experience, tools)
        try:
            for _ in range(self.rounds):
                if self.stop.wait(self.every_s):
                    break
                self._round(actor, keyless, as_tools, actor_address)
        finally:
            for sock in (actor, keyless, as_tools):
                sock.close()

    @staticmethod
    def _socket(ctx: zmq.Context, kind: int, address: str, keys) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10)  # a keyless one never connects: keep what it queues small
        secure(sock, keys, bind=False)
        sock.connect(address)
        return sock

    def _round(
        self, actor: zmq.Socket, keyless: zmq.Socket, as_tools: zmq.Socket, actor_address: str
    ) -> None:
        codec = Codec()
        attach = codec.encode([AttachLearner("attacker", "127.0.0.1", 1, 2, "gloo", 5.0)])
        to_actor = [("garbage_to_actor", g) for g in (b"", b"\xc1", b"\x93\x01\x02", b"\x00" * 64)]
        for kind, frame in [*to_actor, ("attach_with_envpool_key", attach)]:
            try:  # never blocks: an actor that is down (a kill, the run's end) costs a count
                actor.send(frame, zmq.NOBLOCK)
                self.sent[kind] += 1
            except zmq.Again:
                self.sent[f"{kind}_blocked"] += 1
        forged = Trajectory(
            "forged", "g0", 0, "x", [1, 2], [0, 1], [0.0, -0.1], [-1, 0], 1e9, [1e9], 1, 1, 0.1
        )
        as_worker_0: list[Message] = [
            WorkerHello(0, "forged"),
            EpisodeFailed("g0-e0", "g0", 1, Cause.ENV_ERROR, "forged"),
        ]
        forged_episode: list[Message] = [forged]
        for sock, kind, messages in (
            (keyless, "unkeyed_episode_to_learner", forged_episode),
            (as_tools, "hello_and_failure_as_worker_0", as_worker_0),
        ):
            try:
                sock.send(codec.encode(messages), zmq.NOBLOCK)
                self.sent[kind] += 1
            except zmq.Again:
                self.sent[f"{kind}_blocked"] += 1
        self._huge_handshake(actor_address)
        while actor.poll(0):
            for reply in codec.decode(actor.recv()):
                self.answers[str(getattr(reply, "cause", type(reply).__name__))] += 1

    def _huge_handshake(self, address: str) -> None:
        """A keyless greeting, then a handshake frame declaring 2 GiB and up to 4 MiB of it.
        Whether the actor buffered it shows in its memory (bench/soak samples it), not here:
        the kernel's socket buffers take a few MiB either way."""
        if not address.startswith("tcp://"):
            return
        host, port = address[len("tcp://") :].rsplit(":", 1)
        self.sent["huge_handshake"] += 1
        try:
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                raw.sendall(_curve_greeting())
                raw.recv(64)
                raw.sendall(b"\x06" + struct.pack(">Q", 2 << 30))
                for _ in range(4):
                    raw.sendall(b"\0" * (1 << 20))
        except OSError:  # closed at the header: what should happen
            pass
