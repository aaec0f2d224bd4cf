"""The OpenAI front's pure parts: bodies, mapping onto GenerateRequest, chat templates, response
building, error objects and the GIE gauges (the processes end to end: tests/e2e/test_openai.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.core.admission import admit
from sidecar.core.card import WorkerCard
from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import CANCELLED, FAILED, REJECTED, Outcome, StreamSupervisor
from sidecar.core.load import LoadTracker
from sidecar.mock.tokenizer import CHAT_TEMPLATE
from sidecar.north.openai.api_errors import from_outcome
from sidecar.north.openai.chat_templates import load_chat_template, template_from_text
from sidecar.north.openai.gie_metrics import GieCollector
from sidecar.north.openai.protocol import BadRequest, decode_chat, decode_completion
from sidecar.north.openai.request_map import map_chat, map_completion, render_chat
from sidecar.north.openai.responses import DONE, ResponseBuilder
from sidecar.openengine import pb
from tests.dynamo.helpers import mock_card

MODEL = "Qwen/Qwen3-0.6B"


def completion(**fields: Any) -> Any:
    return decode_completion(json.dumps({"model": MODEL, "prompt": "Hello", **fields}).encode())


def chat(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_chat(json.dumps(body).encode())


def refused(fn: Any, *args: Any) -> Rejection:
    with pytest.raises(Rejection) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{", None),
        (b'{"model": "m"}', None),  # no prompt
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": [1, "a"]}', "prompt"),
        (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 65).encode() + b"}", "stop"),
    ],
)
def test_malformed_completion_bodies_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        decode_completion(body)
    assert info.value.param == param


def test_chat_bodies_are_bounded() -> None:
    with pytest.raises(BadRequest):
        decode_chat(b'{"messages": []}')
    parts = [{"type": "text", "text": "x"}] * 1025
    with pytest.raises(BadRequest, match="content parts"):
        decode_chat(json.dumps({"messages": [{"role": "user", "content": parts}]}).encode())


# --------------------------------------------------------------------------- mapping


def test_completion_options_map_onto_the_generate_request() -> None:
    card = mock_card()
    req = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        seed=-1,
        n=2,
        stop=["\n", "END"],
        logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        min_tokens=2,
        stop_token_ids=[9],
        include_stop_str_in_output=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    )
    headers = {"x-request-id": "abc-1", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    m = map_completion(req, card, headers)
    r = m.request
    assert (r.request_id, r.model, r.prompt) == ("abc-1", MODEL, "Hello")
    assert r.sampling == pb.SamplingParams(
        temperature=0.5, top_p=0.9, top_k=20, seed=2**64 - 1, num_sequences=2
    )
    assert r.stopping is not None and r.stopping.max_tokens == 7 and r.stopping.min_tokens == 2
    assert [c.stop_text or c.stop_token_id for c in r.stopping.conditions] == ["\n", "END", 9]
    assert r.stopping.include_stop_in_output is True
    assert r.response == pb.ResponseOptions(
        return_output_logprobs=True, output_candidates=pb.CandidateTokenSelection(top_n=3)
    )
    assert r.guided is not None and json.loads(r.guided.json_schema) == {"type": "object"}
    assert m.metadata == {"traceparent": headers["traceparent"]}
    assert (m.n, m.logprobs, m.stream, m.include_usage) == (2, True, True, True)
    admit(r, m.metadata, card)  # the mock advertises all of it


def test_completion_defaults_and_token_prompts() -> None:
    card = mock_card()
    m = map_completion(completion(prompt=[[5, 6, 7]]), card, {})
    assert m.request.token_ids == pb.TokenIds(ids=[5, 6, 7]) and m.request.stopping is not None
    assert m.request.stopping.max_tokens == 16  # OpenAI's (and vLLM's) default
    assert m.request.request_id == "" and m.request.response is None
    json_object = map_completion(completion(response_format={"type": "json_object"}), card, {})
    assert json_object.request.guided == pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        ({"prompt": ["a", "b"]}, pb.ErrorCode.INVALID_ARGUMENT, "one prompt"),
        ({"prompt": ""}, pb.ErrorCode.INVALID_ARGUMENT, "empty"),
        ({"echo": True}, pb.ErrorCode.UNSUPPORTED_FEATURE, "echo"),
        ({"logit_bias": {"5": 1.0}}, pb.ErrorCode.UNSUPPORTED_FEATURE, "logit_bias"),
        ({"best_of": 3}, pb.ErrorCode.UNSUPPORTED_FEATURE, "best_of"),
        ({"n": 0}, pb.ErrorCode.INVALID_ARGUMENT, "n must"),
        ({"max_tokens": 0}, pb.ErrorCode.INVALID_ARGUMENT, "max_tokens"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, pb.ErrorCode.INVALID_ARGUMENT, "one guide"),
    ],
)
def test_completion_refusals(fields: dict[str, Any], code: pb.ErrorCode, text: str) -> None:
    err = refused(map_completion, completion(**fields), mock_card(), {})
    assert err.code == code and text in err.message


def test_a_request_id_that_cannot_be_a_header_is_refused() -> None:
    err = refused(map_completion, completion(), mock_card(), {"x-request-id": "a b"})
    assert "X-Request-Id" in err.message


def test_what_the_engine_does_not_advertise_is_refused_by_admission() -> None:
    card = mock_card(flavor="sglang")  # no json_object, no choice
    m = map_completion(completion(response_format={"type": "json_object"}), card, {})
    err = refused(admit, m.request, m.metadata, card)
    assert err.code == pb.ErrorCode.UNSUPPORTED_FEATURE and "json_object" in err.message
    m = map_completion(completion(logprobs=50), card, {})
    assert refused(admit, m.request, m.metadata, card).code == pb.ErrorCode.UNSUPPORTED_FEATURE


def templates(template: Any) -> Any:
    return lambda served: template


def test_chat_renders_the_template_and_maps_images_in_prompt_order() -> None:
    card = mock_card()
    template = template_from_text(CHAT_TEMPLATE, "test")
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://media.example/a.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    req = chat(messages=[{"role": "user", "content": content}], max_completion_tokens=4, max_tokens=9)
    m, tmpl, mm = map_chat(req, card, {}, templates(template))
    prompt, media = render_chat(req, tmpl, mm)
    assert prompt == "user: look<image><image>\nassistant:"
    assert [(i.modality, i.url or i.data_uri) for i in media] == [
        (pb.Modality.IMAGE, "http://media.example/a.png"),
        (pb.Modality.IMAGE, "data:image/png;base64,AAAA"),
    ]
    assert all(i.uuid.startswith("sha256:") for i in media)
    assert m.request.stopping is not None and m.request.stopping.max_tokens == 4
    # a modality the engine does not advertise never reaches it
    m.request.prompt, m.request.media = prompt, media
    admit(m.request, m.metadata, card)
    video = chat(
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://v"}}]}]
    )
    m, tmpl, mm = map_chat(video, card, {}, templates(template))
    m.request.prompt, m.request.media = render_chat(video, tmpl, mm)
    assert refused(admit, m.request, m.metadata, card).code == pb.ErrorCode.UNSUPPORTED_FEATURE


def test_chat_without_a_template_names_the_flag() -> None:
    err = refused(map_chat, chat(), mock_card(), {}, templates(None))
    assert err.code == pb.ErrorCode.UNSUPPORTED_FEATURE and "--chat-template" in err.message
    err = refused(map_chat, chat(model="nope"), mock_card(), {}, templates(None))
    assert err.code == pb.ErrorCode.MODEL_NOT_FOUND


def test_chat_refusals_and_template_errors_are_the_clients() -> None:
    card = mock_card()
    strict = template_from_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
        "{{ messages[0]['content'] }}",
        "strict",
    )
    req = chat(messages=[{"role": "system", "content": "x"}])
    _, tmpl, mm = map_chat(req, card, {}, templates(strict))
    err = refused(render_chat, req, tmpl, mm)
    assert err.code == pb.ErrorCode.INVALID_ARGUMENT and "users first" in err.message
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    _, tmpl, mm = map_chat(image, card, {}, templates(strict))  # takes text only
    assert "no place for media" in refused(render_chat, image, tmpl, mm).message
    assert (
        "tools" in refused(map_chat, chat(tools=[{"type": "function"}]), card, {}, templates(strict)).message
    )
    assert "logprobs" in refused(map_chat, chat(top_logprobs=2), card, {}, templates(strict)).message


def test_the_sandbox_keeps_templates_from_python() -> None:
    evil = template_from_text("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", "evil")
    with pytest.raises(ValueError, match="chat template failed"):
        evil.render([{"role": "user", "content": "x"}])
    mutating = template_from_text("{{ messages.append(1) }}", "mutating")
    with pytest.raises(ValueError):
        mutating.render([{"role": "user", "content": "x"}])


def test_templates_are_found_beside_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tmp_path / "model"
    tok.mkdir()
    config = {
        "bos_token": {"content": "<s>"},
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
    }
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_chat_template(str(tok))
    assert t is not None and t.special_tokens["bos_token"] == "<s>"
    assert t.render([{"role": "user", "content": "x"}]) == "x"  # the engine's tokenizer adds BOS
    (tok / "chat_template.jinja").write_text("J {{ messages|length }}")
    assert load_chat_template(str(tok)).render([{}]) == "J 1"  # type: ignore[union-attr]
    override = tmp_path / "override.jinja"
    override.write_text("O")
    assert load_chat_template(str(tok), str(override)).origin == str(override)  # type: ignore[union-attr]
    named = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps(named))
    assert load_chat_template(str(tmp_path / "named")).text == "D"  # type: ignore[union-attr]
    # a hub id, from the local cache only
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "chat_template.jinja").write_text("H")
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_chat_template("org/name").text == "H"  # type: ignore[union-attr]
    assert load_chat_template("org/other") is None and load_chat_template("") is None


# --------------------------------------------------------------------------- responses


def token(index: int, text: str, lp: float | None = None) -> pb.GenerateResponse:
    info = pb.TokenInfo(
        token_id=5, token=text, logprob=lp, candidates=[pb.LogProb(token_id=5, token=text, logprob=lp or 0.0)]
    )
    return pb.GenerateResponse(token=pb.TokenOutput(output_index=index, tokens=[info], text=text))


def finished(
    index: int, reason: pb.FinishReason, stop: str | None = None, usage: bool = False
) -> pb.GenerateResponse:
    ev = pb.GenerateResponse(
        finished=pb.GenerationFinished(
            output_index=index, reason=reason, stop_match=pb.StopMatch(stop_text=stop) if stop else None
        )
    )
    if usage:
        ev.usage = pb.Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6)
    return ev


EVENTS = [
    token(0, "Hel", -0.5),
    token(1, "Yo", -0.1),
    token(0, "lo", -0.25),
    finished(1, pb.FinishReason.LENGTH),
    finished(0, pb.FinishReason.STOP, "!", usage=True),
]


def test_a_whole_completion() -> None:
    b = ResponseBuilder(chat=False, request_id="r1", model="m", n=2, logprobs=True, stream=False)
    assert all(b.event(ev) is None for ev in EVENTS)
    body = b.body()
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion"
    c0, c1 = body["choices"]
    assert (c0["text"], c0["finish_reason"], c0["stop_reason"]) == ("Hello", "stop", "!")
    assert (c1["text"], c1["finish_reason"], c1["stop_reason"]) == ("Yo", "length", None)
    assert c0["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5}, {"lo": -0.25}],
        "text_offset": [0, 3],
    }
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_a_streamed_chat() -> None:
    b = ResponseBuilder(chat=True, request_id="r2", model="m", n=2, logprobs=False, stream=True)
    opening = [msgspec.json.decode(c[6:]) for c in b.opening()]
    assert [o["choices"][0]["delta"] for o in opening] == [{"role": "assistant", "content": ""}] * 2
    assert b.opening() == []
    chunks = [msgspec.json.decode(c[6:]) for ev in EVENTS if (c := b.event(ev)) is not None]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "Hel"},
        {"content": "Yo"},
        {"content": "lo"},
        {},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == ["length", "stop"]
    usage = msgspec.json.decode(b.usage_chunk()[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
    assert DONE == b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("outcome", "status", "retry_after"),
    [
        (Outcome(REJECTED, pb.ErrorCode.INVALID_ARGUMENT, "bad"), 400, None),
        (Outcome(REJECTED, pb.ErrorCode.UNSUPPORTED_FEATURE, "no"), 400, None),
        (Outcome(REJECTED, pb.ErrorCode.MODEL_NOT_FOUND, "who"), 404, None),
        (Outcome(REJECTED, pb.ErrorCode.DUPLICATE_REQUEST, "again"), 409, None),
        (Outcome(REJECTED, pb.ErrorCode.OVERLOADED, "full", True), 429, 1),
        (Outcome(REJECTED, pb.ErrorCode.DRAINING, "draining", True), 503, 1),
        (Outcome(FAILED, pb.ErrorCode.INTERNAL, "engine lost", True), 503, 1),
        (Outcome(CANCELLED, pb.ErrorCode.DRAINING, "drain deadline reached", True), 503, 1),
        (Outcome(FAILED, pb.ErrorCode.INTERNAL, "engine bug"), 500, None),
    ],
)
def test_outcomes_become_openai_errors(outcome: Outcome, status: int, retry_after: int | None) -> None:
    err = from_outcome(outcome)
    assert (err.status, err.retry_after) == (status, retry_after)
    body = msgspec.json.decode(err.encode())["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] == outcome.message


# --------------------------------------------------------------------------- GIE gauges


class _Host:
    def __init__(self, card: WorkerCard) -> None:
        self.card = card
        self.load = LoadTracker()
        self.supervisor = StreamSupervisor(engine=None)  # type: ignore[arg-type]


def scrape(collector: GieCollector) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "vllm:" in text
    return {f.name: (f.type, [(dict(s.labels), s.value) for s in f.samples]) for f in registry.collect()}


def test_the_gie_gauges_follow_the_engines_load_reports() -> None:
    host = _Host(mock_card(enable_lora=True))
    collector = GieCollector(host)
    before = scrape(collector)
    assert "vllm:num_requests_waiting" not in before  # nothing reported yet: nothing guessed
    assert before["vllm:cache_config_info"] == (
        "gauge",
        [({"block_size": "16", "num_gpu_blocks": "4096", "engine": "0"}, 1.0)],
    )
    info = pb.LoadInfo(
        ranks=[
            pb.RankLoadInfo(
                data_parallel_rank=0,
                running_requests=3,
                queued_requests=1,
                used_kv_blocks=10,
                total_kv_blocks=100,
            ),
            pb.RankLoadInfo(
                data_parallel_rank=1,
                running_requests=2,
                queued_requests=4,
                used_kv_blocks=30,
                total_kv_blocks=100,
            ),
        ]
    )
    host.load.record(info, now=0.0)
    got = scrape(collector)
    labels = {"model_name": MODEL, "engine": "0"}
    assert got["vllm:num_requests_waiting"] == ("gauge", [(labels, 5.0)])
    assert got["vllm:num_requests_running"] == ("gauge", [(labels, 5.0)])
    assert got["vllm:kv_cache_usage_perc"] == ("gauge", [(labels, 0.2)])
    kind, [(lora, stamp)] = got["vllm:lora_requests_info"]
    assert kind == "gauge" and stamp > 1e9
    assert lora == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
