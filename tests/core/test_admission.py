from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.core.admission import admit
from sidecar.core.card import WorkerCard
from sidecar.core.errors import Rejection
from sidecar.openengine import pb

from .shapes import SGLANG_BOOTSTRAP, C, G, M, R, sglang_card, trtllm_card, vllm_card
from .test_handoff import sgl_session, vllm_session

E = pb.ErrorCode
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

VLLM = vllm_card()
VLLM_DP2 = vllm_card(dp=2)
VLLM_PREFILL = vllm_card(R.PREFILL)
VLLM_DECODE = vllm_card(R.DECODE)
TRT = trtllm_card()
TRT_PREFILL = trtllm_card(R.PREFILL)
TRT_DECODE = trtllm_card(R.DECODE)
SGL = sglang_card(R.AGGREGATED)
SGL_PREFILL = sglang_card(R.PREFILL)
SGL_DECODE = sglang_card(R.DECODE)


def req(model: str = "llama", **kw: Any) -> pb.GenerateRequest:
    if "prompt" not in kw and "token_ids" not in kw:
        kw["prompt"] = "hello"
    return pb.GenerateRequest(request_id="r1", model=model, **kw)


def img(
    source: str = "url", value: Any = "https://x/cat.png", modality: pb.Modality = M.IMAGE
) -> pb.MediaItem:
    return pb.MediaItem(modality=modality, **{source: value})


def opts(d: dict[str, Any]) -> pb.Struct:
    return pb.Struct.from_dict(d)


def sampling(**kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


def stopping(**kw: Any) -> pb.StoppingOptions:
    return pb.StoppingOptions(**kw)


def response(**kw: Any) -> pb.ResponseOptions:
    return pb.ResponseOptions(**kw)


def top_n(n: int) -> pb.CandidateTokenSelection:
    return pb.CandidateTokenSelection(top_n=n)


def kvopt(**kw: Any) -> pb.KvOptions:
    return pb.KvOptions(**kw)


Case = tuple[str, WorkerCard, pb.GenerateRequest, dict[str, str], "pb.ErrorCode | None", str]

CASES: list[Case] = [
    # ---------------------------------------------------------------- accepted
    ("plain prompt", VLLM, req(), {}, None, ""),
    ("alias", VLLM, req("meta-llama/Llama-3.1-8B-Instruct"), {}, None, ""),
    ("token ids", VLLM, req(token_ids=pb.TokenIds(ids=[1, 2, 3])), {}, None, ""),
    (
        "everything advertised",
        VLLM_DP2,
        req(
            sampling=sampling(
                temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0, seed=2**64 - 1, num_sequences=8
            ),
            stopping=stopping(
                max_tokens=4096,
                min_tokens=1,
                include_stop_in_output=True,
                conditions=[pb.StopCondition(stop_text="\n\n"), pb.StopCondition(stop_token_id=0)],
            ),
            response=response(
                return_prompt_logprobs=True,
                prompt_candidates=top_n(20),
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[5])),
                prompt_logprob_start=2,
            ),
            guided=pb.GuidedDecoding(json_schema='{"type": "object"}', backend="xgrammar"),
            kv=kvopt(cache_salt="tenant-a", bypass_prefix_cache=False),
            media=[img(), img("data_uri", "data:image/png;base64,AAAA")],
            media_options=opts({"image": {"max_pixels": 1024}}),
            lora_name="sql-lora",
        ),
        {
            "openengine-priority": "10",
            "openengine-target-dp-rank": "1",
            "openengine-routing-key": "k",
            "traceparent": TP,
        },
        None,
        "",
    ),
    (
        "explicit defaults",
        TRT,
        req(
            "qwen-omni",
            sampling=sampling(num_sequences=1),
            stopping=stopping(include_stop_in_output=False),
            response=response(return_prompt_logprobs=False),
            kv=kvopt(bypass_prefix_cache=False),
        ),
        {},
        None,
        "",
    ),
    (
        "empty sub-messages",
        VLLM,
        req(
            response=response(prompt_candidates=pb.CandidateTokenSelection()),
            guided=pb.GuidedDecoding(),
            kv=kvopt(),
            media_options=pb.Struct(),
        ),
        {},
        None,
        "",
    ),
    ("trt audio aggregated", TRT, req("qwen-omni", media=[img("raw_bytes", b"RIFF", M.AUDIO)]), {}, None, ""),
    ("trt image prefill", TRT_PREFILL, req("qwen-omni", media=[img()]), {}, None, ""),
    ("unknown caps: text", SGL, req("deepseek"), {}, None, ""),
    ("unknown caps: max_tokens", SGL, req("ds3", stopping=stopping(max_tokens=10**6)), {}, None, ""),
    ("app metadata forwarded", VLLM, req(), {"x-tenant": "a"}, None, ""),
    ("vllm context-first prefill", VLLM_PREFILL, req(stopping=stopping(max_tokens=1)), {}, None, ""),
    ("vllm decode", VLLM_DECODE, req(kv=kvopt(session=vllm_session())), {}, None, ""),
    (
        "trt decode",
        TRT_DECODE,
        req(
            "qwen-omni",
            kv=kvopt(
                session=vllm_session(
                    handoff_profile="tensorrt_llm.disaggregated_params.v1", transfer_backend="ucx"
                )
            ),
        ),
        {},
        None,
        "",
    ),
    ("sgl prefill bootstrap", SGL_PREFILL, req("deepseek", kv=kvopt(session=sgl_session())), {}, None, ""),
    (
        "sgl decode bootstrap",
        SGL_DECODE,
        req("deepseek", kv=kvopt(session=sgl_session(dp_rank=1))),
        {"openengine-target-dp-rank": "1"},
        None,
        "",
    ),
    # ---------------------------------------------------------------- model / LoRA
    (
        "unknown model",
        VLLM,
        req("gpt-9"),
        {},
        E.MODEL_NOT_FOUND,
        "model 'gpt-9' is not served by this worker",
    ),
    ("no model, several", None, req(""), {}, E.INVALID_ARGUMENT, "request.model is required"),  # filled below
    ("lora unknown", VLLM, req(lora_name="nope"), {}, E.MODEL_NOT_FOUND, "LoRA adapter 'nope' is not loaded"),
    (
        "lora unsupported",
        TRT,
        req("qwen-omni", lora_name="x"),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not support LoRA adapters",
    ),
    (
        "lora unreported",
        SGL,
        req("deepseek", lora_name="x"),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise LoRA adapters",
    ),
    (
        "lora list unknown",
        vllm_card(loras=None),
        req(lora_name="sql-lora"),
        {},
        E.UNSUPPORTED_FEATURE,
        "loaded LoRA adapters are unknown",
    ),
    (
        "lora as model conflicts",
        VLLM,
        req("sql-lora", lora_name="other"),
        {},
        E.INVALID_ARGUMENT,
        "names adapter 'sql-lora' but lora_name is 'other'",
    ),
    # ---------------------------------------------------------------- input
    ("no input", VLLM, pb.GenerateRequest(model="llama"), {}, E.INVALID_ARGUMENT, "has no input"),
    ("empty token ids", VLLM, req(token_ids=pb.TokenIds()), {}, E.INVALID_ARGUMENT, "token_ids is empty"),
    (
        "token ids unsupported",
        TRT,
        req("qwen-omni", token_ids=pb.TokenIds(ids=[1])),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not accept token_ids input",
    ),
    (
        "text unsupported",
        vllm_card(),
        None,
        {},
        E.UNSUPPORTED_FEATURE,
        "does not accept text prompts",
    ),  # below
    (
        "prompt too long",
        VLLM,
        req(token_ids=pb.TokenIds(ids=[1] * 8193)),
        {},
        E.INVALID_ARGUMENT,
        "prompt has 8193 tokens, above max_context_length 8192",
    ),
    # ---------------------------------------------------------------- sampling
    ("n zero", VLLM, req(sampling=sampling(num_sequences=0)), {}, E.INVALID_ARGUMENT, "greater than zero"),
    (
        "n above max",
        VLLM,
        req(sampling=sampling(num_sequences=9)),
        {},
        E.UNSUPPORTED_FEATURE,
        "num_sequences 9 is above this worker's max_num_sequences 8",
    ),
    (
        "n unknown",
        SGL,
        req("deepseek", sampling=sampling(num_sequences=2)),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise max_num_sequences",
    ),
    (
        "temperature nan",
        VLLM,
        req(sampling=sampling(temperature=float("nan"))),
        {},
        E.INVALID_ARGUMENT,
        "temperature must be a finite number",
    ),
    (
        "temperature negative",
        VLLM,
        req(sampling=sampling(temperature=-1.0)),
        {},
        E.INVALID_ARGUMENT,
        "temperature -1.0 is out of range",
    ),
    (
        "top_p > 1",
        VLLM,
        req(sampling=sampling(top_p=1.5)),
        {},
        E.INVALID_ARGUMENT,
        "top_p 1.5 is out of range",
    ),
    (
        "penalty inf",
        VLLM,
        req(sampling=sampling(presence_penalty=float("inf"))),
        {},
        E.INVALID_ARGUMENT,
        "presence_penalty must be a finite number",
    ),
    # ---------------------------------------------------------------- stopping
    (
        "max_tokens above",
        VLLM,
        req(stopping=stopping(max_tokens=4097)),
        {},
        E.INVALID_ARGUMENT,
        "max_tokens 4097 is above max_output_tokens 4096",
    ),
    (
        "min > max",
        VLLM,
        req(stopping=stopping(max_tokens=5, min_tokens=6)),
        {},
        E.INVALID_ARGUMENT,
        "min_tokens 6 is above max_tokens 5",
    ),
    (
        "empty stop text",
        VLLM,
        req(stopping=stopping(conditions=[pb.StopCondition(stop_text="")])),
        {},
        E.INVALID_ARGUMENT,
        "conditions[0] is empty",
    ),
    (
        "empty stop condition",
        VLLM,
        req(stopping=stopping(conditions=[pb.StopCondition()])),
        {},
        E.INVALID_ARGUMENT,
        "conditions[0] is empty",
    ),
    (
        "stop in output false cap",
        TRT,
        req("qwen-omni", stopping=stopping(include_stop_in_output=True)),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise include_stop_in_output",
    ),
    (
        "stop in output unknown",
        SGL,
        req("deepseek", stopping=stopping(include_stop_in_output=True)),
        {},
        E.UNSUPPORTED_FEATURE,
        "include_stop_in_output",
    ),
    # ---------------------------------------------------------------- logprobs
    (
        "prompt logprobs unsupported",
        TRT,
        req("qwen-omni", response=response(return_prompt_logprobs=True)),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise prompt logprobs",
    ),
    (
        "prompt candidates imply logprobs",
        TRT,
        req("qwen-omni", response=response(prompt_candidates=top_n(1))),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise prompt logprobs",
    ),
    (
        "output logprobs unknown",
        SGL,
        req("deepseek", response=response(return_output_logprobs=True)),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise output logprobs",
    ),
    (
        "candidate mode not listed",
        VLLM,
        req(
            response=response(
                return_prompt_logprobs=True,
                prompt_candidates=pb.CandidateTokenSelection(all=pb.AllCandidates()),
            )
        ),
        {},
        E.UNSUPPORTED_FEATURE,
        "prompt logprob candidates by all are not advertised (modes: top_n)",
    ),
    (
        "token_ids mode not listed",
        TRT,
        req(
            "qwen-omni",
            response=response(
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[1])),
            ),
        ),
        {},
        E.UNSUPPORTED_FEATURE,
        "output logprob candidates by token_ids are not advertised",
    ),
    (
        "top_n above max",
        TRT,
        req("qwen-omni", response=response(return_output_logprobs=True, output_candidates=top_n(2))),
        {},
        E.UNSUPPORTED_FEATURE,
        "output candidates top_n 2 is above this worker's max_top_n 1",
    ),
    (
        "candidate token ids empty",
        VLLM,
        req(
            response=response(
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds()),
            )
        ),
        {},
        E.INVALID_ARGUMENT,
        "output candidate token_ids is empty",
    ),
    # ---------------------------------------------------------------- guided
    (
        "guided mode not listed",
        VLLM,
        req(guided=pb.GuidedDecoding(ebnf_grammar="root ::= 'a'")),
        {},
        E.UNSUPPORTED_FEATURE,
        "guided decoding by ebnf_grammar is not advertised",
    ),
    (
        "guided unknown",
        SGL,
        req("deepseek", guided=pb.GuidedDecoding(regex="a+")),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise guided decoding",
    ),
    (
        "guided choice empty",
        VLLM,
        req(guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint())),
        {},
        E.INVALID_ARGUMENT,
        "guided.choice has no choices",
    ),
    (
        "guided regex empty",
        VLLM,
        req(guided=pb.GuidedDecoding(regex="")),
        {},
        E.INVALID_ARGUMENT,
        "guided.regex is empty",
    ),
    (
        "guided schema not json",
        VLLM,
        req(guided=pb.GuidedDecoding(json_schema="{nope")),
        {},
        E.INVALID_ARGUMENT,
        "guided.json_schema is not valid JSON",
    ),
    (
        "guided backend only",
        VLLM,
        req(guided=pb.GuidedDecoding(backend="xgrammar")),
        {},
        E.INVALID_ARGUMENT,
        "guided.backend is set without a guide",
    ),
    # ---------------------------------------------------------------- kv options / priority
    (
        "cache salt unknown",
        TRT,
        req("qwen-omni", kv=kvopt(cache_salt="s")),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise cache_salt",
    ),
    (
        "cache salt empty",
        VLLM,
        req(kv=kvopt(cache_salt="")),
        {},
        E.INVALID_ARGUMENT,
        "kv.cache_salt is empty",
    ),
    (
        "prefix bypass false cap",
        VLLM,
        req(kv=kvopt(bypass_prefix_cache=True)),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise bypass_prefix_cache",
    ),
    (
        "priority unknown",
        TRT,
        req("qwen-omni"),
        {"openengine-priority": "1"},
        E.UNSUPPORTED_FEATURE,
        "does not advertise openengine-priority",
    ),
    (
        "priority no gen caps",
        SGL,
        req("deepseek"),
        {"openengine-priority": "1"},
        E.UNSUPPORTED_FEATURE,
        "openengine-priority",
    ),
    # ---------------------------------------------------------------- metadata
    (
        "metadata malformed",
        VLLM,
        req(),
        {"openengine-priority": "x"},
        E.INVALID_ARGUMENT,
        "not a base-10 int32",
    ),
    (
        "target rank outside",
        VLLM,
        req(),
        {"openengine-target-dp-rank": "1"},
        E.INVALID_ARGUMENT,
        "not a DP rank of this worker (0)",
    ),
    (
        "unknown openengine key",
        VLLM,
        req(),
        {"openengine-foo": "1"},
        E.INVALID_ARGUMENT,
        "unknown OpenEngine metadata key",
    ),
    # ---------------------------------------------------------------- media
    (
        "vllm video rejected",
        VLLM,
        req(media=[img(modality=M.VIDEO)]),
        {},
        E.UNSUPPORTED_FEATURE,
        "media[0]: video is not accepted on the aggregated path of model 'llama' (accepted: image)",
    ),
    (
        "trt audio P/D rejected",
        TRT_PREFILL,
        req("qwen-omni", media=[img(), img(modality=M.AUDIO)]),
        {},
        E.UNSUPPORTED_FEATURE,
        "media[1]: audio is not accepted on the prefill/decode path",
    ),
    (
        "trt audio decode rejected",
        TRT_DECODE,
        req(
            "qwen-omni",
            media=[img(modality=M.AUDIO)],
            kv=kvopt(
                session=vllm_session(
                    handoff_profile="tensorrt_llm.disaggregated_params.v1", transfer_backend="ucx"
                )
            ),
        ),
        {},
        E.UNSUPPORTED_FEATURE,
        "audio is not accepted on the prefill/decode path",
    ),
    (
        "raw bytes not listed",
        VLLM,
        req(media=[img("raw_bytes", b"\x89PNG")]),
        {},
        E.UNSUPPORTED_FEATURE,
        "media[0] (image): source raw_bytes is not advertised (source types: url, data_uri)",
    ),
    (
        "media no modality",
        VLLM,
        req(media=[img(modality=M.UNSPECIFIED)]),
        {},
        E.INVALID_ARGUMENT,
        "media[0] has no modality",
    ),
    (
        "media no source",
        VLLM,
        req(media=[pb.MediaItem(modality=M.IMAGE)]),
        {},
        E.INVALID_ARGUMENT,
        "media[0] has no source",
    ),
    ("media empty url", VLLM, req(media=[img("url", "")]), {}, E.INVALID_ARGUMENT, "media[0].url is empty"),
    (
        "media bad data uri",
        VLLM,
        req(media=[img("data_uri", "image/png;base64,AA")]),
        {},
        E.INVALID_ARGUMENT,
        "does not start with 'data:'",
    ),
    (
        "media on text model",
        SGL,
        req("deepseek", media=[img()]),
        {},
        E.UNSUPPORTED_FEATURE,
        "model 'deepseek' does not accept media (image)",
    ),
    (
        "media options false",
        TRT,
        req("qwen-omni", media_options=opts({"image": {"a": 1}})),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not accept per-request media_options",
    ),
    (
        "media options bad key",
        VLLM,
        req(media_options=opts({"images": {}})),
        {},
        E.INVALID_ARGUMENT,
        "media_options key 'images' is not a modality",
    ),
    (
        "media options not object",
        VLLM,
        req(media_options=opts({"image": 5})),
        {},
        E.INVALID_ARGUMENT,
        "media_options.image must be an object",
    ),
    (
        "media options modality not accepted",
        VLLM,
        req(media_options=opts({"video": {}})),
        {},
        E.UNSUPPORTED_FEATURE,
        "media_options.video",
    ),
    (
        "media options no caps",
        SGL,
        req("deepseek", media_options=opts({"image": {}})),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not advertise multimodal capabilities",
    ),
    # ---------------------------------------------------------------- roles
    (
        "aggregated with session",
        VLLM,
        req(kv=kvopt(session=vllm_session())),
        {},
        E.ROLE_MISMATCH,
        "aggregated worker takes no kv.session",
    ),
    (
        "aggregated with bootstrap",
        SGL,
        req("deepseek", kv=kvopt(session=sgl_session())),
        {},
        E.ROLE_MISMATCH,
        "aggregated worker takes no kv.session",
    ),
    ("decode without session", VLLM_DECODE, req(), {}, E.ROLE_MISMATCH, "decode worker needs kv.session"),
    (
        "decode with cache salt only",
        VLLM_DECODE,
        req(kv=kvopt(cache_salt="s")),
        {},
        E.ROLE_MISMATCH,
        "decode worker needs kv.session",
    ),
    (
        "context-first prefill with session",
        VLLM_PREFILL,
        req(kv=kvopt(session=vllm_session())),
        {},
        E.ROLE_MISMATCH,
        "context-first prefill worker creates the KV session",
    ),
    (
        "sgl prefill without bootstrap",
        SGL_PREFILL,
        req("deepseek"),
        {},
        E.ROLE_MISMATCH,
        "uses client bootstrap: the request needs kv.session.bootstrap",
    ),
    (
        "sgl prefill wrong endpoint",
        SGL_PREFILL,
        req(
            "deepseek",
            kv=kvopt(
                session=sgl_session(
                    bootstrap=pb.KvBootstrap(endpoint=pb.KvEndpoint(host="10.0.0.9", port=8998), room_id=1)
                )
            ),
        ),
        {},
        E.INVALID_ARGUMENT,
        "is not this prefill engine's",
    ),
    (
        "decode profile mismatch",
        VLLM_DECODE,
        req(kv=kvopt(session=sgl_session())),
        {},
        E.UNSUPPORTED_FEATURE,
        "does not match",
    ),
    (
        "decode dp conflict",
        vllm_card(R.DECODE, dp=2),
        req(kv=kvopt(session=vllm_session(dp_rank=0))),
        {"openengine-target-dp-rank": "1"},
        E.INVALID_ARGUMENT,
        "conflicts with kv.session dp_rank 0",
    ),
    (
        "sgl decode room zero",
        SGL_DECODE,
        req("deepseek", kv=kvopt(session=sgl_session(bootstrap=pb.KvBootstrap(endpoint=SGLANG_BOOTSTRAP)))),
        {},
        E.INVALID_ARGUMENT,
        "room_id",
    ),
]


def _two_model_card() -> WorkerCard:
    from .shapes import card_of, vllm_info

    info, models = vllm_info()
    models["other"] = pb.ModelInfo(served_model_name="other")
    return card_of((info, models))


def _no_text_card() -> WorkerCard:
    from .shapes import card_of, vllm_info

    info, models = vllm_info()
    models["llama"].supports_text_input = False
    return card_of((info, models))


_SPECIAL: dict[str, Callable[[], tuple[WorkerCard, pb.GenerateRequest]]] = {
    "no model, several": lambda: (_two_model_card(), req("")),
    "text unsupported": lambda: (_no_text_card(), req()),
}


def _case(c: Case) -> tuple[WorkerCard, pb.GenerateRequest, dict[str, str], pb.ErrorCode | None, str]:
    name, card, request, md, code, fragment = c
    if name in _SPECIAL:
        card, request = _SPECIAL[name]()
    return card, request, md, code, fragment


@pytest.mark.parametrize(
    ("card", "request_", "md", "code", "fragment"), [_case(c) for c in CASES], ids=[c[0] for c in CASES]
)
def test_admission(
    card: WorkerCard,
    request_: pb.GenerateRequest,
    md: dict[str, str],
    code: pb.ErrorCode | None,
    fragment: str,
) -> None:
    before = bytes(request_)
    if code is None:
        admitted = admit(request_, md, card)
        assert admitted.model is not None
    else:
        with pytest.raises(Rejection, match=re.escape(fragment)) as exc:
            admit(request_, md, card)
        assert exc.value.code == code, exc.value
        assert exc.value.retryable is False
        assert "\n" not in exc.value.message
    assert bytes(request_) == before  # never mutated


def test_admitted_fields() -> None:
    r = req(sampling=sampling(num_sequences=3))
    a = admit(r, {"openengine-priority": "07", "x-app": "v"}, VLLM)
    assert a.request is r
    assert a.model.served_model_name == "llama" and a.lora is None
    assert a.num_sequences == 3
    assert a.metadata.priority == 7
    assert a.metadata_pairs == [("openengine-priority", "7"), ("x-app", "v")]
    assert a.metadata.as_dict() == {"openengine-priority": "7", "x-app": "v"}


def test_lora_name_as_model_is_rewritten() -> None:
    r = req("sql-lora")
    a = admit(r, {}, VLLM)
    assert a.request is not r
    assert (a.request.model, a.request.lora_name) == ("llama", "sql-lora")
    assert (r.model, r.lora_name) == ("sql-lora", "")
    assert a.lora is not None and a.lora.lora_id == 1
    a2 = admit(req("sql-lora", lora_name="sql-lora"), {}, VLLM)
    assert a2.request.lora_name == "sql-lora"


def test_explicit_lora() -> None:
    a = admit(req(lora_name="sql-lora"), {}, VLLM)
    assert a.lora is not None and a.lora.lora_name == "sql-lora"
    assert a.request.model == "llama"


def test_empty_model_on_single_model_worker_is_filled() -> None:
    r = pb.GenerateRequest.parse(bytes(req("")) + bytes([0xF8, 0x07, 0x05]))  # with an unknown field
    a = admit(r, None, VLLM)
    assert a.request.model == "llama"
    assert bytes(a.request).endswith(bytes([0xF8, 0x07, 0x05]))  # unknown fields kept


def test_decode_session_forwarded_unchanged() -> None:
    session_bytes = bytes(vllm_session()) + bytes([0xA0, 0x06, 0x01])
    session = pb.KvSessionRef.parse(session_bytes)
    r = req(kv=kvopt(session=session))
    a = admit(r, {}, VLLM_DECODE)
    assert a.request is r
    assert a.request.kv is not None and a.request.kv.session is not None
    assert bytes(a.request.kv.session) == session_bytes


def test_unknown_modality_value_is_unspecified() -> None:
    item = pb.MediaItem.parse(bytes([0x08, 0x09, 0x12, 0x01, 0x78]))  # modality 9, url "x"
    with pytest.raises(Rejection, match="has no modality"):
        admit(req(media=[item]), {}, VLLM)


def test_revision1_multimodal_passes_to_engine() -> None:
    from .shapes import card_of, vllm_info

    info, models = vllm_info()
    models["llama"].multimodal_capabilities = None
    card = card_of((info, models))
    admit(req(media=[img("raw_bytes", b"x", M.AUDIO)]), {}, card)
    with pytest.raises(Rejection, match="does not advertise multimodal capabilities"):
        admit(req(media_options=opts({"image": {}})), {}, card)


def test_unknown_role_rejects_everything() -> None:
    from .shapes import card_of, vllm_info

    info, models = vllm_info()
    info.engine_role = R.UNSPECIFIED
    card = card_of((info, models))
    with pytest.raises(Rejection, match="engine role is unspecified") as exc:
        admit(req(), {}, card)
    assert exc.value.code == E.ROLE_MISMATCH


def test_supported_guided_but_no_modes_fails_closed() -> None:
    from .shapes import card_of, vllm_info

    info, models = vllm_info()
    gen = models["llama"].generation
    assert gen is not None
    gen.guided_decoding = pb.GuidedDecodingCapabilities(supported=True)
    gen.output_logprobs = pb.LogprobCapabilities(supported=True)
    card = card_of((info, models))
    with pytest.raises(Rejection, match=re.escape("(modes: none)")):
        admit(req(guided=pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())), {}, card)
    with pytest.raises(Rejection, match=re.escape("(modes: none)")):
        admit(req(response=response(output_candidates=top_n(1))), {}, card)
    admit(req(response=response(return_output_logprobs=True)), {}, card)  # chosen token only


def test_rejection_wire_forms() -> None:
    with pytest.raises(Rejection) as exc:
        admit(req("nope"), {}, VLLM)
    r = exc.value
    assert r.code_name == "ERROR_CODE_MODEL_NOT_FOUND"
    assert r.to_dict() == {"code": "ERROR_CODE_MODEL_NOT_FOUND", "message": r.message, "retryable": False}
    ee = r.to_engine_error()
    assert ee.code == E.MODEL_NOT_FOUND and ee.message == r.message


def test_guided_modes_of_trt() -> None:
    admit(req("qwen-omni", guided=pb.GuidedDecoding(structural_tag='{"x": 1}')), {}, TRT)
    with pytest.raises(Rejection, match="by choice"):
        admit(req("qwen-omni", guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=["a"]))), {}, TRT)
    assert G.CHOICE and C.ALL  # enums used by the shapes
