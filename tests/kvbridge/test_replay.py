"""Replay buffer and frame layouts; endpoint helpers."""

from __future__ import annotations

import pytest

from sidecar.kvbridge.errors import KvConfigError, KvDecodeError
from sidecar.kvbridge.replay import END_SEQ, ReplayBuffer, parse_replay_request, parse_upstream_reply
from sidecar.kvbridge.zmqio import advertised, rank_endpoint


def sb(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_buffer_keeps_the_last_steps() -> None:
    buf = ReplayBuffer(3)
    assert buf.get(0) is None and buf.oldest is None
    for i in range(5):
        buf.append(i, b"%d" % i)
    assert len(buf) == 3 and (buf.oldest, buf.newest) == (2, 4)
    assert [buf.get(i) for i in range(6)] == [None, None, b"2", b"3", b"4", None]  # only what is held
    with pytest.raises(ValueError):
        buf.append(9, b"")
    with pytest.raises(ValueError):
        ReplayBuffer(0)


def test_parse_replay_request() -> None:
    assert parse_replay_request([b"id", b"", sb(7)]) == ([b"id", b""], 7)
    assert parse_replay_request([b"id", sb(2**64 - 1)]) == ([b"id"], 2**64 - 1)
    assert parse_replay_request([b"id", b"", b"short"]) is None
    assert parse_replay_request([b"id", b"x", b"y", b"z"]) is None
    assert parse_replay_request([b"id"]) is None


def test_parse_upstream_reply_layouts() -> None:
    assert parse_upstream_reply([b"", b"topic", sb(3), b"p"]) == (3, b"p")  # vLLM
    assert parse_upstream_reply([b"", b"", sb(3), b"p"]) == (3, b"p")  # vLLM, empty topic
    assert parse_upstream_reply([b"", sb(3), b"p"]) == (3, b"p")  # SGLang
    assert parse_upstream_reply([b"topic", sb(3), b"p"]) == (3, b"p")  # no delimiter
    assert parse_upstream_reply([sb(3), b"p"]) == (3, b"p")
    assert parse_upstream_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_upstream_reply([b"", END_SEQ, b""]) is None
    for bad in ([b"", b"x"], [b"", b"t", b"123", b"p"], [b"a", b"b", b"c", b"d", b"e"]):
        with pytest.raises(KvDecodeError):
            parse_upstream_reply(bad)


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://127.0.0.1:5600", 3) == "tcp://127.0.0.1:5603"
    assert rank_endpoint("tcp://*:5600", 0) == "tcp://*:5600"
    assert rank_endpoint("tcp://127.0.0.1:0", 5) == "tcp://127.0.0.1:0"
    assert rank_endpoint("tcp://[::1]:5600", 1) == "tcp://[::1]:5601"
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert rank_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    for bad in ("tcp://127.0.0.1", "udp://x:1", "tcp://:5", "tcp://h:99999"):
        with pytest.raises(KvConfigError):
            rank_endpoint(bad, 0)
    with pytest.raises(KvConfigError):
        rank_endpoint("tcp://h:65535", 1)
    assert advertised("tcp://0.0.0.0:5600", "10.1.2.3") == "tcp://10.1.2.3:5600"
    assert advertised("tcp://0.0.0.0:5600", "fd00::2") == "tcp://[fd00::2]:5600"
    assert advertised("tcp://127.0.0.1:5600", None) == "tcp://127.0.0.1:5600"
