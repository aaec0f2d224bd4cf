"""North protocol v1 wire messages (msgspec Structs), both directions, tagged by ``"type"``.

One WebSocket message is one of these objects. Text frames carry JSON, binary frames
msgpack; the sidecar answers in the encoding of the frame it answers (docs/PROTOCOL.md).
``GenerateResponse`` and its parts mirror the proto3 JSON form of the OpenEngine
message of the same name: they are built from pb attributes on the per-token path
(``sidecar.north.codec.response_to_wire``) and decoded by the Python client.

Client -> sidecar Structs forbid unknown fields (a typo must not be ignored);
sidecar -> client Structs accept them (a newer sidecar may add some).

A field carrying a free-form value (an embedded proto3 JSON message, ``kvSessionBytes``, a
call's ``params`` and ``body``) is left untyped: msgspec decodes it as it comes (JSON values,
and msgpack ``bin`` as bytes) and cannot decode into the recursive
``sidecar.json_types.JSONValue``; the codec checks such values as ``object``
(``sidecar.north.pbjson``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import betterproto2
import msgspec

from sidecar.json_types import JSONObject, JSONValue
from sidecar.north import pbschema
from sidecar.openengine import pb

__all__ = [
    "CALL_METHODS",
    "LISTENER_HEADER",
    "MAX_ID_INT",
    "MAX_ID_LENGTH",
    "MAX_KV_SESSION_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_TOTAL",
    "MAX_METADATA_VALUE_LENGTH",
    "OUTCOMES",
    "SCHEMA_INSTEAD",
    "Call",
    "Cancel",
    "ClientMessage",
    "End",
    "EngineError",
    "ErrorBody",
    "Event",
    "Events",
    "Generate",
    "GenerateResponse",
    "GenerationFinished",
    "Id",
    "LogProb",
    "PrefillReady",
    "PromptOutput",
    "ProtocolErrorMessage",
    "ReleaseKvSessionParams",
    "Result",
    "ServerMessage",
    "StopMatch",
    "TokenInfo",
    "TokenOutput",
    "Usage",
]

#: Header of a refused WebSocket handshake on the sidecar's HTTP port (a client pointed there
#: instead of at ``--listen``), with the value ``http``: the client names the mistake.
LISTENER_HEADER: Final = "openengine-sidecar-listener"

# --- limits the codec enforces (the maximum WebSocket message size is the server's) ---

#: Longest string stream / call id (characters).
MAX_ID_LENGTH: Final = 128
#: Largest integer stream / call id (2**53 - 1: exact in every JSON implementation).
MAX_ID_INT: Final = 2**53 - 1
#: Metadata size bounds (the same as sidecar.core.metadata's, which checks key syntax and values at
#: admission): at most this many keys, values at most this long, keys and values together at most
#: ``MAX_METADATA_TOTAL`` characters (gRPC servers commonly refuse header lists above 8 KiB).
MAX_METADATA_ENTRIES: Final = 64
MAX_METADATA_VALUE_LENGTH: Final = 4096
MAX_METADATA_TOTAL: Final = 8192
#: Largest ``kvSessionBytes`` (decoded bytes).
MAX_KV_SESSION_BYTES: Final = 1 << 20

#: ``end.outcome`` values.
OUTCOMES: Final = ("completed", "cancelled", "failed", "rejected")
#: ``call.method`` values.
CALL_METHODS: Final = (
    "describe",
    "load",
    "health",
    "listLoras",
    "loadLora",
    "unloadLora",
    "releaseKvSession",
)

# --- JSON Schema annotations (schema only: msgspec does not validate extra_json_schema) ----------
# sidecar.north.schema generates docs/protocol.schema.json from these Structs; an embedded
# OpenEngine message refers to its definition from sidecar.north.pbschema.

#: Marker key of :func:`_instead` (never left in a published schema).
SCHEMA_INSTEAD: Final = "x-schema-instead"


def _schema(**extra: JSONValue) -> msgspec.Meta:
    """Keywords added to the schema msgspec derives from the field's type."""
    return msgspec.Meta(extra_json_schema=extra)


def _instead(schema: JSONObject) -> msgspec.Meta:
    """The field's schema is ``schema``, not the one derived from its Python type (which cannot
    say "a float, or one of these strings"); ``sidecar.north.schema`` substitutes it."""
    return msgspec.Meta(extra_json_schema={SCHEMA_INSTEAD: schema})


def _names(enum_cls: type[betterproto2.Enum]) -> list[JSONValue]:
    return [m.proto_name or m.name for m in enum_cls]


def _enum_or_number(enum_cls: type[betterproto2.Enum]) -> msgspec.Meta:
    """An enum of the proto3 JSON form: its name, or a number this build does not know."""
    return _instead({"anyOf": [{"enum": _names(enum_cls)}, {"type": "integer"}]})


#: A float of the proto3 JSON form: a number, or "NaN" / "Infinity" / "-Infinity".
_FLOAT = _instead({"anyOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}]})
_BASE64 = {"type": "string", "contentEncoding": "base64", "pattern": "^[A-Za-z0-9+/_-]*={0,2}$"}


#: A stream or call id: a non-empty string or a non-negative integer, chosen by the client. ``1`` and
#: ``"1"`` are different ids.
Id = (
    Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH)]
    | Annotated[int, msgspec.Meta(ge=0, le=MAX_ID_INT)]
)


# --- client -> sidecar ---------------------------------------------------------------------------


class Generate(
    msgspec.Struct,
    tag="generate",
    tag_field="type",
    forbid_unknown_fields=True,
    omit_defaults=True,
    rename="camel",
    kw_only=True,
):
    """Start a stream: ``request`` is the proto3 JSON of an OpenEngine ``GenerateRequest``."""

    stream: Id
    request: Annotated[dict[str, Any], _schema(**pbschema.ref(pb.GenerateRequest, "in"))]
    metadata: Annotated[
        dict[str, str] | None,
        _schema(description="gRPC metadata to forward (docs/PROTOCOL.md, generate)", maxProperties=64),
    ] = None
    #: KvSessionRef protobuf bytes: base64 string (JSON) or bin / base64 string (msgpack); checked by
    #: the codec.
    kv_session_bytes: Annotated[Any, _schema(**_BASE64)] = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Cancel a stream; its ``end`` (usually ``cancelled``) follows."""

    stream: Id


class Call(
    msgspec.Struct, tag="call", tag_field="type", forbid_unknown_fields=True, omit_defaults=True, kw_only=True
):
    """A unary call; ``params`` is the proto3 JSON of the method's request message."""

    call: Id
    #: An unknown method still decodes (it is answered UNSUPPORTED_FEATURE); the schema lists the known.
    method: Annotated[str, _schema(enum=list(CALL_METHODS))]
    #: The method's request (schema: ``$defs/call.<method>.params``).
    params: dict[str, Any] | None = None


class ReleaseKvSessionParams(msgspec.Struct, forbid_unknown_fields=True, rename="camel", kw_only=True):
    """``params`` of ``releaseKvSession`` (schema only: the codec checks it by hand, to take
    msgpack ``bin`` as well as base64)."""

    kv_session_bytes: Annotated[bytes, _schema(minLength=1)]


ClientMessage = Generate | Cancel | Call


# --- embedded GenerateResponse (proto3 JSON shapes) ------------------------------------------------
# omit_defaults reproduces proto3 JSON: a plain scalar at its zero value is omitted; a proto3
# ``optional`` field or oneof member defaults to None, so a set zero is still written.
# Floats are float, or "NaN" / "Infinity" / "-Infinity" strings; 64-bit ints are strings.


class _Pb(msgspec.Struct, omit_defaults=True, rename="camel", gc=False):
    """Base of the proto3 JSON shapes (Struct options are inherited). Positional construction is
    allowed for the hot path: keep field order stable."""


class LogProb(_Pb):
    token_id: int = 0
    logprob: Annotated[float, _FLOAT] = 0.0
    token: str = ""
    rank: int | None = None


class TokenInfo(_Pb):
    token_id: int = 0
    token: str = ""
    logprob: Annotated[float, _FLOAT] | None = None
    rank: int | None = None
    candidates: list[LogProb] = []


class PromptOutput(_Pb):
    tokens: list[TokenInfo] = []


class TokenOutput(_Pb):
    output_index: int | None = None
    tokens: list[TokenInfo] = []
    text: str = ""


class PrefillReady(_Pb):
    #: proto3 JSON of the KvSessionRef (informational: forward ``Event.kv_session_bytes`` instead).
    kv_session: Annotated[dict[str, Any], _schema(**pbschema.ref(pb.KvSessionRef, "out"))] | None = None


class StopMatch(_Pb):
    stop_token_id: int | None = None
    stop_text: str | None = None
    eos_token_id: int | None = None


class GenerationFinished(_Pb):
    output_index: int | None = None
    #: Unknown enum numbers stay numbers.
    reason: Annotated[str | int, _enum_or_number(pb.FinishReason)] = "FINISH_REASON_UNSPECIFIED"
    message: str = ""
    stop_match: StopMatch | None = None


class EngineError(_Pb):
    code: Annotated[str | int, _enum_or_number(pb.ErrorCode)] = "ERROR_CODE_UNSPECIFIED"
    message: str = ""
    retryable: bool = False


class Usage(_Pb):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_prompt_tokens: int | None = None
    reasoning_tokens: int | None = None


class GenerateResponse(_Pb):
    """One engine event; exactly one of prompt / token / prefill_ready / finished / error is set."""

    request_id: str = ""
    prompt: PromptOutput | None = None
    token: TokenOutput | None = None
    prefill_ready: PrefillReady | None = None
    finished: GenerationFinished | None = None
    error: EngineError | None = None
    usage: Usage | None = None

    @property
    def kind(self) -> str | None:
        """``"token"``, ``"prompt"``, ``"prefillReady"``, ``"finished"``, ``"error"`` or None."""
        if self.token is not None:
            return "token"
        if self.finished is not None:
            return "finished"
        if self.prompt is not None:
            return "prompt"
        if self.prefill_ready is not None:
            return "prefillReady"
        if self.error is not None:
            return "error"
        return None

    @property
    def text(self) -> str:
        """The token text of a ``token`` event, else ``""``."""
        return self.token.text if self.token is not None else ""


# --- sidecar -> client ---------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, kw_only=True):
    """``end.error`` / ``result.error``: ``code`` is an OpenEngine ``ERROR_CODE_*`` name."""

    code: Annotated[str, _schema(enum=_names(pb.ErrorCode))]
    message: str = ""
    retryable: bool = False


class Event(msgspec.Struct, tag="event", tag_field="type", omit_defaults=True, rename="camel", kw_only=True):
    """One engine event of a stream, in order. ``kv_session_bytes`` only on ``prefillReady``."""

    stream: Id
    response: GenerateResponse
    #: The engine's KvSessionRef protobuf bytes, unknown fields included (JSON: base64; msgpack: bin).
    kv_session_bytes: bytes | None = None


class Events(msgspec.Struct, tag="events", tag_field="type", kw_only=True):
    """Several ``event`` messages of one connection in one frame (only to a client that asked for it)."""

    items: list[Event]


class End(msgspec.Struct, tag="end", tag_field="type", kw_only=True):
    """The last message of a stream, exactly one per ``generate``."""

    stream: Id
    outcome: Annotated[str, _schema(enum=list(OUTCOMES))]
    error: ErrorBody | None = None


class Result(msgspec.Struct, tag="result", tag_field="type", omit_defaults=True, kw_only=True):
    """The answer to a ``call``: ``ok`` with ``body``, or not ``ok`` with ``error``."""

    call: Id
    ok: bool
    body: Any = None
    error: ErrorBody | None = None


class ProtocolErrorMessage(
    msgspec.Struct, tag="protocol_error", tag_field="type", omit_defaults=True, kw_only=True
):
    """A frame decoded but was not a valid message (no stream or call id could be attributed),
    or it reused the id of a stream (call) that is still open: then ``stream`` (``call``) names
    that id -- the open stream (call) goes on and gets its own ``end`` (``result``); the refused
    frame gets nothing else."""

    message: str
    stream: Id | None = None
    call: Id | None = None


ServerMessage = Event | Events | End | Result | ProtocolErrorMessage
