"""How a weight push lays out the model's weights: one flat buffer's layout, cut into pieces.

    flat = FlatWeights("float32", "gloo", bucket_mb=32)
    flat.lay_out(weights)                       # layout and pieces, made on the first push
    for piece in flat.sources(weights):         # a piece is packed only when its turn comes
        start_broadcast(group, piece, timeout_s)
    flat.digest()                               # what the last push sent, summed

The replicas receive into a flat buffer of the same layout (actor/receive.py); the learner sends
that buffer's contents in consecutive pieces (`WeightUpdate.pieces` gives where each ends), and
copies only what it must: a tensor of 1 MiB or more is a piece of its own, broadcast straight
from the learner's parameter when it already has the wire's dtype and device, and runs of
smaller tensors are packed into the learner's buffer, at most `learner.sync_bucket_mb` a piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from millstream.shared.wire import TensorSpec
from millstream.shared.wire.weightsync import DTYPES, flat_digest, flat_layout

__all__ = ["DIRECT_MIN_BYTES", "FlatWeights", "LayoutChanged"]


class LayoutChanged(RuntimeError):
    """A push's tensors have other names or shapes than the first push's."""


#: A tensor of at least this many bytes is broadcast straight from the learner's memory, a piece
#: of its own; smaller ones are packed together. Packing costs a copy, which on a small CPU box
#: competes with the wire for the same cores (100 MB in 16 tensors on loopback gloo: 53 ms sent
#: tensor by tensor, as one preallocated buffer, 76 ms packed in 32 MiB buckets on the way).
DIRECT_MIN_BYTES = 1 << 20


class FlatWeights:
    """How a push lays out the model's weights: one flat buffer's layout (what the replicas
    receive into), cut into pieces, each one broadcast.

    The layout, the pieces and the buffer are made on the first push (the model's shapes do not
    change; a later push with other names or shapes is an error). A piece is either one large
    tensor, sent from where it lies when it already has the wire's dtype and device, or a run of
    small ones packed into the buffer, at most `bucket_mb` MiB. Packing happens piece by piece
    as the pieces are sent (`sources`), so packing piece k+1 overlaps the wire carrying piece k.
    """

    def __init__(self, dtype: str, backend: str, bucket_mb: float = 32.0) -> None:
        self.dtype = dtype
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // DTYPES[dtype].itemsize)
        self.flat: torch.Tensor | None = None
        self.layout: list[TensorSpec] = []
        #: End offset of each piece, in order (what `WeightUpdate.pieces` carries).
        self.pieces: list[int] = []
        #: What the last push broadcast, piece by piece (parameters or slices of `flat`).
        self._sent: list[torch.Tensor] = []

    def lay_out(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Check `weights` against the layout (made, and the buffer allocated, on the first call)."""
        if self.flat is None:
            layout, numel = flat_layout((name, tuple(t.shape)) for name, t in weights)
            self.layout = [TensorSpec(name, shape, offset) for name, shape, offset in layout]
            self.pieces = self._plan(numel)
            self.flat = torch.empty(numel, dtype=DTYPES[self.dtype], device=self.device)
        if [(n, list(t.shape)) for n, t in weights] != [(s.name, s.shape) for s in self.layout]:
            raise LayoutChanged("the model's tensors changed between pushes")

    def _plan(self, numel: int) -> list[int]:
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
        if numel > run_start:
            ends.append(numel)
        return ends

    def sources(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
        """The tensor to broadcast for each piece, in order; a packed piece is packed only when
        its turn comes."""
        assert self.flat is not None, "lay_out first"
        wire_dtype = DTYPES[self.dtype]
        self._sent = []
        first = 0  # index of the first tensor of the next piece
        for start, end in zip([0, *self.pieces[:-1]], self.pieces):
            last = first
            while last < len(self.layout) and self.layout[last].offset < end:
                last += 1
            tensors = [t for _, t in weights[first:last]]
            lone = tensors[0] if len(tensors) == 1 else None
            if (
                lone is not None
                and lone.dtype == wire_dtype
                and lone.device.type == self.flat.device.type
                and lone.is_contiguous()
            ):
                piece = lone.detach().view(-1)
            else:
                for tensor, spec in zip(tensors, self.layout[first:last]):
                    self.flat[spec.offset : spec.offset + tensor.numel()].copy_(tensor.reshape(-1))
                piece = self.flat[start:end]
            self._sent.append(piece)
            first = last
            yield piece

    def digest(self) -> tuple[float, float, int] | None:
        """The digest (`flat_digest`) of what the last push sent, None before the first. Taken
        from the learner's own tensors: it is the last push's only while they have not changed
        since (so at the end of a run, whose last step pushed)."""
        if not self._sent:
            return None
        parts = [flat_digest(piece.detach()) for piece in self._sent]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel() * self.flat.element_size()
