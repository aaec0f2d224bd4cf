"""The north protocol's JSON Schema (sidecar/north/schema.py, docs/protocol.schema.json), checked
with an independent validator (``jsonschema``): the committed file is what the code generates,
it is a valid draft 2020-12 schema, it accepts what the codec writes and accepts, and refuses
what the documentation forbids. Real traffic: tests/e2e/test_schema_traffic.py."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import betterproto2
import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.core.card import card_to_json
from sidecar.core.int64 import msgpack_encoder
from sidecar.north import codec, pbschema, wire
from sidecar.north.codec import Encoding
from sidecar.north.pbjson import PbJsonError, message_from_json, message_to_json
from sidecar.north.schema import CALL_RESULT_TYPES, build_schema, schema_json
from sidecar.openengine import pb
from tests.core.shapes import sglang_card, vllm_card
from tests.fuzz.strategies import pb_json

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "docs" / "protocol.schema.json"


def validator(definition: str | None = None) -> jsonschema.protocols.Validator:
    """A validator of the whole document, or of one ``$defs`` entry (resolved in the document)."""
    schema = build_schema()
    if definition is not None:
        schema = {**schema, "anyOf": None, "$ref": f"#/$defs/{definition}"}
        del schema["anyOf"]
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def as_json(frame: str | bytes) -> Any:
    """A frame as the JSON value the schema describes: msgpack ``bin`` becomes base64 text (the
    documented equivalence: PROTOCOL.md, bytes)."""
    if isinstance(frame, str):
        return json.loads(frame)
    return _bins_to_base64(msgspec.msgpack.decode(frame))


def _bins_to_base64(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: _bins_to_base64(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bins_to_base64(v) for v in value]
    return value


def errors(v: jsonschema.protocols.Validator, value: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in v.iter_errors(value)]


def test_committed_schema_is_what_the_code_generates() -> None:
    assert SCHEMA_FILE.read_bytes() == schema_json(), (
        "docs/protocol.schema.json is stale: run scripts/gen-schema"
    )


def test_schema_is_a_valid_draft_2020_12_schema_without_markers() -> None:
    schema = build_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert wire.SCHEMA_INSTEAD not in schema_json().decode()
    defs = schema["$defs"]
    for method in wire.CALL_METHODS:
        assert f"call.{method}.params" in defs and f"call.{method}.result" in defs
    assert set(CALL_RESULT_TYPES) == set(wire.CALL_METHODS)
    # every $ref resolves
    refs = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    assert {r.removeprefix("#/$defs/") for r in refs} <= set(defs)


def _token(logprob: float | None = None, **kw: Any) -> pb.GenerateResponse:
    tok = pb.TokenInfo(token_id=7, token="x", logprob=logprob, rank=1)
    if logprob is not None:
        tok.candidates = [pb.LogProb(token_id=7, logprob=logprob, token="x", rank=1)]
    return pb.GenerateResponse(
        request_id="r", token=pb.TokenOutput(output_index=0, tokens=[tok], text="x"), **kw
    )


SERVER_MESSAGES: list[Any] = [
    codec.event_message(1, _token()),
    codec.event_message("s", _token(float("-inf"))),
    codec.event_message(2, _token(float("nan"), usage=pb.Usage(prompt_tokens=1, completion_tokens=1))),
    codec.event_message(
        3,
        pb.GenerateResponse(
            request_id="r",
            finished=pb.GenerationFinished(
                output_index=0, reason=pb.FinishReason.STOP, stop_match=pb.StopMatch(eos_token_id=2)
            ),
            usage=pb.Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4, cached_prompt_tokens=0),
        ),
    ),
    codec.event_message(4, pb.GenerateResponse(finished=pb.GenerationFinished(output_index=0, reason=99))),
    codec.event_message(
        5, pb.GenerateResponse(prompt=pb.PromptOutput(tokens=[pb.TokenInfo(token_id=1, token="<s>")]))
    ),
    codec.event_message(
        6,
        pb.GenerateResponse(
            error=pb.EngineError(code=pb.ErrorCode.KV_TRANSFER_FAILED, message="gone", retryable=True)
        ),
    ),
    codec.event_message(
        7,
        pb.GenerateResponse(
            prefill_ready=pb.PrefillReady(
                kv_session=pb.KvSessionRef(
                    session_id="p-1",
                    transfer_backend="nixl",
                    endpoints=[pb.KvEndpoint(host="10.0.0.5", port=5600, protocol="tcp")],
                    bootstrap=pb.KvBootstrap(room_id=2**64 - 1),
                    handoff_profile="vllm.kv_transfer_params.v1",
                )
            )
        ),
    ),
    codec.end_message(1, "completed"),
    codec.end_message(2, "rejected", codec.error_body(pb.ErrorCode.DRAINING, "draining", True)),
    codec.result_ok("c", vllm_card()),
    codec.result_ok(1, sglang_card()),
    codec.result_ok(
        2, pb.ListLorasResponse(adapters=[pb.LoraAdapter(lora_id=2**62, lora_name="a", source_path="/a")])
    ),
    codec.result_ok(3, pb.AbortResponse(status=pb.AbortStatus.ABORTED)),
    codec.result_error("c", codec.error_body(pb.ErrorCode.UNSUPPORTED_FEATURE, "nope")),
    wire.ProtocolErrorMessage(message="bad"),
    codec.id_in_use(stream=1),
    codec.id_in_use(call="c"),
]


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_what_the_codec_writes_is_valid(msg: Any, encoding: Encoding) -> None:
    assert errors(validator("ServerMessage"), as_json(codec.encode(msg, encoding))) == []


def test_events_frame_is_valid() -> None:
    frames = [codec.encode(m, Encoding.JSON) for m in SERVER_MESSAGES[:3]]
    assert errors(validator("ServerMessage"), as_json(codec.coalesce_events(frames, Encoding.JSON))) == []


def test_cards_in_json_and_msgpack_are_valid() -> None:
    v = validator("WorkerCard")
    for card in (vllm_card(), sglang_card()):
        assert errors(v, json.loads(card_to_json(card))) == []
        assert errors(v, as_json(msgpack_encoder.encode(card))) == []


REFUSED: list[tuple[str, Any]] = [
    ("ServerMessage", {"type": "end", "stream": 1, "outcome": "bogus", "error": None}),
    ("ServerMessage", {"type": "end", "stream": -1, "outcome": "completed", "error": None}),
    ("ServerMessage", {"type": "result", "call": 1, "ok": True}),  # no body
    ("ServerMessage", {"type": "result", "call": 1, "ok": False, "body": {}, "error": None}),
    ("ServerMessage", {"type": "protocol_error", "message": "x", "extra": 1}),  # nothing undocumented
    (
        "ServerMessage",
        {"type": "event", "stream": 1, "response": {"token": {"tokens": [{"logprob": "1.5"}]}}},
    ),
    ("ClientMessage", {"type": "call", "call": 1, "method": "health", "params": {"bogus": True}}),
    ("ClientMessage", {"type": "call", "call": 1, "method": "describe", "params": {"x": 1}}),
    ("ClientMessage", {"type": "call", "call": 1, "method": "nope"}),
    ("ClientMessage", {"type": "generate", "stream": 1, "request": {"prompt": 1}}),
    ("ClientMessage", {"type": "generate", "stream": 1, "request": {"sampling": {"seed": "x"}}}),
    ("ClientMessage", {"type": "cancel", "stream": 1, "x": 1}),
    (
        "LoadStatus",
        {
            "snapshot": None,
            "ageS": None,
            "stale": True,
            "errorCount": 0,
            "consecutiveErrors": 0,
            "lastError": None,
            "x": 1,
        },
    ),
]


@pytest.mark.parametrize(("definition", "value"), REFUSED)
def test_what_the_documentation_forbids_is_refused(definition: str, value: Any) -> None:
    assert errors(validator(definition), value) != []


def test_64_bit_card_fields_must_be_strings() -> None:
    raw = json.loads(card_to_json(vllm_card()))
    assert errors(validator("WorkerCard"), raw) == []
    raw["capacity"]["totalKvBlocks"] = 4096
    assert errors(validator("WorkerCard"), raw) != []


# --- the embedded OpenEngine messages: the schema and the codec agree --------------------------------

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(st.data())
def test_every_request_the_codec_accepts_the_schema_accepts(data: st.DataObject) -> None:
    value = data.draw(pb_json(pb.GenerateRequest, valid=data.draw(st.booleans())))
    try:
        message_from_json(pb.GenerateRequest, value)
    except PbJsonError:
        return  # the codec refuses it; the schema may or may not (oneof / duplicate names are the codec's)
    assert errors(validator("input.openengine.v1.GenerateRequest"), value) == []


def _out_validator(cls: type[betterproto2.Message]) -> jsonschema.protocols.Validator:
    defs = pbschema.definitions([(cls, "out")])
    return jsonschema.Draft202012Validator({"$defs": defs, "$ref": pbschema.ref(cls, "out")["$ref"]})


@_SETTINGS
@pytest.mark.parametrize(
    "cls", [pb.GenerateRequest, pb.KvSessionRef, pb.ListLorasResponse, pb.LoadLoraRequest]
)
@given(data=st.data())
def test_what_message_to_json_writes_the_output_schema_accepts(cls: Any, data: st.DataObject) -> None:
    msg = message_from_json(cls, data.draw(pb_json(cls, valid=True)))
    written = message_to_json(msg)
    assert errors(_out_validator(cls), written) == []
    assert errors(_out_validator(cls), {**written, "unknownField": 1}) != []


def test_protocol_md_documents_every_field_of_the_sidecars_answers() -> None:
    """Every field of the worker card, the load status and the health body appears (as
    ``name``) in docs/PROTOCOL.md: a new field fails here until it is documented."""
    doc = (SCHEMA_FILE.parent / "PROTOCOL.md").read_text()
    prose = re.sub(r"```.*?```", "", doc, flags=re.S)  # examples do not count, and would misalign the spans
    documented = {name for span in re.findall(r"`([^`\n]+)`", prose) for name in re.findall(r"\w+", span)}
    defs = build_schema()["$defs"]
    seen: set[str] = set()
    missing: list[str] = []

    def walk(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for prop, schema in defs[name].get("properties", {}).items():
            if prop not in documented:
                missing.append(f"{name}.{prop}")
            for ref in _refs(schema):
                walk(ref)

    for root in ("WorkerCard", "LoadStatus", "HealthStatus"):
        walk(root)
    assert missing == [], f"undocumented in docs/PROTOCOL.md: {missing}"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out = [node["$ref"].removeprefix("#/$defs/")] if "$ref" in node else []
        return out + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
