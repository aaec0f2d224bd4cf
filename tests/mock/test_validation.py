"""Checks before acceptance (metadata, roles, options, media, guided decoding): I/O-free."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.mock import flavors
from sidecar.mock import tokenizer as tok
from sidecar.mock.config import EngineConfig
from sidecar.mock.lora import Adapter
from sidecar.mock.validation import EngineView, RequestRefused, parse_metadata, validate
from sidecar.openengine import pb


def view(**kw: Any) -> EngineView:
    cfg = EngineConfig(**kw)
    return EngineView(
        config=cfg,
        flavor=flavors.flavor_spec(cfg),
        model=flavors.model_name(cfg),
        model_names=frozenset((flavors.model_name(cfg), *cfg.aliases)),
        loras={"ad": Adapter(3, "ad", "/tmp")},
    )


def req(**kw: Any) -> pb.GenerateRequest:
    kw.setdefault("prompt", "hello")
    return pb.GenerateRequest(request_id="r", **kw)


def rejected(request: pb.GenerateRequest, v: EngineView | None = None, md: Any = ()) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        validate(request, md, v or view())
    return info.value


# --- metadata -------------------------------------------------------------------------


def test_metadata_parsed() -> None:
    md = parse_metadata(
        [
            ("openengine-routing-key", "k"),
            ("openengine-target-dp-rank", "1"),
            ("openengine-priority", "-5"),
            ("traceparent", "00-abc-def-01"),
            ("x-other", "ignored"),
        ],
        dp_size=2,
    )
    assert (md.routing_key, md.target_rank, md.priority) == ("k", 1, -5)
    assert md.forwarded == {
        "openengine-routing-key": "k",
        "openengine-target-dp-rank": "1",
        "openengine-priority": "-5",
        "traceparent": "00-abc-def-01",
    }


@pytest.mark.parametrize(
    "pairs",
    [
        [("openengine-target-dp-rank", "x")],
        [("openengine-target-dp-rank", "-1")],
        [("openengine-target-dp-rank", "4294967296")],
        [("openengine-target-dp-rank", "2")],  # dp size 2
        [("openengine-priority", "2147483648")],
        [("openengine-priority", "1.5")],
        [("openengine-routing-key", "")],
        [("openengine-routing-key", "a"), ("openengine-routing-key", "b")],
        [("traceparent", "a"), ("traceparent", "b")],
    ],
)
def test_bad_metadata(pairs: list[tuple[str, str]]) -> None:
    with pytest.raises(RequestRefused) as info:
        parse_metadata(pairs, dp_size=2)
    assert info.value.status == "INVALID_ARGUMENT"


# --- inputs and options ------------------------------------------------------------------


def test_defaults_resolved() -> None:
    plan = validate(req(), (), view())
    assert plan.prompt_ids == [tok.BOS_ID, *tok.encode("hello")]
    assert plan.num_outputs == 1 and not plan.greedy
    assert plan.rules.max_tokens == 4096 and plan.rules.min_tokens == 0
    assert plan.model == flavors.DEFAULT_MODEL
    assert validate(req(), (), view()).seed == plan.seed


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        ({"prompt": ""}, "INVALID_ARGUMENT"),
        ({"prompt": None, "token_ids": pb.TokenIds(ids=[])}, "INVALID_ARGUMENT"),
        ({"prompt": None, "token_ids": pb.TokenIds(ids=[tok.VOCAB_SIZE])}, "INVALID_ARGUMENT"),
        ({"model": "nope"}, "NOT_FOUND"),
        ({"lora_name": "nope"}, "NOT_FOUND"),
        ({"sampling": pb.SamplingParams(num_sequences=0)}, "INVALID_ARGUMENT"),
        ({"sampling": pb.SamplingParams(num_sequences=17)}, "INVALID_ARGUMENT"),
        ({"sampling": pb.SamplingParams(temperature=-1)}, "INVALID_ARGUMENT"),
        ({"sampling": pb.SamplingParams(top_p=0)}, "INVALID_ARGUMENT"),
        ({"stopping": pb.StoppingOptions(max_tokens=0)}, "INVALID_ARGUMENT"),
        ({"stopping": pb.StoppingOptions(max_tokens=5000)}, "INVALID_ARGUMENT"),
        ({"stopping": pb.StoppingOptions(max_tokens=2, min_tokens=3)}, "INVALID_ARGUMENT"),
        ({"stopping": pb.StoppingOptions(conditions=[pb.StopCondition(stop_text="")])}, "INVALID_ARGUMENT"),
        ({"stopping": pb.StoppingOptions(conditions=[pb.StopCondition()])}, "INVALID_ARGUMENT"),
        (
            {
                "response": pb.ResponseOptions(
                    return_output_logprobs=True, output_candidates=pb.CandidateTokenSelection(top_n=21)
                )
            },
            "INVALID_ARGUMENT",
        ),
        (
            {
                "response": pb.ResponseOptions(
                    return_output_logprobs=True,
                    output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[1])),
                )
            },
            "UNIMPLEMENTED",
        ),
        (
            {
                "response": pb.ResponseOptions(
                    return_prompt_logprobs=True,
                    prompt_candidates=pb.CandidateTokenSelection(all=pb.AllCandidates()),
                )
            },
            "UNIMPLEMENTED",
        ),
        (
            {"response": pb.ResponseOptions(return_prompt_logprobs=True, prompt_logprob_start=99)},
            "INVALID_ARGUMENT",
        ),
        ({"kv": pb.KvOptions(session=pb.KvSessionRef(session_id="s"))}, "FAILED_PRECONDITION"),
        ({"guided": pb.GuidedDecoding(regex="(")}, "INVALID_ARGUMENT"),
        ({"guided": pb.GuidedDecoding(json_schema="{")}, "INVALID_ARGUMENT"),
        ({"guided": pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=[]))}, "INVALID_ARGUMENT"),
        ({"guided": pb.GuidedDecoding(regex="a+", backend="bogus")}, "INVALID_ARGUMENT"),
        ({"extra": pb.Struct.from_dict({"mock": {"faults": ["ignore-abort"]}})}, "INVALID_ARGUMENT"),
        ({"extra": pb.Struct.from_dict({"mock": {"token_delay_ms": -1}})}, "INVALID_ARGUMENT"),
    ],
)
def test_rejections_vllm_aggregated(kw: dict[str, Any], status: str) -> None:
    assert rejected(req(**kw)).status == status


def test_context_limits() -> None:
    v = view(max_context_length=20)
    assert rejected(req(prompt=" ba" * 25), v).status == "INVALID_ARGUMENT"
    assert rejected(req(stopping=pb.StoppingOptions(max_tokens=18)), v).status == "INVALID_ARGUMENT"
    plan = validate(req(), (), v)
    assert plan.rules.max_tokens == 20 - len(plan.prompt_ids)


def test_flavor_specific_features() -> None:
    trt = view(flavor="trtllm")
    assert rejected(req(kv=pb.KvOptions(bypass_prefix_cache=True)), trt).status == "UNIMPLEMENTED"
    assert (
        rejected(req(guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=["a"]))), trt).status
        == "UNIMPLEMENTED"
    )
    sg = view(flavor="sglang")
    ok = validate(
        req(
            response=pb.ResponseOptions(
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[5])),
            )
        ),
        (),
        sg,
    )
    assert ok.output_candidates is not None and ok.output_candidates.token_ids == (5,)
    v = validate(req(kv=pb.KvOptions(bypass_prefix_cache=True, cache_salt="s")), (), view())
    assert v.bypass_prefix_cache and v.cache_salt == "s"


def test_lora_and_model_alias() -> None:
    plan = validate(req(lora_name="ad"), (), view())
    assert plan.lora is not None and plan.lora.lora_id == 3
    assert validate(req(model="ad"), (), view()).lora is not None
    assert validate(req(model="alias"), (), view(aliases=("alias",))).model == "alias"
    assert rejected(req(lora_name="ad"), view(enable_lora=False)).status == "FAILED_PRECONDITION"
    assert plan.seed != validate(req(), (), view()).seed


def test_guided_choice_and_json_object() -> None:
    plan = validate(
        req(guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=["yes", "no"]))), (), view()
    )
    assert tok.decode(list(plan.forced)) in ("yes", "no")
    plan = validate(req(guided=pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())), (), view())
    assert tok.decode(list(plan.forced)) == "{}"


def test_extra_stream_faults() -> None:
    extra = pb.Struct.from_dict({"mock": {"faults": ["stall=3", "no-usage"], "token_delay_ms": 2}})
    plan = validate(req(extra=extra), (), view())
    assert plan.stream_faults.stall == 3 and plan.stream_faults.no_usage
    assert plan.token_delay_ms == 2.0


# --- roles and sessions ------------------------------------------------------------------

VLLM_SESSION = pb.KvSessionRef(session_id="s", handoff_profile="vllm.kv_transfer_params.v1", dp_rank=0)
BOOT = pb.KvBootstrap(endpoint=pb.KvEndpoint(host="127.0.0.1", port=9, protocol="tcp"), room_id=2**63 + 5)


def test_role_rules() -> None:
    assert rejected(req(), view(role="decode")).status == "FAILED_PRECONDITION"
    assert (
        validate(req(kv=pb.KvOptions(session=VLLM_SESSION)), (), view(role="decode")).kv_session
        == VLLM_SESSION
    )
    assert (
        rejected(req(kv=pb.KvOptions(session=VLLM_SESSION)), view(role="prefill")).status
        == "FAILED_PRECONDITION"
    )
    assert validate(req(), (), view(role="prefill")).kv_session is None
    other = pb.KvSessionRef(session_id="s", handoff_profile="sglang.bootstrap.v1")
    assert rejected(req(kv=pb.KvOptions(session=other)), view(role="decode")).status == "INVALID_ARGUMENT"
    wrong_backend = pb.KvSessionRef(
        session_id="s", handoff_profile="vllm.kv_transfer_params.v1", transfer_backend="x"
    )
    assert (
        rejected(req(kv=pb.KvOptions(session=wrong_backend)), view(role="decode")).status
        == "INVALID_ARGUMENT"
    )
    no_id = pb.KvSessionRef(handoff_profile="vllm.kv_transfer_params.v1")
    assert rejected(req(kv=pb.KvOptions(session=no_id)), view(role="decode")).status == "INVALID_ARGUMENT"


def test_sglang_needs_bootstrap() -> None:
    for role in ("prefill", "decode"):
        v = view(flavor="sglang", role=role)
        assert rejected(req(), v).status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
        assert (
            rejected(req(kv=pb.KvOptions(session=pb.KvSessionRef(session_id="x"))), v).status
            == "INVALID_ARGUMENT"
        )
        plan = validate(req(kv=pb.KvOptions(session=pb.KvSessionRef(bootstrap=BOOT))), (), v)
        assert plan.kv_session is not None and plan.kv_session.bootstrap == BOOT


def test_session_rank_must_agree_with_target_rank() -> None:
    md = [("openengine-target-dp-rank", "1")]
    v = view(role="decode", dp_size=2)
    assert rejected(req(kv=pb.KvOptions(session=VLLM_SESSION)), v, md).status == "INVALID_ARGUMENT"
    ok = pb.KvSessionRef(session_id="s", handoff_profile="vllm.kv_transfer_params.v1", dp_rank=1)
    assert validate(req(kv=pb.KvOptions(session=ok)), md, v).metadata.target_rank == 1


# --- multimodal ------------------------------------------------------------------------


def image(url: str = "https://x/cat.png", **kw: Any) -> pb.MediaItem:
    return pb.MediaItem(modality=pb.Modality.IMAGE, url=url, **kw)


def test_media_placeholders_expand() -> None:
    plan = validate(req(prompt="look <image> here", media=[image(uuid="u1")]), (), view())
    assert plan.prompt_ids.count(tok.IMAGE_ID) == flavors.MEDIA_TOKENS[pb.Modality.IMAGE]
    [span] = plan.media
    assert span.hash == "u1" and span.length == 8
    assert plan.prompt_ids[span.offset : span.offset + span.length] == [tok.IMAGE_ID] * 8
    auto = validate(req(prompt="look", media=[image()]), (), view())
    assert auto.prompt_ids[1:9] == [tok.IMAGE_ID] * 8
    assert auto.media[0].hash != "u1"


@pytest.mark.parametrize(
    ("flavor", "role", "kw", "status"),
    [
        (
            "vllm",
            "aggregated",
            {"media": [pb.MediaItem(modality=pb.Modality.VIDEO, url="https://v")]},
            "UNIMPLEMENTED",
        ),
        (
            "trtllm",
            "prefill",
            {"media": [pb.MediaItem(modality=pb.Modality.AUDIO, url="https://a")]},
            "UNIMPLEMENTED",
        ),
        (
            "vllm",
            "aggregated",
            {"media": [pb.MediaItem(modality=pb.Modality.IMAGE, raw_bytes=b"x")]},
            "UNIMPLEMENTED",
        ),
        (
            "sglang",
            "aggregated",
            {"media": [pb.MediaItem(modality=pb.Modality.IMAGE, raw_bytes=b"")]},
            "INVALID_ARGUMENT",
        ),
        ("vllm", "aggregated", {"media": [pb.MediaItem(url="https://x")]}, "INVALID_ARGUMENT"),
        ("vllm", "aggregated", {"media": [image("ftp://x")]}, "INVALID_ARGUMENT"),
        (
            "vllm",
            "aggregated",
            {"media": [pb.MediaItem(modality=pb.Modality.IMAGE, data_uri="data:nope")]},
            "INVALID_ARGUMENT",
        ),
        ("vllm", "aggregated", {"prompt": "<image>"}, "INVALID_ARGUMENT"),
        ("sglang", "aggregated", {"prompt": "<video>", "media": [image()]}, "INVALID_ARGUMENT"),
        (
            "sglang",
            "aggregated",
            {"media": [image()], "media_options": pb.Struct.from_dict({"image": {}})},
            "UNIMPLEMENTED",
        ),
        (
            "vllm",
            "aggregated",
            {"media": [image()], "media_options": pb.Struct.from_dict({"video": {}})},
            "INVALID_ARGUMENT",
        ),
        (
            "vllm",
            "aggregated",
            {"media": [image()], "media_options": pb.Struct.from_dict({"image": {"bogus": 1}})},
            "INVALID_ARGUMENT",
        ),
    ],
)
def test_media_rejections(flavor: str, role: str, kw: dict[str, Any], status: str) -> None:
    v = view(flavor=flavor, role=role)
    if role == "prefill" and flavor == "sglang":
        kw["kv"] = pb.KvOptions(session=pb.KvSessionRef(bootstrap=BOOT))
    assert rejected(req(**kw), v).status == status


def test_media_accepted_per_flavor() -> None:
    data = "data:image/png;base64,AAAA"
    plan = validate(
        req(
            prompt="<image><video><audio>",
            media=[
                pb.MediaItem(modality=pb.Modality.IMAGE, data_uri=data),
                pb.MediaItem(modality=pb.Modality.VIDEO, url="http://v"),
                pb.MediaItem(modality=pb.Modality.AUDIO, raw_bytes=b"\x00"),
            ],
        ),
        (),
        view(flavor="sglang"),
    )
    assert [s.length for s in plan.media] == [8, 16, 4]
    ok = validate(
        req(media=[image()], media_options=pb.Struct.from_dict({"image": {"max_pixels": 10}})), (), view()
    )
    assert len(ok.media) == 1


def test_text_only_engine_refuses_media_and_advertises_none() -> None:
    v = view(flavor="sglang", text_only=True)
    assert rejected(req(media=[image()]), v).status == "UNIMPLEMENTED"
    opts = pb.Struct.from_dict({"image": {"max_pixels": 10}})
    assert rejected(req(media_options=opts), view(text_only=True)).status == "UNIMPLEMENTED"
    info = flavors.model_info(v.config)
    assert info.supports_multimodal is False and info.multimodal_capabilities is None
    assert validate(req(), (), v).media == ()  # text still served
