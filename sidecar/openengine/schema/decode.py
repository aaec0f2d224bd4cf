"""How a Generate stream's messages are decoded: the messages that dominate the wire — plain
token events and the stream's finish — by hand, the rest by betterproto2, and a ``PrefillReady``
with the engine's exact ``KvSessionRef`` bytes beside it (:func:`decode_generate_response`).

The hand-written part:

``GenerateResponse{request_id, token{output_index, tokens[{token_id, token}], text}}`` is
nearly every message of a Generate stream; ``GenerateResponse{request_id, finished{...},
usage{...}}`` ends each one (and is half of a short request's messages). betterproto2's
generic parser spends ~25 µs on a token event and ~30 µs on a finish (more under load); this
walks the bytes directly and builds the same message objects. Anything else — logprobs,
candidates, other events, unknown fields or enum values, a field repeated, malformed bytes —
returns ``None`` and the caller falls back to the generic parser, so the result is always
identical to ``pb.GenerateResponse.parse(data)`` (tested on generated inputs).
"""

from __future__ import annotations

from sidecar.openengine import pb
from sidecar.openengine.schema.protobuf_wire import nested_field_bytes

_TokenInfo = pb.TokenInfo
_TokenOutput = pb.TokenOutput
_GenerateResponse = pb.GenerateResponse
_Finished = pb.GenerationFinished
_StopMatch = pb.StopMatch
_Usage = pb.Usage
_REASONS = {r.value: r for r in pb.FinishReason}
_U32 = 0xFFFFFFFF


class _Unsupported(Exception):
    pass


def _varint(b: bytes, i: int) -> tuple[int, int]:
    x = b[i]
    if x < 0x80:
        return x, i + 1
    x &= 0x7F
    shift = 7
    i += 1
    while True:
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        if c < 0x80:
            return x, i
        shift += 7
        if shift > 63:
            raise _Unsupported


def _bytes(b: bytes, i: int, end: int) -> tuple[bytes, int]:
    n, i = _varint(b, i)
    j = i + n
    if j > end:
        raise _Unsupported
    return b[i:j], j


def _token_info(b: bytes, i: int, end: int) -> pb.TokenInfo:
    token_id, token = 0, ""
    while i < end:
        tag = b[i]
        i += 1
        if tag == 0x08:  # token_id
            token_id, i = _varint(b, i)
        elif tag == 0x12:  # token
            raw, i = _bytes(b, i, end)
            token = raw.decode()
        else:
            raise _Unsupported
    if i != end or token_id > 0xFFFFFFFF:
        raise _Unsupported
    return _TokenInfo(token_id=token_id, token=token)


def _token_output(b: bytes, i: int, end: int) -> pb.TokenOutput:
    index: int | None = None
    infos: list[pb.TokenInfo] = []
    text = ""
    while i < end:
        tag = b[i]
        i += 1
        if tag == 0x08:  # output_index
            index, i = _varint(b, i)
        elif tag == 0x12:  # tokens
            n, i = _varint(b, i)
            if i + n > end:
                raise _Unsupported
            infos.append(_token_info(b, i, i + n))
            i += n
        elif tag == 0x1A:  # text
            raw, i = _bytes(b, i, end)
            text = raw.decode()
        else:
            raise _Unsupported
    if i != end or (index is not None and index > 0xFFFFFFFF):
        raise _Unsupported
    return _TokenOutput(output_index=index, tokens=infos, text=text)


def _u32(b: bytes, i: int) -> tuple[int, int]:
    x, i = _varint(b, i)
    if x > _U32:
        raise _Unsupported
    return x, i


def _stop_match(b: bytes, i: int, end: int) -> pb.StopMatch:
    if i >= end:
        return _StopMatch()
    tag = b[i]
    i += 1
    if tag == 0x08:
        value, i = _u32(b, i)
        out = _StopMatch(stop_token_id=value)
    elif tag == 0x12:
        raw, i = _bytes(b, i, end)
        out = _StopMatch(stop_text=raw.decode())
    elif tag == 0x18:
        value, i = _u32(b, i)
        out = _StopMatch(eos_token_id=value)
    else:
        raise _Unsupported
    if i != end:
        raise _Unsupported  # a second member of the oneof (the last would win): generic parser
    return out


def _finished(b: bytes, i: int, end: int) -> pb.GenerationFinished:
    index: int | None = None
    reason = _REASONS[0]
    message = ""
    stop: pb.StopMatch | None = None
    seen = 0
    while i < end:
        tag = b[i]
        i += 1
        if tag == 0x08 and not seen & 1:  # output_index
            index, i = _u32(b, i)
            seen |= 1
        elif tag == 0x10 and not seen & 2:  # reason
            value, i = _varint(b, i)
            if value not in _REASONS:
                raise _Unsupported
            reason = _REASONS[value]
            seen |= 2
        elif tag == 0x1A and not seen & 4:  # message
            raw, i = _bytes(b, i, end)
            message = raw.decode()
            seen |= 4
        elif tag == 0x22 and not seen & 8:  # stop_match
            n, i = _varint(b, i)
            if i + n > end:
                raise _Unsupported
            stop = _stop_match(b, i, i + n)
            i += n
            seen |= 8
        else:
            raise _Unsupported
    if i != end:
        raise _Unsupported
    return _Finished(output_index=index, reason=reason, message=message, stop_match=stop)


def _usage(b: bytes, i: int, end: int) -> pb.Usage:
    values: list[int | None] = [0, 0, 0, None, None]
    seen = 0
    while i < end:
        tag = b[i]
        i += 1
        field = tag >> 3
        if tag & 7 or not 1 <= field <= 5 or seen & (1 << field):
            raise _Unsupported
        values[field - 1], i = _u32(b, i)
        seen |= 1 << field
    if i != end:
        raise _Unsupported
    return _Usage(
        prompt_tokens=values[0],  # type: ignore[arg-type]
        completion_tokens=values[1],  # type: ignore[arg-type]
        total_tokens=values[2],  # type: ignore[arg-type]
        cached_prompt_tokens=values[3],
        reasoning_tokens=values[4],
    )


def decode_common_event(data: bytes) -> pb.GenerateResponse | None:
    """The parsed message when ``data`` is a token event or a finish (each with or without
    usage) of the common shapes, else ``None`` (use the generic parser)."""
    try:
        i, end = 0, len(data)
        request_id = ""
        token: pb.TokenOutput | None = None
        finished: pb.GenerationFinished | None = None
        usage: pb.Usage | None = None
        while i < end:
            tag = data[i]
            i += 1
            if tag == 0x0A:  # request_id
                raw, i = _bytes(data, i, end)
                request_id = raw.decode()
            elif tag == 0x1A and token is None and finished is None:  # token (a repeat would merge: generic)
                n, i = _varint(data, i)
                if i + n > end:
                    return None
                token = _token_output(data, i, i + n)
                i += n
            elif tag == 0x2A and finished is None and token is None:  # finished
                n, i = _varint(data, i)
                if i + n > end:
                    return None
                finished = _finished(data, i, i + n)
                i += n
            elif tag == 0x52 and usage is None:  # usage
                n, i = _varint(data, i)
                if i + n > end:
                    return None
                usage = _usage(data, i, i + n)
                i += n
            else:
                return None
        if token is not None:
            return _GenerateResponse(request_id=request_id, token=token, usage=usage)
        if finished is not None:
            return _GenerateResponse(request_id=request_id, finished=finished, usage=usage)
        return None
    except (_Unsupported, IndexError, UnicodeDecodeError):
        return None


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
