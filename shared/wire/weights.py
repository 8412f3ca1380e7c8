"""Weight synchronisation, learner -> actor: attach, push, applied, and a digest to compare.

    learner DEALER  --AttachLearner / WeightUpdate-->  actor ROUTER  --WeightsApplied-->
    any DEALER      --DigestWeights-->  actor ROUTER  --WeightsDigest-->

The weights themselves go over the broadcast group (shared/wire/weightsync.py), not ZeroMQ.
"""

from __future__ import annotations

import msgspec

from millstream.shared.wire.base import Id, WireMessage

__all__ = ["AttachLearner", "TensorSpec", "WeightUpdate", "WeightsApplied", "DigestWeights", "WeightsDigest"]


class AttachLearner(WireMessage, tag="attach", frozen=True):
    """Join the learner's weight-broadcast group (a fresh one per learner session).

    The learner is rank 0 and hosts the TCPStore at `host:port`; this replica's workers take
    ranks `first_rank .. first_rank + weight_ranks - 1` (every replica of the run is in the one
    group, each at its own offset). Attaching again with a new `session` replaces the previous
    group, so a restarted learner, or a fleet that gained or lost a replica, forms a new one.
    """

    session: str
    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    first_rank: int = 1


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One named tensor's place in the flat broadcast buffer (elements, not bytes)."""

    name: Id
    shape: list[int]
    offset: int


class WeightUpdate(WireMessage, tag="weights", frozen=True):
    """Weights of `version` follow by broadcast: a flat `dtype` buffer of `numel` elements, sent
    as consecutive pieces that end at the offsets `piece_ends` (empty: one broadcast of it all).

    The actor's workers receive the broadcast into a buffer they keep while generation goes on;
    then the actor pauses generation (requests keep their state), loads the weights, resumes,
    and answers `WeightsApplied`.
    """

    session: str
    version: int
    dtype: str
    numel: int
    tensors: list[TensorSpec]
    piece_ends: list[int] = msgspec.field(default_factory=list)


class WeightsApplied(WireMessage, tag="weights_applied", frozen=True):
    """The actor now generates with `version`."""

    version: int
    #: Time generation was paused for the update (the load, not the receive), seconds.
    paused_s: float
    #: Tokens this replica generated since it started (the learner reports each one's share).
    tokens: int = 0
    #: Time from the update's arrival to the last byte received, generation running, seconds.
    receive_s: float = 0.0


class DigestWeights(WireMessage, tag="digest", frozen=True):
    """Asks the actor for a digest of the weights its engine loaded last; answered by
    `WeightsDigest`."""


class WeightsDigest(WireMessage, tag="weights_digest", frozen=True):
    """Sum and sum of magnitudes (float64) and count of the flat buffer every worker of the
    replica loaded at its last update, taken once vLLM's reload returned (each TP worker loads
    the whole buffer and keeps its shard). Equal to the learner's digest of what it sent: the
    replica loaded exactly the learner's weights of `version`.

    Why not read the weights back: vLLM's CPU backend repacks linear layers into its own
    kernels' layout (their tensors are no longer the model's parameters), and padded or sharded
    tensors would not sum to the learner's anyway."""

    version: int
    total: float
    abs_total: float
    numel: int
