"""How the grpclib transport turns OpenEngine messages into bytes and back (its codec), and
the reply shapes that keep an engine's exact bytes (the trio transport decodes with it too)."""

from __future__ import annotations

from typing import Any

from grpclib.encoding.base import CodecBase

from sidecar.openengine import pb
from sidecar.openengine.fastdecode import decode_common_event
from sidecar.openengine.fastencode import encode_generate_request
from sidecar.openengine.rawfields import nested_field_bytes

__all__ = ["Codec", "HandedOver", "Serialized"]


class Codec(CodecBase):
    """betterproto2 messages on the wire; ``bytes`` are sent as already-serialized messages."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes | bytearray | memoryview):
            return bytes(message)
        if message_type is pb.GenerateRequest:
            return encode_generate_request(message) or bytes(message)  # a plain request, by hand
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        if message_type is pb.GenerateResponse and (fast := decode_common_event(data)) is not None:
            return fast  # a token event or a finish, decoded by hand (identical result)
        message = message_type.parse(data)
        if message_type is pb.GenerateResponse and message.prefill_ready is not None:
            # Keep the engine's exact KvSessionRef bytes for a byte-for-byte handoff relay.
            return HandedOver(message, nested_field_bytes(data, 4, 1))
        return message


class HandedOver:
    """A decoded ``PrefillReady`` event with the engine's ``KvSessionRef`` bytes as received
    (the stream's pump unwraps it: :attr:`EngineStream.kv_session_bytes`)."""

    __slots__ = ("message", "raw")

    def __init__(self, message: pb.GenerateResponse, raw: bytes | None) -> None:
        self.message = message
        self.raw = raw


class Serialized:
    """A reply type that keeps the message's bytes (``Codec.decode`` calls :meth:`parse`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def parse(cls, data: bytes) -> Serialized:
        return cls(bytes(data))
