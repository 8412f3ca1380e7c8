"""Where an actor's weights land: one buffer, kept between updates, filled while the engine runs.

    receiver = WeightReceiver()
    receiver.start(group, "float32", numel, piece_ends, "cpu", timeout_s)  # returns at once
    ... the engine keeps generating; receiver.done() says when the last piece is in ...
    flat = receiver.wait(timeout_s)          # the whole buffer, or the receive's error
    ... pause the engine, load views of `flat`, resume ...
    receiver.loaded()                        # the buffer now holds the engine's weights
    receiver.digest()                        # their sums, computed when first asked

Why a thread: a gloo broadcast is a wait on sockets, and the engine's own loop must go on
stepping meanwhile, so the receive runs beside it and the engine pauses only to load what
arrived. In a vLLM worker, `collective_rpc` calls run on the worker's model thread: a receive
there would stop generation for the whole transfer. NCCL receives in the caller's thread
(`in_thread=False`, inside the pause, as before): an NCCL wait orders the thread's CUDA stream
after the broadcast, which is the stream the engine computes on, and a second communicator
driven from another thread beside vLLM's own tensor-parallel one can deadlock; a side stream
would lift both, and is not written until it can be tested on a GPU.

A receive that never ended (its update timed out on the actor's side) is abandoned with its
buffer when the next one starts: the old thread ends at its own timeout, writing only into the
buffer it was given, and the new receive gets a fresh one.

Why one buffer for the life of the process: a fresh `torch.empty` per update faults in its pages
during the receive (a model's worth of page faults on the critical path, measured at a third of
a synthetic push). The model's shapes do not change, so the buffer is allocated on the first
update and reused; an update of another size or dtype replaces it.

Why the digest waits until asked: summing a model's worth of float64 took 0.2-1.2 s per update on
this project's CPU box and only a check reads it (`DigestWeights`). The buffer holds what the
engine loaded until the next receive starts, and the actor's learner link never runs a digest
during an update, so a digest computed late is still the digest of what was loaded. A receive
that failed half-way leaves the buffer neither old nor new: the digest then says so instead of
summing it.

An engine that kept the buffer's memory as its weights (views instead of copies) would see the
next receive overwrite them while it generates: `release` hands the buffer over to it (the
digest is taken first) and the next update gets a fresh one.

Nothing here imports the actor server: vLLM's worker processes import this module alone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from millstream.shared.wire.weightsync import DTYPES, broadcast_pieces, flat_digest

__all__ = ["WeightReceiver"]

log = logging.getLogger(__name__)


@dataclass
class _Receive:
    """One update's receive: its buffer, and how it ended."""

    buffer: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self, group: Any, piece_ends: list[int], timeout_s: float) -> None:
        try:
            broadcast_pieces(group, self.buffer, piece_ends, timeout_s)
        except BaseException as exc:  # handed to whoever waits (`done`, `wait`)
            self.error = exc
        finally:
            self.done.set()


class WeightReceiver:
    """One reusable receive buffer, filled by a background thread (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._receive: _Receive | None = None
        #: True once the buffer holds exactly what the engine loaded last.
        self._holds_loaded = False
        self._digest: tuple[float, float, int] | None = None

    def start(
        self,
        group: Any,
        dtype: str,
        numel: int,
        piece_ends: list[int],
        device: Any,
        timeout_s: float,
        *,
        in_thread: bool = True,
    ) -> None:
        """Begin receiving the next update's broadcast; returns at once (`in_thread`) or once
        it is in or failed."""
        if self._receive is not None and not self._receive.done.is_set():
            log.warning("a weight receive never ended; abandoned, with its buffer")
            self._buffer = None
        receive = _Receive(self._buffer_for(DTYPES[dtype], numel, device))
        self._receive, self._holds_loaded, self._digest = receive, False, None
        if not in_thread:
            receive.run(group, piece_ends, timeout_s)
            return
        threading.Thread(
            target=receive.run,
            args=(group, piece_ends, timeout_s),
            name="millstream-weight-receive",
            daemon=True,  # bounded by timeout_s; never keeps a stopping process alive
        ).start()

    def _buffer_for(self, dtype: torch.dtype, numel: int, device: Any) -> torch.Tensor:
        current = self._buffer
        fits = current is not None and current.numel() == numel and current.dtype == dtype
        if current is not None and fits and current.device == torch.device(device):
            return current
        self._buffer = current = None  # the old one goes before the new one is allocated
        self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return self._buffer

    def done(self) -> bool:
        """Without blocking: is the last piece in? Raises the receive's error if it failed."""
        if self._receive is None or not self._receive.done.is_set():
            return False
        self._raise_failure(self._receive)
        return True

    def wait(self, timeout_s: float) -> torch.Tensor:
        """The received buffer, once complete (at most `timeout_s`); raises the receive's error."""
        receive = self._receive
        if receive is None:
            raise RuntimeError("no weight receive was started on this worker")
        if not receive.done.wait(timeout_s):
            raise TimeoutError(f"the weight broadcast did not arrive within {timeout_s:.0f}s")
        self._raise_failure(receive)
        return receive.buffer

    @staticmethod
    def _raise_failure(receive: _Receive) -> None:
        if receive.error is not None:
            raise RuntimeError(f"the weight broadcast failed: {receive.error}") from receive.error

    def loaded(self) -> None:
        """The engine loaded the buffer: from now its digest is the engine's weights'."""
        self._holds_loaded = True

    def shares_memory_with(self, tensors: Any) -> bool:
        """Does any of `tensors` live in the buffer's memory?"""
        if self._buffer is None:
            return False
        ours = self._buffer.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ours for t in tensors if t.numel())

    def release(self) -> None:
        """The engine keeps the buffer's memory as its weights: take the digest now and leave
        the buffer to it; the next update receives into a fresh one."""
        self.digest()
        self._buffer = None

    def digest(self) -> tuple[float, float, int]:
        """Sums and count of the weights the engine loaded last (zeros before any update)."""
        if self._digest is not None:
            return self._digest
        if self._receive is None:
            return (0.0, 0.0, 0)
        if not self._holds_loaded:
            raise RuntimeError(
                "weights were received since the last load but not loaded (a broadcast or a load "
                "failed): the engine holds the previous update, which can no longer be summed"
            )
        self._digest = flat_digest(self._receive.buffer)
        return self._digest
