"""How a Generate stream's messages are decoded: the common events by hand
(:mod:`sidecar.openengine.fastdecode`), the rest by betterproto2, and a ``PrefillReady`` with the
engine's exact ``KvSessionRef`` bytes beside it."""

from __future__ import annotations

from sidecar.openengine import pb
from sidecar.openengine.fastdecode import decode_common_event
from sidecar.openengine.rawfields import nested_field_bytes

__all__ = ["HandedOver", "decode_generate_response"]


class HandedOver:
    """A decoded ``PrefillReady`` event with the engine's ``KvSessionRef`` bytes as received
    (the stream unwraps it: ``EngineStream.kv_session_bytes``)."""

    __slots__ = ("message", "raw")

    def __init__(self, message: pb.GenerateResponse, raw: bytes | None) -> None:
        self.message = message
        self.raw = raw


def decode_generate_response(data: bytes) -> pb.GenerateResponse | HandedOver:
    """One ``GenerateResponse``; a ``PrefillReady`` comes as :class:`HandedOver`."""
    fast = decode_common_event(data)
    if fast is not None:
        return fast  # a token event or a finish, decoded by hand (identical result)
    message = pb.GenerateResponse.parse(data)
    if message.prefill_ready is not None:
        # Keep the engine's exact KvSessionRef bytes for a byte-for-byte handoff relay.
        return HandedOver(message, nested_field_bytes(data, 4, 1))
    return message
