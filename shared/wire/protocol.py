"""The wire protocol: every message that crosses a process boundary.

The roles (envpool, actor, learner) talk only through these structs, so this file is the
documentation of the wire. Each ZeroMQ frame carries one `Packet`: a protocol version and a list
of messages. Packing several messages into one frame is how senders coalesce the small, frequent
messages (token deltas, requests) of one tick into a single send.

Encoding is msgpack through msgspec. Messages form a tagged union (the tag is the class name, kept
short on the wire by `tag=` below), so one decoder reads every frame. Messages are
`array_like=True` (encoded as arrays, not maps: smaller, faster), and the hot ones `gc=False`
(the garbage collector never scans them; they hold no reference cycles). Token ids, logprobs and versions
travel as msgpack arrays of numbers, never as text.

Failure causes (`Cause`, `TurnError`, `DropCause`, `ReplyCause`, `Truncation`) are enums defined
in `shared/wire/causes.py`: they are part of the wire.

A frame that fails to decode raises `ProtocolError`; receivers count it and answer with an
`ErrorReply`, they never crash (see `Codec.decode`).

Channels, and who sends what:

    envpool DEALER  ──GenerateRequest / Abort──▶  actor ROUTER
    envpool DEALER  ◀──TokenDelta / GenerateError──  actor ROUTER
    learner DEALER  ──Hello / AttachLearner / WeightUpdate──▶  actor ROUTER
    learner DEALER  ◀──ActorInfo / WeightsApplied / ErrorReply──  actor ROUTER
    any DEALER      ──DigestWeights──▶  actor ROUTER ──WeightsDigest──▶
    envpool PUSH    ──Trajectory / EpisodeFailed / Resent / WorkerHello / GroupStarted /
                      PoolDone / EvalResult──▶  learner PULL
    actor PUSH      ──ReplicaJoin / ReplicaLeave──▶  learner PULL
    learner PUB     ──PolicyVersion (with the live replicas)──▶  envpool SUB

An actor replica is one engine behind one ROUTER. A run has one or more; the learner keeps the
list of those that hold its current weights and announces it in every `PolicyVersion`, and each
envpool worker routes its episodes among them (envpool/actors/router.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from millstream.shared.wire.control import ErrorReply, PolicyVersion, ReplicaJoin, ReplicaLeave
from millstream.shared.wire.experience import (
    EpisodeFailed,
    EvalResult,
    GroupStarted,
    PoolDone,
    Resent,
    Trajectory,
    WorkerHello,
)
from millstream.shared.wire.generation import (
    Abort,
    ActorInfo,
    GenerateError,
    GenerateRequest,
    Hello,
    TokenDelta,
)
from millstream.shared.wire.weights import (
    AttachLearner,
    DigestWeights,
    WeightsApplied,
    WeightsDigest,
    WeightUpdate,
)

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "Message", "Outgoing", "Packet", "Codec"]

#: Bumped on any incompatible change of a message. A peer with another version is refused with a
#: clear error instead of misreading fields.
PROTOCOL_VERSION = 11


class ProtocolError(ValueError):
    """A frame could not be decoded, or carried another protocol version."""


#: Every message kind; a frame's messages decode to one of these by their tag.
Message = (
    Hello
    | ActorInfo
    | GenerateRequest
    | Abort
    | TokenDelta
    | GenerateError
    | AttachLearner
    | WeightUpdate
    | WeightsApplied
    | Trajectory
    | EpisodeFailed
    | PoolDone
    | WorkerHello
    | GroupStarted
    | Resent
    | EvalResult
    | PolicyVersion
    | ReplicaJoin
    | ReplicaLeave
    | DigestWeights
    | WeightsDigest
    | ErrorReply
)


#: What a channel sends: a message, or one encoded already (`Codec.encode_one`), written into
#: the frame as it is: a result the worker also keeps encoded is encoded once, not twice.
Outgoing = Message | msgspec.Raw


class Packet(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One ZeroMQ frame: the sender's protocol version and the messages of one tick."""

    protocol: int
    messages: list[Message]


class Codec:
    """Encodes and decodes frames; reuses msgspec's encoder and decoder (they keep buffers).

    `decode` turns every failure into `ProtocolError` with a message that says what was wrong,
    and counts it in `errors`, so a receive loop can answer and keep serving.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Packet)
        # Reads only the version, so a peer of another version is named as such even when its
        # messages do not decode under this one's types.
        self._version = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        self._one: msgspec.msgpack.Decoder[Message] | None = None  # made on first use
        self.errors = 0

    def encode(self, messages: Sequence[Outgoing]) -> bytes:
        return self._encoder.encode(Packet(PROTOCOL_VERSION, messages))  # type: ignore[arg-type]

    def encode_one(self, message: Message) -> msgspec.Raw:
        """One message, encoded as it goes into a frame; `encode` writes it as it is."""
        return msgspec.Raw(self._encoder.encode(message))

    def decode_one(self, encoded: msgspec.Raw | bytes) -> Message:
        """What `encode_one` made, back (a frame's own bytes only: no version is checked)."""
        if self._one is None:
            self._one = msgspec.msgpack.Decoder(Message)
        return self._one.decode(encoded)

    def decode(self, frame: bytes | memoryview) -> list[Message]:
        try:
            packet = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors += 1
            raise ProtocolError(
                self._other_version(frame) or f"malformed frame ({len(frame)} bytes): {exc}"
            ) from None
        if packet.protocol != PROTOCOL_VERSION:
            self.errors += 1
            raise ProtocolError(self._mismatch(packet.protocol))
        return packet.messages

    def _other_version(self, frame: bytes | memoryview) -> str | None:
        try:
            version, _ = self._version.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return self._mismatch(version) if version != PROTOCOL_VERSION else None

    @staticmethod
    def _mismatch(version: int) -> str:
        return f"peer speaks protocol {version}, this process speaks {PROTOCOL_VERSION}"
