"""The wire protocol: every message round-trips; bad frames are rejected, counted, answered."""

import enum
import typing

import msgspec
import pytest
import zmq
from helpers import keys_for
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.shared import wire
from millstream.shared.wire import (
    PROTOCOL_VERSION,
    Codec,
    ErrorReply,
    GenerateRequest,
    Packet,
    ProtocolError,
    ReplyCause,
    TokenDelta,
)
from millstream.shared.wire.keys import secure

MESSAGES = list(typing.get_args(wire.Message))
i32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(allow_nan=False, width=64)


def strategy_for(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # msgspec.Meta bounds: generate within them
        base, *metas = typing.get_args(tp)
        meta = next((m for m in metas if isinstance(m, msgspec.Meta)), None)
        if base is int and meta is not None:
            low = meta.ge if meta.ge is not None else -(2**31)
            return st.integers(low, min(meta.le if meta.le is not None else 2**31 - 1, 2**31 - 1))
        return strategy_for(base)
    if tp is int:
        return i32
    if tp is float:
        return floats
    if tp is str:
        return st.text(max_size=20)
    if tp is bool:
        return st.booleans()
    if origin is list:
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=8)
    if origin is tuple:
        return st.tuples(*(strategy_for(a) for a in typing.get_args(tp)))
    if origin is dict:
        key, value = typing.get_args(tp)
        return st.dictionaries(strategy_for(key), strategy_for(value), max_size=4)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of([strategy_for(a) if a is not type(None) else st.none() for a in typing.get_args(tp)])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    raise TypeError(tp)


def struct_strategy(cls):
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f: strategy_for(hints[f]) for f in cls.__struct_fields__})


any_message = st.one_of([struct_strategy(cls) for cls in MESSAGES])


def test_a_peer_of_another_version_is_named_even_when_its_messages_do_not_decode():
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, [["a_message_of_the_future", 1]]])
    with pytest.raises(
        ProtocolError,
        match=f"peer speaks protocol {PROTOCOL_VERSION + 1}, this process speaks {PROTOCOL_VERSION}",
    ):
        Codec().decode(frame)


def test_an_unknown_cause_is_a_protocol_error_not_a_string():
    codec = Codec()
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, [["failed", "e", "g0", 8, "flaked_out", "x"]]])
    with pytest.raises(ProtocolError, match="Invalid enum value 'flaked_out'"):
        codec.decode(frame)
    good = msgspec.msgpack.encode([PROTOCOL_VERSION, [["failed", "e", "g0", 8, "env_timeout", "x"]]])
    (failed,) = codec.decode(good)
    assert failed.cause is wire.Cause.ENV_TIMEOUT


def test_every_message_kind_is_covered():
    names = {cls.__name__ for cls in MESSAGES}
    assert {"GenerateRequest", "TokenDelta", "Trajectory", "WeightUpdate", "PolicyVersion"} <= names


@settings(max_examples=300, deadline=None)
@given(st.lists(any_message, min_size=1, max_size=6))
def test_frames_round_trip(messages):
    codec = Codec()
    assert codec.decode(codec.encode(messages)) == messages
    assert codec.errors == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(any_message, st.booleans()), min_size=1, max_size=6))
def test_messages_encoded_once_travel_in_a_frame_as_themselves(messages_and_whether_encoded):
    """A result the worker keeps encoded is sent in that encoding (envpool/redelivery.py):
    a frame mixing such messages and plain ones decodes to the same messages, in order."""
    codec = Codec()
    outgoing = [codec.encode_one(m) if encoded else m for m, encoded in messages_and_whether_encoded]
    assert all(codec.decode_one(codec.encode_one(m)) == m for m, _ in messages_and_whether_encoded)
    assert codec.decode(codec.encode(outgoing)) == [m for m, _ in messages_and_whether_encoded]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_rejected_or_valid(data):
    codec = Codec()
    try:
        messages = codec.decode(data)
    except ProtocolError as exc:
        assert codec.errors == 1
        assert "malformed" in str(exc) or "protocol" in str(exc)
    else:  # random bytes that happen to be a valid packet must really be one
        assert codec.encode(messages) is not None and codec.errors == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(any_message, min_size=1, max_size=4), st.data())
def test_truncated_frames_are_rejected(messages, data):
    codec = Codec()
    frame = codec.encode(messages)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ProtocolError):
        codec.decode(frame[:cut])
    assert codec.errors == 1


def test_other_protocol_version_is_refused():
    frame = msgspec.msgpack.encode(
        Packet(PROTOCOL_VERSION + 1, [ErrorReply(ReplyCause.MALFORMED_FRAME, "y")])
    )
    codec = Codec()
    with pytest.raises(ProtocolError, match=f"peer speaks protocol {PROTOCOL_VERSION + 1}"):
        codec.decode(frame)
    assert codec.errors == 1


def test_token_ids_travel_as_arrays_not_text():
    frame = Codec().encode([TokenDelta("r", [1, 2, 3], [-0.5, -0.25, -1.0], 4, None)])
    raw = msgspec.msgpack.decode(frame)
    assert raw[1][0][0] == "delta" and raw[1][0][2] == [1, 2, 3]


def test_actor_answers_garbage_and_keeps_serving(actor):
    """The real actor process: malformed frames get an ErrorReply; a valid request still works."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure(sock, keys_for("envpool"), bind=False)
    sock.connect(actor.address)
    codec = Codec()
    valid = codec.encode([GenerateRequest("after-garbage", [5, 6, 7], 3, 0.0)])
    for garbage in (b"", b"\xc1", b"\x93\x01\x02", valid[: len(valid) // 2], b"\x00" * 64):
        sock.send(garbage)
        assert sock.poll(30_000), "no answer to a malformed frame"
        (reply,) = codec.decode(sock.recv())
        assert isinstance(reply, ErrorReply) and reply.cause == "malformed_frame"
    sock.send_multipart([valid, valid])  # two payload frames: also malformed
    assert sock.poll(30_000)
    assert codec.decode(sock.recv())[0].cause == "malformed_frame"
    sock.send(valid)
    tokens, finish = [], None
    while finish is None:
        assert sock.poll(60_000), "the actor stopped serving after garbage"
        for reply in codec.decode(sock.recv()):
            assert isinstance(reply, TokenDelta), reply
            tokens += reply.token_ids
            finish = reply.finish_reason
    assert 1 <= len(tokens) <= 3
    sock.close()


def test_ids_longer_than_the_bound_do_not_decode():
    """An id a peer makes as large as it likes would be remembered (the learner keeps every
    episode id of the run): 2,000 refused episodes with 100 kB ids grew a learner by 369 MB.
    Over MAX_ID_CHARS, the frame is malformed and nothing of it is kept."""
    from millstream.shared.wire import Codec, GenerateRequest, ProtocolError
    from millstream.shared.wire.base import MAX_ID_CHARS

    codec = Codec()
    ok = GenerateRequest("r" * MAX_ID_CHARS, [1, 2], 4)
    assert codec.decode(codec.encode([ok])) == [ok]
    with pytest.raises(ProtocolError, match="length <= 256"):
        codec.decode(codec.encode([GenerateRequest("r" * 100_000, [1, 2], 4)]))
