"""Property-based tests of the north decoder (``sidecar.north.codec.decode_frame``).

Whatever a client sends in one WebSocket message, the decoder answers with a command, a
``FrameDecodeError`` (the server closes with 1007) or a ``ProtocolError`` whose reply
(``error_reply``) encodes in both encodings and names a valid stream / call id when it names
one. Nothing else may escape: an unexpected exception would end the connection's task.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sidecar.core.handoff import splice_kv_session
from sidecar.north import codec, wire
from sidecar.north.codec import Encoding
from sidecar.openengine import pb
from tests.fuzz import strategies as S

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Examples that build whole GenerateRequests cost ~10 ms each: fewer of them.
SLOWER = settings(FAST, max_examples=120)
_id_decoder = msgspec.json.Decoder(wire.Id)  # type: ignore[arg-type]


def _valid_id(value: Any) -> bool:
    try:
        msgspec.convert(value, wire.Id)  # type: ignore[arg-type]
    except msgspec.ValidationError:
        return False
    return True


def decode(frame: str | bytes) -> codec.Command | codec.ProtocolError | codec.FrameDecodeError:
    """``decode_frame``, with its two typed errors returned instead of raised."""
    try:
        return codec.decode_frame(frame)
    except (codec.ProtocolError, codec.FrameDecodeError) as err:
        return err


def check(frame: str | bytes) -> codec.Command | codec.ProtocolError | codec.FrameDecodeError:
    result = decode(frame)  # anything but the two typed errors fails the test here
    enc = Encoding.JSON if isinstance(frame, str) else Encoding.MSGPACK
    if isinstance(result, codec.ProtocolError):
        # whatever the frame carried, the answer is short and has no control characters
        assert len(result.message) <= codec.MAX_ERROR_MESSAGE + 16 and result.message.isprintable()
        reply = codec.error_reply(result)
        encoded = codec.encode(reply, enc)
        back = codec.decode_server_frame(encoded)
        assert type(back) is type(reply)
        if result.stream is not None:
            assert _valid_id(result.stream) and isinstance(reply, wire.End) and reply.outcome == "rejected"
        elif result.call is not None:
            assert _valid_id(result.call) and isinstance(reply, wire.Result) and not reply.ok
        else:
            assert isinstance(reply, wire.ProtocolErrorMessage)
    elif isinstance(result, codec.GenerateCommand):
        assert _valid_id(result.stream) and result.encoding is enc
        assert isinstance(result.request, pb.GenerateRequest)
        bytes(
            splice_kv_session(result.request, result.kv_session_bytes)
        )  # what goes to the engine serializes
    elif isinstance(result, codec.CancelCommand):
        assert _valid_id(result.stream)
    elif isinstance(result, codec.CallCommand):
        assert _valid_id(result.call) and result.method in wire.CALL_METHODS
    return result


@SLOWER
@given(S.frames)
def test_any_frame_decodes_to_a_command_or_a_typed_error(frame: str | bytes) -> None:
    check(frame)


@FAST
@given(st.one_of(st.text(), st.binary()))
@example("\ud800")
@example('{"type":"cancel","stream":"\\ud800"}')
@example(b"\xff\xfe")
@example("1" * 5000)
@example('{"type":"generate","stream":1,"request":{"stopping":{"maxTokens":1' + "0" * 400 + "}}}")
def test_arbitrary_text_and_bytes(frame: str | bytes) -> None:
    check(frame)


@SLOWER
@given(S.client_messages)
def test_json_and_msgpack_agree(message: Any) -> None:
    """The same message decodes the same way from a text (JSON) and a binary (msgpack) frame."""
    try:
        text = json.dumps(message, allow_nan=False)
        binary = msgspec.msgpack.encode(message)
    except (ValueError, OverflowError, UnicodeEncodeError):
        return  # not representable in both encodings
    a, b = check(text), check(binary)
    assert type(a) is type(b), (a, b)
    if isinstance(a, codec.ProtocolError):
        assert isinstance(b, codec.ProtocolError)
        assert (a.stream, a.call, a.code) == (b.stream, b.call, b.code)
    elif isinstance(a, codec.GenerateCommand):
        assert isinstance(b, codec.GenerateCommand)
        assert bytes(a.request) == bytes(b.request) and a.metadata == b.metadata


@SLOWER
@given(S.generate_messages(valid_request=True), S.valid_ids)
def test_generate_with_a_valid_id_is_never_left_unanswered(message: dict[str, Any], stream: Any) -> None:
    """A ``generate`` whose ``stream`` is valid decodes, or fails attributed to that stream (the
    server then sends ``end rejected`` for it), whatever else is wrong with it."""
    message = {**message, "type": "generate", "stream": stream}
    message.setdefault("request", {})
    try:
        json.dumps(message, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return  # a lone surrogate is not UTF-8: 1007, tested above
    result = check(json.dumps(message))
    if isinstance(result, codec.ProtocolError):
        assert result.stream == stream, result
    else:
        assert isinstance(result, codec.GenerateCommand) and result.stream == stream


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (-1, "stopping.maxTokens"),
        (2**32, "stopping.maxTokens"),
        ("-5", "stopping.minTokens"),
        (1.5, "sampling.topK"),
        (2**64, "sampling.seed"),
        ("18446744073709551616", "sampling.seed"),
        (0, "sampling.temperature"),  # fine
        ("1e999", "sampling.temperature"),
        (True, "sampling.numSequences"),
        ("NaN", "sampling.topK"),
    ],
)
def test_numbers_out_of_range_or_negative_counts(value: Any, path: str) -> None:
    outer, inner = path.split(".")
    frame = json.dumps({"type": "generate", "stream": 7, "request": {"prompt": "x", outer: {inner: value}}})
    result = check(frame)
    if path == "sampling.temperature" and value == 0:
        assert isinstance(result, codec.GenerateCommand)
    else:
        assert isinstance(result, codec.ProtocolError) and result.stream == 7, result


@pytest.mark.parametrize("levels", [31, 32, 33, 100, 1000, 100_000])
def test_deep_nesting(levels: int) -> None:
    """Nesting inside ``request`` is limited (32 levels: ``end rejected``); nesting that the
    JSON / msgpack decoder itself refuses is a ``protocol_error`` (the connection goes on).
    Never a crash, never a close."""
    for frame in (
        json.dumps({"type": "generate", "stream": 1, "request": {"extra": S.deep(levels, kind="dict")}})
        if levels < 500
        else '{"type":"generate","stream":1,"request":{"extra":'
        + '{"a":' * levels
        + "1"
        + "}" * levels
        + "}}",
        "[" * levels + "]" * levels,
        b"\x91" * levels + b"\x01",
        b"\x81\xa1a" * levels + b"\x01",
    ):
        result = check(frame)
        assert not isinstance(result, codec.GenerateCommand) or levels <= 32, (levels, frame[:40])
        assert not isinstance(result, codec.FrameDecodeError), (levels, frame[:40])


_INT_FIELDS = [
    ("stopping", "maxTokens"),
    ("stopping", "minTokens"),
    ("sampling", "seed"),
    ("sampling", "topK"),
    ("response", "outputCandidates"),
]


@FAST
@given(
    st.integers(min_value=1, max_value=20_000),
    st.sampled_from(_INT_FIELDS),
    st.booleans(),
    st.sampled_from(["json", "msgpack"]),
)
@example(4_301, ("sampling", "seed"), False, "json")
@example(21, ("stopping", "maxTokens"), True, "msgpack")
def test_integer_strings_of_any_length(digits: int, where: tuple[str, str], negative: bool, enc: str) -> None:
    """An integer as a decimal string of any length: a command (at most 20 digits, in range)
    or an ``end rejected`` for its stream — never Python's int-conversion ValueError."""
    outer, inner = where
    value = ("-" if negative else "") + "7" * digits
    if inner == "outputCandidates":
        field: Any = {"topN": value}
    else:
        field = value
    message = {"type": "generate", "stream": 3, "request": {"prompt": "x", outer: {inner: field}}}
    result = check(json.dumps(message) if enc == "json" else msgspec.msgpack.encode(message))
    if digits > 20:
        assert isinstance(result, codec.ProtocolError) and result.stream == 3, result


@FAST
@given(
    st.sampled_from(["type", "method", "model", "loraName", "requestId", "field", "enum"]),
    st.integers(min_value=1, max_value=2_000_000),
    st.sampled_from(["x", "\n", "\x1b[2J", "é"]),
)
def test_echoed_strings_of_any_size_are_cut(where: str, size: int, unit: str) -> None:
    """Strings a client controls, of any size and content, come back (if at all) cut to a
    bounded, escaped error message (``check`` asserts the bound)."""
    text = unit * (size // len(unit) or 1)
    request: dict[str, Any] = {"prompt": "x"}
    message: dict[str, Any] = {"type": "generate", "stream": 1, "request": request}
    if where == "type":
        message["type"] = text
    elif where == "method":
        message = {"type": "call", "call": 1, "method": text}
    elif where == "field":
        request[text] = 1
    elif where == "enum":
        request["media"] = [{"modality": text}]
    else:
        request[where] = text
    check(json.dumps(message))


def test_unknown_fields_and_types_are_refused() -> None:
    for frame, stream in (
        ('{"type":"generate","stream":1,"request":{"prompt":"x"},"bogus":1}', 1),
        ('{"type":"generate","stream":2,"request":{"prompt":"x","bogus":1}}', 2),
        (
            '{"type":"generate","stream":3,"request":{"prompt":"x","tokenIds":{"ids":[1]}}}',
            3,
        ),  # two of a oneof
        (
            '{"type":"generate","stream":4,"request":{"prompt":"x","media":[{"modality":"MODALITY_SMELL"}]}}',
            4,
        ),
        ('{"type":"cancel","stream":5,"bogus":true}', None),
        ('{"type":"shout","stream":1}', None),
        ('{"type":null}', None),
        ("[]", None),
        ("null", None),
        ('"generate"', None),
    ):
        result = check(frame)
        assert isinstance(result, codec.ProtocolError), frame
        assert result.stream == stream, frame


def test_ids_at_their_limits() -> None:
    ok = [0, wire.MAX_ID_INT, "x", "y" * wire.MAX_ID_LENGTH]
    bad = [-1, wire.MAX_ID_INT + 1, "", "y" * (wire.MAX_ID_LENGTH + 1), 1.0, None, True, [1]]
    for stream in ok:
        assert isinstance(check(json.dumps({"type": "cancel", "stream": stream})), codec.CancelCommand)
    for stream in bad:
        result = check(json.dumps({"type": "generate", "stream": stream, "request": {}}))
        assert isinstance(result, codec.ProtocolError) and result.stream is None, stream
