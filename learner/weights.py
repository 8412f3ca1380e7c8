"""The learner's half of weight synchronisation: attach to the actor, push weights.

    sync = WeightSender(actor_address, learner_cfg, dtype="float32", keys=load_keys(cfg, "learner"))
    info = sync.attach()                       # forms the broadcast group with the actor's workers
    sync.push(trainer.named_weights(), version)  # one flat broadcast, then WeightsApplied

The learner is a synchronous training loop, so this side uses a plain blocking DEALER socket with
poll timeouts rather than the anyio `Channel`: there is nothing else for it to do while it waits.
Every wait is bounded (`learner.sync_timeout_s`); a missing or failed actor is an error naming
what was expected, never a hang.

The flat buffer is allocated once (the model's shapes do not change) and reused for every push.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import zmq

from millstream.shared.config import LearnerConfig
from millstream.shared.keys import RunKeys, secure
from millstream.shared.protocol import (
    ActorInfo,
    AttachLearner,
    Codec,
    ErrorReply,
    Hello,
    Message,
    TensorSpec,
    WeightsApplied,
    WeightUpdate,
)
from millstream.shared.weightsync import (
    DTYPES,
    broadcast,
    flat_layout,
    make_group,
    mark_session,
    open_store,
    pick_backend,
)

__all__ = ["WeightSender", "WeightSyncError"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class WeightSyncError(RuntimeError):
    """The actor refused or failed an attach or a weight update, or did not answer in time."""


class WeightSender:
    def __init__(
        self,
        actor_address: str,
        cfg: LearnerConfig,
        *,
        dtype: str,
        keys: RunKeys | None,
        hello_timeout_s: float | None = None,
    ) -> None:
        self.address = actor_address
        #: The first answer may take an engine's whole start-up (actor.startup_timeout_s).
        self.hello_timeout_s = hello_timeout_s or cfg.sync_timeout_s
        self.cfg = cfg
        self.dtype = dtype
        self.backend = pick_backend(cfg.sync_backend)
        self.session = f"learner-{uuid.uuid4().hex[:12]}"
        self._codec = Codec()
        self._keys = keys
        self._sock = self._connect()
        self._probing = False
        self._group: Any = None
        self._store: Any = None
        self._flat: torch.Tensor | None = None
        self._layout: list[TensorSpec] = []
        self.info: ActorInfo | None = None
        self.last_push_s = 0.0

    def _connect(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure(sock, self._keys, bind=False)
        sock.connect(self.address)
        return sock

    def reconnect(self) -> None:
        """Forget the attached actor: a fresh socket (nothing queued for or from the old one is
        read as an answer) and no group; `attach` again before the next push."""
        self._sock.close(linger=0)
        self._sock = self._connect()
        self._group = self._store = None
        self._probing = False

    def answers_hello(self) -> bool:
        """Without blocking: has the actor answered the Hello this sends on its first call?"""
        if not self._probing:
            self._sock.send(self._codec.encode([Hello(self.session)]))
            self._probing = True
        if not self._sock.poll(0):
            return False
        self._probing = False
        return any(isinstance(r, ActorInfo) for r in self._codec.decode(self._sock.recv()))

    def _request(self, message: Message, expect: type[M], timeout_s: float) -> M:
        self._sock.send(self._codec.encode([message]))
        return self._await(expect, timeout_s, what=type(message).__name__)

    def _await(self, expect: type[M], timeout_s: float, what: str) -> M:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1):
                continue
            for reply in self._codec.decode(self._sock.recv()):
                if isinstance(reply, expect):
                    return reply
                if isinstance(reply, ErrorReply):
                    raise WeightSyncError(
                        f"actor at {self.address} refused {what}: {reply.cause}: {reply.message}"
                    )
                log.warning("ignoring %s while waiting for %s", type(reply).__name__, expect.__name__)
        hint = (
            " (is it running, and does it use this run's keys? An actor started elsewhere needs "
            "the same transport.keys_dir)"
            if self._keys is not None and what == "Hello"
            else ""
        )
        raise WeightSyncError(
            f"no {expect.__name__} from the actor at {self.address} within {timeout_s:.0f}s "
            f"after {what}{hint}"
        )

    def attach(self) -> ActorInfo:
        """Say hello, open the store, ask the actor to join, join; returns the actor's info."""
        info = self._request(Hello(self.session), ActorInfo, self.hello_timeout_s)
        if info.dtype != self.dtype:
            raise WeightSyncError(f"actor runs {info.dtype} weights but the learner sends {self.dtype}")
        world = info.weight_ranks + 1
        store = self._store = open_store(
            self.cfg.sync_host, 0, world, is_master=True, timeout_s=self.cfg.sync_timeout_s
        )
        mark_session(store, self.session)  # the actor checks it before its engine joins
        started = time.monotonic()
        self._sock.send(
            self._codec.encode(
                [
                    AttachLearner(
                        self.session,
                        self.cfg.sync_host,
                        store.port,
                        world,
                        self.backend,
                        self.cfg.sync_timeout_s,
                    )
                ]
            )
        )
        self._group = make_group(store, 0, world, self.backend, self.cfg.sync_timeout_s, self.session)
        self.info = attached = self._await(ActorInfo, self.cfg.sync_timeout_s, what="AttachLearner")
        log.info(
            "attached to actor %s (%d weight ranks, %s) in %.2fs",
            self.address,
            info.weight_ranks,
            self.backend,
            time.monotonic() - started,
        )
        return attached

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Broadcast the weights as `version`; returns timing and size metrics."""
        if self._group is None:
            raise WeightSyncError("push() before attach()")
        started = time.monotonic()
        weights = list(named_weights)
        if self._flat is None:
            layout, numel = flat_layout((name, tuple(t.shape)) for name, t in weights)
            self._layout = [TensorSpec(name, shape, offset) for name, shape, offset in layout]
            device = "cuda" if self.backend == "nccl" else "cpu"
            self._flat = torch.empty(numel, dtype=DTYPES[self.dtype], device=device)
        if [(n, list(t.shape)) for n, t in weights] != [(s.name, s.shape) for s in self._layout]:
            raise WeightSyncError("the model's tensors changed between pushes")
        for (_, tensor), spec in zip(weights, self._layout):
            self._flat[spec.offset : spec.offset + tensor.numel()].copy_(tensor.reshape(-1))
        packed = time.monotonic()
        self._sock.send(
            self._codec.encode(
                [WeightUpdate(self.session, version, self.dtype, self._flat.numel(), self._layout)]
            )
        )
        broadcast(self._group, self._flat, self.cfg.sync_timeout_s)
        sent = time.monotonic()
        applied = self._await(WeightsApplied, self.cfg.sync_timeout_s, what="WeightUpdate")
        if applied.version != version:
            raise WeightSyncError(f"actor applied version {applied.version}, expected {version}")
        done = time.monotonic()
        self.last_push_s = done - started
        return {
            "sync/pack_s": packed - started,
            "sync/broadcast_s": sent - packed,
            "sync/total_s": done - started,
            "sync/actor_paused_s": applied.paused_s,
            "sync/bytes": float(self._flat.numel() * self._flat.element_size()),
        }

    def close(self) -> None:
        self._group = None
        self._store = None
        self._sock.close(linger=0)
