"""gRPC's message framing and request headers (sidecar/openengine/transport/grpc_framing.py), in
memory: messages out of DATA payloads however they are cut, the length prefix checked before
a byte is kept, reassembly linear in a message's size, and the request's metadata and timeout
encoded as gRPC's PROTOCOL-HTTP2 says."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.openengine.transport.grpc_framing import (
    CallError,
    MessageReader,
    RequestHead,
    TooLarge,
    encode_metadata,
    encode_timeout,
)


def framed(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


@given(
    messages=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_messages_come_out_whole_however_the_bytes_are_cut(messages: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(framed(m) for m in messages)
    points = sorted({c % (len(wire) + 1) for c in cuts})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    reader = MessageReader(limit=1_000)
    out = [m for piece in pieces for m in reader.feed(piece)]
    assert out == messages and reader.pending == 0


def test_a_message_in_many_frames_is_joined_once() -> None:
    """A message arriving in pieces is held as those pieces and joined once when complete (not
    rebuilt per piece: a 4 MiB message in 16 KiB frames once copied ~0.5 GB)."""
    size, piece = 4 * 1024 * 1024, 16 * 1024
    wire = framed(b"m" * size)
    reader = MessageReader(limit=size)
    for n, start in enumerate(range(0, len(wire) - piece, piece), 1):
        assert reader.feed(wire[start : start + piece]) == []
        assert len(reader._chunks) == n and reader.pending == n * piece  # held, not rebuilt
    rest = wire[(len(wire) - 1) // piece * piece :]
    assert reader.feed(rest) == [b"m" * size] and reader.pending == 0


def test_reassembly_time_is_linear_in_the_message_size() -> None:
    """32 MiB in 16 KiB pieces: a few copies of the message, tens of milliseconds of CPU (rebuilding
    the buffer per piece copied ~32 GB: seconds)."""
    size, piece = 32 * 1024 * 1024, 16 * 1024
    wire = framed(bytes(size))
    pieces = [wire[i : i + piece] for i in range(0, len(wire), piece)]
    reader = MessageReader(limit=size)
    start = time.process_time()
    out = [m for p in pieces for m in reader.feed(p)]
    assert time.process_time() - start < 0.3
    assert len(out) == 1 and len(out[0]) == size


def test_the_prefix_is_checked_before_the_message_is_kept() -> None:
    reader = MessageReader(limit=100)
    with pytest.raises(TooLarge) as caught:
        reader.feed(b"\x00" + (101).to_bytes(4, "big"))  # the prefix alone: nothing else arrived
    assert (caught.value.size, caught.value.limit) == (101, 100)
    split = MessageReader(limit=100)
    assert split.feed(b"\x00\x00") == []
    with pytest.raises(TooLarge):
        split.feed(b"\x00\x01\x00")  # the rest of a prefix announcing 256 bytes
    with pytest.raises(CallError, match="compressed"):
        MessageReader(limit=100).feed(b"\x01\x00\x00\x00\x01x")


@pytest.mark.parametrize(
    ("seconds", "wire"),
    [(0.0, b"0n"), (0.000_001_5, b"1500n"), (0.5, b"500000u"), (30.0, b"30000000u"), (2e6, b"2000000S")],
)
def test_grpc_timeout_is_at_most_eight_digits_and_a_unit(seconds: float, wire: bytes) -> None:
    """The finest unit whose value fits gRPC's eight digits."""
    assert encode_timeout(seconds) == wire
    assert len(wire) <= 9


def test_metadata_keys_and_values_are_checked() -> None:
    assert encode_metadata([("openengine-routing-key", "k 1"), ("x-id-bin", "é")]) == [
        (b"openengine-routing-key", b"k 1"),
        (b"x-id-bin", b"w6k"),  # the UTF-8 bytes, base64 without padding
    ]
    for key in ("grpc-status", "te", "content-type", "Upper", ":path", "sp ace"):
        with pytest.raises(ValueError, match="key"):
            encode_metadata([(key, "v")])
    with pytest.raises(ValueError, match="value"):
        encode_metadata([("k", "line\nbreak")])


def test_request_headers_are_built_once_per_route() -> None:
    head = RequestHead("engine:50051", "/openengine.v1.Inference/Generate")
    plain = head.headers(None, None)
    assert plain is head.headers(None, None)  # the fixed list, not a copy per call
    assert dict(plain)[b":path"] == b"/openengine.v1.Inference/Generate"
    assert dict(plain)[b"te"] == b"trailers"
    timed = dict(head.headers(1.5, [("k", "v")]))
    assert timed[b"grpc-timeout"] == b"1500000u" and timed[b"k"] == b"v"
