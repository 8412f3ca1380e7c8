"""Where an actor's weights land: one buffer, kept between updates, filled while the engine runs.

    receiver = WeightReceiver()
    receiver.start(group, "float32", numel, pieces, "cpu", timeout_s)  # returns at once
    ... the engine keeps generating; receiver.done() says when the last piece is in ...
    flat = receiver.wait(timeout_s)          # the whole buffer, or the receive's error
    ... pause the engine, load views of `flat`, resume ...
    receiver.loaded()                        # the buffer now holds the engine's weights
    receiver.digest()                        # their sums, computed when first asked

Why a thread: the broadcast is a wait on sockets (gloo) or on a CUDA stream (NCCL), and the
engine's own loop must go on stepping meanwhile, so the receive runs beside it and the engine
pauses only to load what arrived. In a vLLM worker, `collective_rpc` calls run on the worker's
model thread: a receive there would stop generation for the whole transfer.

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

Nothing here imports the actor server: vLLM's worker processes import this module alone.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from millstream.shared.wire.weightsync import DTYPES, broadcast_pieces, flat_digest

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """One reusable receive buffer, filled by a background thread (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        #: True once the buffer holds exactly what the engine loaded last.
        self._holds_loaded = False
        self._digest: tuple[float, float, int] | None = None

    def start(
        self, group: Any, dtype: str, numel: int, pieces: list[int], device: Any, timeout_s: float
    ) -> None:
        """Begin receiving the next update's broadcast; returns at once."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a weight receive is already running on this worker")
        buffer = self._buffer_for(DTYPES[dtype], numel, device)
        self._holds_loaded, self._digest, self._error = False, None, None
        self._done.clear()
        self._thread = threading.Thread(
            target=self._receive,
            args=(group, buffer, pieces, timeout_s),
            name="millstream-weight-receive",
            daemon=True,  # bounded by timeout_s; never keeps a stopping process alive
        )
        self._thread.start()

    def _buffer_for(self, dtype: torch.dtype, numel: int, device: Any) -> torch.Tensor:
        current = self._buffer
        fits = current is not None and current.numel() == numel and current.dtype == dtype
        if current is not None and fits and current.device == torch.device(device):
            return current
        self._buffer = current = None  # the old one goes before the new one is allocated
        self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return self._buffer

    def _receive(self, group: Any, buffer: torch.Tensor, pieces: list[int], timeout_s: float) -> None:
        try:
            broadcast_pieces(group, buffer, pieces, timeout_s)
            if buffer.is_cuda:  # the data is in once the stream has run, not when it was queued
                torch.cuda.current_stream(buffer.device).synchronize()
        except BaseException as exc:  # handed to whoever waits (`done`, `wait`)
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """Without blocking: is the last piece in? Raises the receive's error if it failed."""
        if not self._done.is_set():
            return False
        self._raise_failure()
        return True

    def wait(self, timeout_s: float) -> torch.Tensor:
        """The received buffer, once complete (at most `timeout_s`); raises the receive's error."""
        if self._thread is None:
            raise RuntimeError("no weight receive was started on this worker")
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the weight broadcast did not arrive within {timeout_s:.0f}s")
        self._raise_failure()
        assert self._buffer is not None
        return self._buffer

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the weight broadcast failed: {self._error}") from self._error

    def loaded(self) -> None:
        """The engine loaded the buffer: from now its digest is the engine's weights'."""
        self._holds_loaded = True

    def shares_memory_with(self, tensors: Any) -> bool:
        """Does any of `tensors` live in the buffer's memory? (An engine that kept views of the
        buffer as its weights would see the next receive overwrite them while it generates.)"""
        if self._buffer is None:
            return False
        ours = self._buffer.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ours for t in tensors if t.numel())

    def digest(self) -> tuple[float, float, int]:
        """Sums and count of the weights the engine loaded last (zeros before any update)."""
        if self._buffer is None:
            return (0.0, 0.0, 0)
        if not self._holds_loaded:
            raise RuntimeError(
                "weights were received since the last load but not loaded (a broadcast failed "
                "part-way): the engine holds the previous update, which can no longer be summed"
            )
        if self._digest is None:
            self._digest = flat_digest(self._buffer)
        return self._digest
