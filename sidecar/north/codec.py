"""I/O-free codec of the north protocol: frames in, typed commands out; replies in, frames out.

Server side: ``decode_frame`` turns one WebSocket message (``str`` = text frame = JSON,
``bytes`` = binary frame = msgpack) into a ``GenerateCommand`` / ``CancelCommand`` /
``CallCommand`` that remembers its ``Encoding``; ``encode`` (and the ``encode_event`` fast
path, run per token) turn a ``wire`` message into a frame of a given encoding.
A ``GenerateCommand`` keeps client-supplied ``kvSessionBytes`` exactly as sent: admission
(``Sidecar.admit(..., kv_session_bytes=)``) splices them into what the engine gets, byte for byte.

Client side: ``encode`` for outgoing messages, ``decode_server_frame`` for incoming ones.

Errors: ``FrameDecodeError`` (not JSON / msgpack / UTF-8: close the socket with 1007) and
``ProtocolError`` (decodes but is not a valid message; see ``error_reply``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import betterproto2
import msgspec

from sidecar.core import int64
from sidecar.core.handoff import KvSessionRelease, parse_kv_session
from sidecar.north import wire
from sidecar.north.pbjson import PbJsonError, decode_base64, message_from_json, message_to_json
from sidecar.openengine import pb
from sidecar.quoting import clip

__all__ = [
    "CALL_REQUEST_TYPES",
    "MAX_ERROR_MESSAGE",
    "CallCommand",
    "CancelCommand",
    "Command",
    "Encoding",
    "EventEncoder",
    "FrameDecodeError",
    "GenerateCommand",
    "KvSessionRelease",
    "ProtocolError",
    "coalesce_events",
    "decode_frame",
    "decode_server_frame",
    "encode",
    "encode_event",
    "end_message",
    "error_body",
    "error_reply",
    "event_message",
    "id_in_use",
    "response_to_wire",
    "result_error",
    "result_ok",
]


class Encoding(enum.Enum):
    """Frame encoding: JSON in text frames, msgpack in binary frames."""

    JSON = "json"
    MSGPACK = "msgpack"


#: Longest ``message`` of an error sent to a client (a longer one is cut): client values quoted
#: in it are cut shorter still (``sidecar.quoting``), this bounds the rest.
MAX_ERROR_MESSAGE = 1024


class FrameDecodeError(Exception):
    """The frame is not well-formed JSON / msgpack: close the socket with 1007."""


class ProtocolError(Exception):
    """The frame decoded but is not a valid north message.

    ``stream`` is set when the frame was a ``generate`` with a valid stream id (answer with
    ``end rejected``), ``call`` when it was a ``call`` with a valid call id (answer with a failed
    ``result``); otherwise answer ``protocol_error``. ``error_reply`` builds the answer.
    ``code`` is the OpenEngine error code of that answer.
    """

    def __init__(
        self,
        message: str,
        *,
        stream: str | int | None = None,
        call: str | int | None = None,
        code: pb.ErrorCode = pb.ErrorCode.INVALID_ARGUMENT,
    ) -> None:
        message = clip(message, MAX_ERROR_MESSAGE)
        super().__init__(message)
        self.message = message
        self.stream = stream
        self.call = call
        self.code = code


@dataclass(slots=True)
class GenerateCommand:
    """A decoded ``generate``.

    ``request`` is the parsed request; when the client sent ``kvSessionBytes``,
    ``request.kv.session`` holds their parsed form (for admission checks only) and
    ``kv_session_bytes`` the exact bytes, which admission forwards unchanged.
    """

    stream: str | int
    request: pb.GenerateRequest
    metadata: dict[str, str]
    kv_session_bytes: bytes | None
    encoding: Encoding


@dataclass(slots=True)
class CancelCommand:
    stream: str | int
    encoding: Encoding


@dataclass(slots=True)
class CallCommand:
    """A decoded ``call``; ``request`` is ``params`` parsed as the method's OpenEngine request message
    (``CALL_REQUEST_TYPES``), or None for ``describe``."""

    call: str | int
    method: str
    params: dict[str, object]
    request: betterproto2.Message | KvSessionRelease | None
    encoding: Encoding


Command = GenerateCommand | CancelCommand | CallCommand

#: ``call`` method -> OpenEngine request message its ``params`` must be (None: params must be
#: empty; ``KvSessionRelease``: exactly ``{"kvSessionBytes": …}``).
CALL_REQUEST_TYPES: dict[str, type[betterproto2.Message] | type[KvSessionRelease] | None] = {
    "describe": None,
    "load": pb.GetLoadRequest,
    "health": pb.HealthRequest,
    "listLoras": pb.ListLorasRequest,
    "loadLora": pb.LoadLoraRequest,
    "unloadLora": pb.UnloadLoraRequest,
    "releaseKvSession": KvSessionRelease,
}
assert tuple(CALL_REQUEST_TYPES) == wire.CALL_METHODS

# --- decoding client frames ---------------------------------------------------------------------------

_json_decoder = msgspec.json.Decoder(wire.ClientMessage)
_msgpack_decoder = msgspec.msgpack.Decoder(wire.ClientMessage)


class _Probe(msgspec.Struct):
    """The fields that attribute a frame, whatever their types (checked by the caller)."""

    type: object = None
    stream: object = None
    call: object = None


_probe_json = msgspec.json.Decoder(_Probe)
_probe_msgpack = msgspec.msgpack.Decoder(_Probe)


def _attributable_id(frame: str | bytes, want: str) -> str | int | None:
    """After a validation error: the frame's stream/call id if it is a valid one (else None)."""
    try:
        probe = _probe_json.decode(frame) if isinstance(frame, str) else _probe_msgpack.decode(frame)
        if probe.type != want:
            return None
        ident: str | int = msgspec.convert(probe.stream if want == "generate" else probe.call, wire.Id)
        return ident
    except (msgspec.DecodeError, RecursionError):
        return None


def decode_frame(frame: str | bytes) -> Command:
    """Decode one client message: ``str`` (text frame) as JSON, ``bytes`` (binary frame) as msgpack.

    Raises ``FrameDecodeError`` for a frame that is not JSON/msgpack, ``ProtocolError`` for one
    that is but is not a valid message (unknown ``type``, missing, unknown or ill-typed fields,
    a ``request`` that is not a valid ``GenerateRequest``, limits in ``wire``).
    """
    encoding = Encoding.JSON if isinstance(frame, str) else Encoding.MSGPACK
    try:
        msg = _json_decoder.decode(frame) if isinstance(frame, str) else _msgpack_decoder.decode(frame)
    except msgspec.ValidationError as err:
        stream = _attributable_id(frame, "generate")
        call = None if stream is not None else _attributable_id(frame, "call")
        raise ProtocolError(f"invalid message: {err}", stream=stream, call=call) from None
    except msgspec.DecodeError as err:
        raise FrameDecodeError(f"undecodable {encoding.value} frame: {err}") from None
    except RecursionError:
        # well-formed but deeper than the decoder's recursion allows (~900 levels): a typed
        # answer, the connection goes on (the limit inside ``request`` is pbjson.MAX_DEPTH)
        raise ProtocolError("invalid message: nested too deep") from None
    except UnicodeEncodeError:  # a str with lone surrogates: not UTF-8 (a WebSocket text frame never is)
        raise FrameDecodeError(f"undecodable {encoding.value} frame: invalid UTF-8") from None
    if type(msg) is wire.Generate:
        return _generate_command(msg, encoding)
    if type(msg) is wire.Cancel:
        return CancelCommand(msg.stream, encoding)
    assert type(msg) is wire.Call
    return _call_command(msg, encoding)


def _generate_command(msg: wire.Generate, encoding: Encoding) -> GenerateCommand:
    stream = msg.stream
    try:
        request = message_from_json(pb.GenerateRequest, msg.request, path="request")
    except PbJsonError as err:
        raise ProtocolError(str(err), stream=stream) from None
    metadata = _check_metadata(msg.metadata, stream) if msg.metadata else {}
    kv_bytes = None
    if msg.kv_session_bytes is not None:
        kv_bytes = _kv_session_bytes(msg.kv_session_bytes, stream=stream)
        if request.kv is not None and request.kv.session is not None:
            raise ProtocolError("give request.kv.session or kvSessionBytes, not both", stream=stream)
        try:
            session = parse_kv_session(kv_bytes)
        except Exception as err:  # betterproto2 raises assorted errors on malformed protobuf
            raise ProtocolError(f"kvSessionBytes is not a KvSessionRef: {err}", stream=stream) from None
        if request.kv is None:
            request.kv = pb.KvOptions()
        request.kv.session = session
    return GenerateCommand(stream, request, metadata, kv_bytes, encoding)


def _kv_session_bytes(
    value: object, *, stream: str | int | None = None, call: str | int | None = None
) -> bytes:
    """``kvSessionBytes`` (base64, or msgpack bin) as bytes; ``stream`` / ``call``: the id the
    ProtocolError names."""
    if isinstance(value, str):
        try:
            raw = decode_base64(value)
        except ValueError as err:
            raise ProtocolError(f"kvSessionBytes: {err}", stream=stream, call=call) from None
    elif isinstance(value, bytes):
        raw = value
    else:
        raise ProtocolError("kvSessionBytes must be base64 (or msgpack bin)", stream=stream, call=call)
    if not raw:
        raise ProtocolError("kvSessionBytes is empty", stream=stream, call=call)
    if len(raw) > wire.MAX_KV_SESSION_BYTES:
        raise ProtocolError(
            f"kvSessionBytes exceeds {wire.MAX_KV_SESSION_BYTES} bytes", stream=stream, call=call
        )
    return raw


def _check_metadata(metadata: dict[str, str], stream: str | int) -> dict[str, str]:
    """Size bounds only; key syntax and values are admission's (sidecar.core.metadata)."""
    if len(metadata) > wire.MAX_METADATA_ENTRIES:
        raise ProtocolError(f"metadata has more than {wire.MAX_METADATA_ENTRIES} keys", stream=stream)
    total = 0
    for key, value in metadata.items():
        if len(value) > wire.MAX_METADATA_VALUE_LENGTH:
            raise ProtocolError(
                f"metadata {key[:60]!r}: value longer than {wire.MAX_METADATA_VALUE_LENGTH} characters",
                stream=stream,
            )
        total += len(key) + len(value)
    if total > wire.MAX_METADATA_TOTAL:
        raise ProtocolError(f"metadata exceeds {wire.MAX_METADATA_TOTAL} characters", stream=stream)
    return metadata


def _call_command(msg: wire.Call, encoding: Encoding) -> CallCommand:
    if msg.method not in CALL_REQUEST_TYPES:
        raise ProtocolError(
            f"unknown method {msg.method[:60]!r}", call=msg.call, code=pb.ErrorCode.UNSUPPORTED_FEATURE
        )
    params = msg.params or {}
    request_type = CALL_REQUEST_TYPES[msg.method]
    request: betterproto2.Message | KvSessionRelease | None = None
    if request_type is None:
        if params:
            raise ProtocolError(f"{msg.method} takes no params", call=msg.call)
    elif request_type is KvSessionRelease:
        if set(params) != {"kvSessionBytes"}:
            raise ProtocolError(f"{msg.method} takes exactly one param, kvSessionBytes", call=msg.call)
        raw = _kv_session_bytes(params["kvSessionBytes"], call=msg.call)
        try:
            request = KvSessionRelease(raw, parse_kv_session(raw))
        except Exception as err:  # betterproto2 raises assorted errors on malformed protobuf
            raise ProtocolError(f"kvSessionBytes is not a KvSessionRef: {err}", call=msg.call) from None
    else:
        assert issubclass(request_type, betterproto2.Message)
        try:
            request = message_from_json(request_type, params, path="params")
        except PbJsonError as err:
            raise ProtocolError(str(err), call=msg.call) from None
    return CallCommand(msg.call, msg.method, params, request, encoding)


# --- the request sent to the engine -------------------------------------------------------------------


# --- encoding sidecar -> client (and client -> sidecar) ---------------------------------------------

# North answers carry the sidecar's 64-bit Structs fields (sidecar.core.int64): the hook writes
# them as decimal strings; it is never called for the types of the per-token path.
_json_encode = int64.json_encoder.encode
_msgpack_encode = int64.msgpack_encoder.encode

# msgspec's omit_defaults compares floats and strings by identity: zero values must be the very
# default objects of the wire Structs to be omitted (proto3 JSON omits them).
_ZERO_LOGPROB = wire.LogProb().logprob
_FINISH_REASONS: dict[int, str | int] = {m.value: m.proto_name or m.name for m in pb.FinishReason}
_FINISH_REASONS[0] = wire.GenerationFinished().reason
_ERROR_CODES: dict[int, str | int] = {m.value: m.proto_name or m.name for m in pb.ErrorCode}
_ERROR_CODES[0] = wire.EngineError().code
_INF = float("inf")
_EVENTS_MSGPACK_HEAD = (
    b"\x82" + _msgpack_encode("type") + _msgpack_encode("events") + _msgpack_encode("items")
)
_TokenInfo = wire.TokenInfo
_TokenOutput = wire.TokenOutput


def _nonfinite(value: float) -> str:
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def _logprob(c: pb.LogProb) -> wire.LogProb:
    lp = c.logprob
    if not lp:
        lp = _ZERO_LOGPROB
    elif not -_INF < lp < _INF:
        lp = _nonfinite(lp)  # type: ignore[assignment]
    return wire.LogProb(token_id=c.token_id, logprob=lp, token=c.token, rank=c.rank)


def _token_info(t: pb.TokenInfo) -> wire.TokenInfo:
    lp = t.logprob
    cands = t.candidates
    if lp is None and not cands:
        return _TokenInfo(t.token_id, t.token, None, t.rank)  # positional: field order of wire.TokenInfo
    if lp is not None and not -_INF < lp < _INF:
        lp = _nonfinite(lp)  # type: ignore[assignment]
    return _TokenInfo(t.token_id, t.token, lp, t.rank, [_logprob(c) for c in cands] if cands else [])


def _token_infos(tokens: list[pb.TokenInfo]) -> list[wire.TokenInfo]:
    if len(tokens) == 1:
        return [_token_info(tokens[0])]
    return [_token_info(t) for t in tokens]


def _usage(u: pb.Usage) -> wire.Usage:
    return wire.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
        reasoning_tokens=u.reasoning_tokens,
    )


def _finished(f: pb.GenerationFinished) -> wire.GenerationFinished:
    sm = f.stop_match
    return wire.GenerationFinished(
        output_index=f.output_index,
        reason=_FINISH_REASONS.get(f.reason, f.reason),
        message=f.message,
        stop_match=None
        if sm is None
        else wire.StopMatch(
            stop_token_id=sm.stop_token_id, stop_text=sm.stop_text, eos_token_id=sm.eos_token_id
        ),
    )


def response_to_wire(resp: pb.GenerateResponse) -> wire.GenerateResponse:
    """The proto3 JSON shape of ``resp``, built from attributes (no ``to_dict``)."""
    usage = resp.usage
    token = resp.token
    if token is not None:
        tokens = token.tokens
        return wire.GenerateResponse(
            request_id=resp.request_id,
            token=_TokenOutput(token.output_index, _token_infos(tokens) if tokens else [], token.text),
            usage=None if usage is None else _usage(usage),
        )
    out = wire.GenerateResponse(request_id=resp.request_id, usage=None if usage is None else _usage(usage))
    if resp.finished is not None:
        out.finished = _finished(resp.finished)
    elif resp.prompt is not None:
        out.prompt = wire.PromptOutput(tokens=_token_infos(resp.prompt.tokens))
    elif resp.prefill_ready is not None:
        session = resp.prefill_ready.kv_session
        out.prefill_ready = wire.PrefillReady(
            kv_session=None if session is None else message_to_json(session)
        )
    elif resp.error is not None:
        e = resp.error
        out.error = wire.EngineError(
            code=_ERROR_CODES.get(e.code, e.code),
            message=e.message,
            retryable=e.retryable,
        )
    return out


def event_message(
    stream: str | int, resp: pb.GenerateResponse, *, kv_session_bytes: bytes | None = None
) -> wire.Event:
    """The ``event`` relaying ``resp``. For a ``prefillReady`` it carries ``kvSessionBytes``:
    ``kv_session_bytes`` when given (the engine's bytes as received), else ``bytes()`` of the
    parsed ``KvSessionRef`` (betterproto2 keeps its unknown fields). Other events carry none."""
    ready = resp.prefill_ready
    if ready is None:
        kv_session_bytes = None
    elif kv_session_bytes is None and ready.kv_session is not None:
        kv_session_bytes = bytes(ready.kv_session)
    return wire.Event(stream=stream, response=response_to_wire(resp), kv_session_bytes=kv_session_bytes)


def encode_event(
    stream: str | int, resp: pb.GenerateResponse, encoding: Encoding, *, kv_session_bytes: bytes | None = None
) -> str | bytes:
    """``encode(event_message(stream, resp), encoding)``: the per-token fast path."""
    msg = event_message(stream, resp, kv_session_bytes=kv_session_bytes)
    if encoding is Encoding.JSON:
        return _json_encode(msg).decode()
    return _msgpack_encode(msg)


class EventEncoder:
    """Per-stream ``event`` encoder for the token hot path (one per admitted stream).

    Token events without usage -- nearly all of them -- reuse the already encoded envelope
    (``type``, ``stream``, ``response.requestId``) and encode only the ``token`` part; other
    events take ``encode_event``. Output is identical to ``encode_event``'s.
    """

    __slots__ = ("_prefix", "_request_id", "encoding", "stream")

    def __init__(self, stream: str | int, encoding: Encoding) -> None:
        self.stream = stream
        self.encoding = encoding
        self._request_id: str | None = None
        self._prefix = b""

    def _make_prefix(self, request_id: str) -> bytes:
        if self.encoding is Encoding.JSON:
            envelope = _json_encode(
                wire.Event(stream=self.stream, response=wire.GenerateResponse(request_id=request_id))
            )
            assert envelope.endswith(b"}}")
            return envelope[:-2] + (b',"token":' if request_id else b'"token":')
        m = _msgpack_encode
        head = b"\x83" + m("type") + m("event") + m("stream") + m(self.stream) + m("response")
        if request_id:
            return head + b"\x82" + m("requestId") + m(request_id) + m("token")
        return head + b"\x81" + m("token")

    def encode(self, resp: pb.GenerateResponse, *, kv_session_bytes: bytes | None = None) -> str | bytes:
        """The frame relaying ``resp`` (``str`` for JSON, ``bytes`` for msgpack)."""
        token = resp.token
        if token is None or resp.usage is not None:
            return encode_event(self.stream, resp, self.encoding, kv_session_bytes=kv_session_bytes)
        request_id = resp.request_id
        if request_id != self._request_id:
            self._prefix = self._make_prefix(request_id)
            self._request_id = request_id
        tokens = token.tokens
        if len(tokens) == 1 and (t := tokens[0]).logprob is None and not t.candidates:
            infos = [_TokenInfo(t.token_id, t.token, None, t.rank)]  # inlined _token_info common case
        else:
            infos = _token_infos(tokens) if tokens else []
        body = _TokenOutput(token.output_index, infos, token.text)
        if self.encoding is Encoding.JSON:
            return (self._prefix + _json_encode(body) + b"}}").decode()
        return self._prefix + _msgpack_encode(body)


def coalesce_events(frames: Sequence[str | bytes], encoding: Encoding) -> str | bytes:
    """Join already encoded ``event`` frames of one connection (all of ``encoding``) into one
    ``{"type":"events","items":[…]}`` frame -- only for a client that opted in (docs/PROTOCOL.md,
    "Coalesced events"). Costs a join, no re-encoding."""
    if encoding is Encoding.JSON:
        return '{"type":"events","items":[' + ",".join(frames) + "]}"  # type: ignore[arg-type]
    n = len(frames)
    if n < 16:
        header = bytes([0x90 | n])
    elif n < 1 << 16:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    return _EVENTS_MSGPACK_HEAD + header + b"".join(frames)  # type: ignore[arg-type]


def encode(msg: wire.ServerMessage | wire.ClientMessage, encoding: Encoding) -> str | bytes:
    """One frame: ``str`` (send as a text frame) for JSON, ``bytes`` (binary frame) for msgpack."""
    if encoding is Encoding.JSON:
        return _json_encode(msg).decode()
    return _msgpack_encode(msg)


def error_body(code: pb.ErrorCode | int | str, message: str = "", retryable: bool = False) -> wire.ErrorBody:
    """``{"code":"ERROR_CODE_…","message":…,"retryable":…}``; ``code`` as a pb enum, number or name."""
    if not isinstance(code, str):
        name = _ERROR_CODES.get(int(code))
        code = name if isinstance(name, str) else "ERROR_CODE_UNSPECIFIED"
    return wire.ErrorBody(code=code, message=clip(message, MAX_ERROR_MESSAGE), retryable=retryable)


def end_message(stream: str | int, outcome: str, error: wire.ErrorBody | None = None) -> wire.End:
    """The ``end`` of ``stream``; ``outcome`` is one of ``wire.OUTCOMES``."""
    if outcome not in wire.OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    return wire.End(stream=stream, outcome=outcome, error=error)


def _pb_to_json(value: object) -> object:
    if isinstance(value, betterproto2.Message):
        return message_to_json(value)
    if isinstance(value, dict):
        return {k: _pb_to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pb_to_json(v) for v in value]
    return value


def result_ok(call: str | int, body: object) -> wire.Result:
    """A successful ``result``. pb messages in ``body`` (itself, or inside dicts and lists) become
    their proto3 JSON form; msgspec Structs encode as they are (do not nest pb messages in them:
    msgspec would encode those as plain dataclasses)."""
    return wire.Result(call=call, ok=True, body=_pb_to_json(body))


def result_error(call: str | int, error: wire.ErrorBody) -> wire.Result:
    return wire.Result(call=call, ok=False, error=error)


def id_in_use(*, stream: str | int | None = None, call: str | int | None = None) -> wire.ProtocolErrorMessage:
    """The ``protocol_error`` refusing a ``generate`` (``call``) that reuses the id of a stream
    (call) still open on the connection: it names the id; the open one is not touched, so the
    client never sees two ``end`` (``result``) messages for one id."""
    if stream is not None:
        return wire.ProtocolErrorMessage(
            message=f"stream {stream!r} is already open: generate refused", stream=stream
        )
    return wire.ProtocolErrorMessage(message=f"call {call!r} is still in flight: call refused", call=call)


def error_reply(err: ProtocolError) -> wire.End | wire.Result | wire.ProtocolErrorMessage:
    """The answer to a ``ProtocolError``: ``end rejected`` for an attributable ``generate``, a failed
    ``result`` for an attributable ``call``, else ``protocol_error``."""
    if err.stream is not None:
        return end_message(err.stream, "rejected", error_body(err.code, err.message))
    if err.call is not None:
        return result_error(err.call, error_body(err.code, err.message))
    return wire.ProtocolErrorMessage(message=err.message)


# --- client side: decoding server frames ----------------------------------------------------------

# Lax: proto3 JSON strings such as "-Infinity" and 64-bit "123" decode into float / int fields.
_server_json = msgspec.json.Decoder(wire.ServerMessage, strict=False)
_server_msgpack = msgspec.msgpack.Decoder(wire.ServerMessage, strict=False)


def decode_server_frame(frame: str | bytes) -> wire.ServerMessage:
    """Decode one sidecar message (client side); raises ``FrameDecodeError`` or ``ProtocolError``
    (no ids attributed)."""
    try:
        if isinstance(frame, str):
            return _server_json.decode(frame)
        return _server_msgpack.decode(frame)
    except msgspec.ValidationError as err:
        raise ProtocolError(f"invalid message from sidecar: {err}") from None
    except (msgspec.DecodeError, RecursionError) as err:
        raise FrameDecodeError(f"undecodable frame from sidecar: {err}") from None
