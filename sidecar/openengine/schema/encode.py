"""Hand-written encoders for the two per-stream messages: the bytes betterproto2 would write.

betterproto2's generic serialiser is the largest cost of a message on either side of a
Generate stream:

- :func:`encode_generate_request`: every stream sends one request; ~50 µs for a small one under
  load (12 % of the sidecar's CPU per short request, docs/PERFORMANCE.md). It writes the fields
  a plain request carries — ``request_id``, ``model``, ``prompt`` or ``token_ids``,
  ``sampling``, ``stopping`` (with its conditions), ``lora_name``.
- :func:`encode_generate_response`: an engine served by :mod:`sidecar.openengine.serving`
  sends one response per token; betterproto2 took a third of an engine adapter's CPU per token
  (docs/design/stack-notes.md). It writes ``request_id``, ``token`` (with logprobs),
  ``finished`` and ``usage``.

Anything else (a request's response, KV or guided-decoding options, media, ``extra``; a
response's prompt, prefill or error event; unknown fields at any level; a value betterproto2
would write differently, such as a negative unsigned integer or a string that is not valid
Unicode) returns ``None`` and the caller uses ``bytes(message)``, so the result is always
identical (tested on generated messages).
"""

from __future__ import annotations

import struct

from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import unknown_fields

_DOUBLE = struct.Struct("<d").pack
_MASK64 = (1 << 64) - 1


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return bytes((value,))
    value &= _MASK64  # negative int32/int64: ten bytes, two's complement
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _text(tag: int, value: str) -> bytes:
    raw = value.encode()
    return bytes((tag,)) + _varint(len(raw)) + raw


def _message(tag: int, body: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(body)) + body


def _sampling(s: pb.SamplingParams) -> bytes:
    if unknown_fields(s):
        raise ValueError
    out = bytearray()
    for tag, value in (
        (0x09, s.temperature),
        (0x11, s.top_p),
    ):
        if value is not None:
            out += bytes((tag,)) + _DOUBLE(value)
    if s.top_k is not None:
        out += b"\x18" + _varint(s.top_k)
    for tag, value in (
        (0x21, s.min_p),
        (0x29, s.frequency_penalty),
        (0x31, s.presence_penalty),
        (0x39, s.repetition_penalty),
    ):
        if value is not None:
            out += bytes((tag,)) + _DOUBLE(value)
    if s.seed is not None:
        out += b"\x40" + _varint(s.seed)
    if s.num_sequences is not None:
        out += b"\x48" + _varint(s.num_sequences)
    return bytes(out)


def _stopping(s: pb.StoppingOptions) -> bytes:
    if unknown_fields(s):
        raise ValueError
    out = bytearray()
    if s.max_tokens is not None:
        out += b"\x08" + _varint(s.max_tokens)
    if s.min_tokens is not None:
        out += b"\x10" + _varint(s.min_tokens)
    for cond in s.conditions:
        if unknown_fields(cond):
            raise ValueError
        if cond.stop_text is not None:
            body = _text(0x0A, cond.stop_text)
        elif cond.stop_token_id is not None:
            body = b"\x10" + _varint(cond.stop_token_id)
        else:
            body = b""
        out += _message(0x1A, body)
    if s.ignore_eos is not None:
        out += b"\x20\x01" if s.ignore_eos else b"\x20\x00"
    if s.include_stop_in_output is not None:
        out += b"\x28\x01" if s.include_stop_in_output else b"\x28\x00"
    return bytes(out)


def encode_generate_request(r: pb.GenerateRequest) -> bytes | None:
    """The serialised ``r`` when it is a plain request, else ``None`` (use ``bytes(r)``)."""
    if (
        r.response is not None
        or r.kv is not None
        or r.guided is not None
        or r.media
        or r.extra is not None
        or r.media_options is not None
        or unknown_fields(r)
    ):
        return None
    try:
        out = bytearray()
        if r.request_id:
            out += _text(0x0A, r.request_id)
        if r.model:
            out += _text(0x12, r.model)
        if r.prompt is not None:
            out += _text(0x1A, r.prompt)
        elif r.token_ids is not None:
            t = r.token_ids
            if unknown_fields(t):
                return None
            ids = b"".join(_varint(i) for i in t.ids)
            out += _message(0x22, _message(0x0A, ids) if ids else b"")
        if r.sampling is not None:
            out += _message(0x2A, _sampling(r.sampling))
        if r.stopping is not None:
            out += _message(0x32, _stopping(r.stopping))
        if r.lora_name:
            out += _text(0x5A, r.lora_name)
        return bytes(out)
    except (ValueError, TypeError, struct.error):
        return None


def _uint(value: int) -> bytes:
    """A varint of an unsigned field; ValueError where betterproto2 writes other bytes."""
    if 0 <= value < 0x80:
        return bytes((value,))
    if not 0 < value < 1 << 64:
        raise ValueError
    return _varint(value)


def _token_info(t: pb.TokenInfo) -> bytes:
    if unknown_fields(t):
        raise ValueError
    out = b"\x08" + _uint(t.token_id) if t.token_id else b""
    if t.token:
        out += _text(0x12, t.token)
    if t.logprob is not None:
        out += b"\x19" + _DOUBLE(t.logprob)
    if t.rank is not None:
        out += b"\x20" + _uint(t.rank)
    for c in t.candidates:
        if unknown_fields(c):
            raise ValueError
        body = b"\x08" + _uint(c.token_id) if c.token_id else b""
        if c.logprob != 0.0:  # betterproto2 leaves out a value equal to the default (so -0.0 too)
            body += b"\x11" + _DOUBLE(c.logprob)
        if c.token:
            body += _text(0x1A, c.token)
        if c.rank is not None:
            body += b"\x20" + _uint(c.rank)
        out += _message(0x2A, body)
    return out


def _token_output(t: pb.TokenOutput) -> bytes:
    if unknown_fields(t):
        raise ValueError
    out = b"\x08" + _uint(t.output_index) if t.output_index is not None else b""
    for info in t.tokens:
        out += _message(0x12, _token_info(info))
    if t.text:
        out += _text(0x1A, t.text)
    return out


def _finished(f: pb.GenerationFinished) -> bytes:
    if unknown_fields(f):
        raise ValueError
    out = b"\x08" + _uint(f.output_index) if f.output_index is not None else b""
    if f.reason:
        out += b"\x10" + _uint(int(f.reason))
    if f.message:
        out += _text(0x1A, f.message)
    m = f.stop_match
    if m is not None:
        if unknown_fields(m):
            raise ValueError
        if m.stop_token_id is not None:
            body = b"\x08" + _uint(m.stop_token_id)
        elif m.stop_text is not None:
            body = _text(0x12, m.stop_text)
        elif m.eos_token_id is not None:
            body = b"\x18" + _uint(m.eos_token_id)
        else:
            body = b""
        out += _message(0x22, body)
    return out


def _usage(u: pb.Usage) -> bytes:
    if unknown_fields(u):
        raise ValueError
    out = bytearray()
    for tag, value in ((0x08, u.prompt_tokens), (0x10, u.completion_tokens), (0x18, u.total_tokens)):
        if value:
            out += bytes((tag,)) + _uint(value)
    for tag, opt_value in ((0x20, u.cached_prompt_tokens), (0x28, u.reasoning_tokens)):
        if opt_value is not None:
            out += bytes((tag,)) + _uint(opt_value)
    return bytes(out)


def encode_generate_response(r: pb.GenerateResponse) -> bytes | None:
    """The serialised ``r`` when it is a token, finished or usage event, else ``None`` (use
    ``bytes(r)``)."""
    if r.prompt is not None or r.prefill_ready is not None or r.error is not None or unknown_fields(r):
        return None
    try:
        out = _text(0x0A, r.request_id) if r.request_id else b""
        if r.token is not None:
            out += _message(0x1A, _token_output(r.token))
        if r.finished is not None:
            out += _message(0x2A, _finished(r.finished))
        if r.usage is not None:
            out += _message(0x52, _usage(r.usage))
        return out
    except (ValueError, TypeError, struct.error):
        return None
