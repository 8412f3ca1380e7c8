"""How a weight push lays out the model's weights: one flat buffer's layout, cut into pieces.

    flat = FlatWeights("float32", "gloo", bucket_mb=32)
    flat.lay_out(weights)                       # layout and piece ends, made on the first push
    for piece in flat.sources(weights):         # a piece is packed only when its turn comes
        start_broadcast(group, piece, timeout_s)
    flat.digest()                               # what the last push sent, summed

The replicas receive into a flat buffer of the same layout (actor/receive.py); the learner sends
that buffer's contents in consecutive pieces (`WeightUpdate.piece_ends` gives where each ends),
and copies only what it must: a tensor of 1 MiB or more is a piece of its own, broadcast straight
from the learner's parameter when it already has the wire's dtype and device, and runs of
smaller tensors are packed, a piece closing once it reaches `learner.sync_bucket_mb`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from millstream.shared.wire import TensorSpec
from millstream.shared.wire.weightsync import DTYPES, flat_digest, flat_layout, piece_ranges

__all__ = ["DIRECT_MIN_BYTES", "FlatWeights", "LayoutChanged"]


class LayoutChanged(RuntimeError):
    """A push's tensors have other names or shapes than the first push's."""


#: A tensor of at least this many bytes is broadcast straight from the learner's memory, a piece
#: of its own; smaller ones are packed together. Packing costs a copy, which on a small CPU box
#: competes with the wire for the same cores (100 MB in 16 tensors on loopback gloo: 53 ms sent
#: tensor by tensor, 53 ms as one preallocated buffer, 76 ms packed in 32 MiB pieces on the way).
DIRECT_MIN_BYTES = 1 << 20


class FlatWeights:
    """How a push lays out the model's weights: one flat buffer's layout (what the replicas
    receive into), cut into pieces, each one broadcast.

    The layout and the pieces are made on the first push (the model's shapes do not change; a
    later push with other names or shapes is an error). A piece is either one large tensor, sent
    from where it lies when it already has the wire's dtype and device and is contiguous, or a
    run of small ones packed into a staging buffer, closed once it reaches `bucket_mb` MiB (so
    a packed piece is at most that plus one small tensor). Packing happens piece by piece as the
    pieces are sent (`sources`), so packing piece k+1 overlaps the wire carrying piece k. The
    staging buffer holds only what is packed (the small tensors, or everything when the
    learner's tensors are of another dtype or device than the wire's).
    """

    def __init__(self, dtype: str, backend: str, bucket_mb: float = 32.0) -> None:
        self.dtype = dtype
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // DTYPES[dtype].itemsize)
        self.numel = 0
        self.layout: list[TensorSpec] = []
        #: End offset of each piece, in order (what `WeightUpdate.piece_ends` carries).
        self.piece_ends: list[int] = []
        #: The version the last complete push sent (None before one, or after a failed one).
        self.sent_version: int | None = None
        self._staging: torch.Tensor | None = None
        #: What the last push broadcast, piece by piece (parameters or slices of `_staging`).
        self._sent: list[torch.Tensor] = []

    def over(self, backend: str) -> FlatWeights:
        """The same settings for a group on `backend`: itself when the wire's device is the
        same, else a new layout (made again on its first push)."""
        if ("cuda" if backend == "nccl" else "cpu") == self.device:
            return self
        other = FlatWeights(self.dtype, backend)
        other.bucket_numel = self.bucket_numel
        return other

    def lay_out(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Check `weights` against the layout (made on the first call)."""
        if not self.layout:
            layout, self.numel = flat_layout((name, tuple(t.shape)) for name, t in weights)
            self.layout = [TensorSpec(name, shape, offset) for name, shape, offset in layout]
            self.piece_ends = self._plan()
        if [(n, list(t.shape)) for n, t in weights] != [(s.name, s.shape) for s in self.layout]:
            raise LayoutChanged("the model's tensors changed between pushes")

    def _plan(self) -> list[int]:
        direct_min = DIRECT_MIN_BYTES // DTYPES[self.dtype].itemsize
        ends: list[int] = []
        run_start = 0  # where the current run of small tensors began
        for spec in self.layout:
            end = spec.offset + math.prod(spec.shape)
            if end - spec.offset >= direct_min:
                if spec.offset > run_start:
                    ends.append(spec.offset)  # the run before it ends here
                ends.append(end)
                run_start = end
            elif end - run_start >= self.bucket_numel:
                ends.append(end)
                run_start = end
        if self.numel > run_start:
            ends.append(self.numel)
        return ends

    def _pieces(self) -> list[tuple[int, int, int, int]]:
        """(start, end, first tensor, last tensor + 1) of every piece."""
        out, first = [], 0
        for start, end in piece_ranges(self.numel, self.piece_ends):
            last = first
            while last < len(self.layout) and self.layout[last].offset < end:
                last += 1
            out.append((start, end, first, last))
            first = last
        return out

    def _direct(self, weights: list[tuple[str, torch.Tensor]], first: int, last: int) -> torch.Tensor | None:
        """The piece's lone tensor when it can go on the wire as it is, else None."""
        if last - first != 1:
            return None
        tensor = weights[first][1]
        same = tensor.dtype == DTYPES[self.dtype] and tensor.device.type == torch.device(self.device).type
        return tensor.detach().view(-1) if same and tensor.is_contiguous() else None

    def forget_sent(self) -> None:
        """Let go of the last push's tensors (copies, where the trainer made them) before the
        next push's are made."""
        self._sent, self.sent_version = [], None

    def sources(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
        """The tensor to broadcast for each piece, in order; a packed piece is packed only when
        its turn comes."""
        pieces = self._pieces()
        direct = [self._direct(weights, first, last) for _, _, first, last in pieces]
        packed = sum(end - start for (start, end, _, _), d in zip(pieces, direct) if d is None)
        if self._staging is None or self._staging.numel() < packed:
            self._staging = None  # the old one goes before the new one is allocated
            self._staging = torch.empty(packed, dtype=DTYPES[self.dtype], device=self.device)
        self.forget_sent()
        at = 0  # where the next packed piece goes in the staging buffer
        for (start, end, first, last), piece in zip(pieces, direct):
            if piece is None:
                for (_, tensor), spec in zip(weights[first:last], self.layout[first:last]):
                    offset = at + spec.offset - start
                    self._staging[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
                piece, at = self._staging[at : at + end - start], at + end - start
            self._sent.append(piece)
            yield piece

    def digest(self) -> tuple[float, float, int] | None:
        """The digest (`flat_digest`) of what the last complete push sent, None when there is
        none. Taken from the learner's own tensors: it is the last push's only while they have
        not changed since (the caller checks `sent_version` against its own version)."""
        if self.sent_version is None:
            return None
        parts = [flat_digest(piece.detach()) for piece in self._sent]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize
