from __future__ import annotations

import msgspec
import pytest

from sidecar import __version__
from sidecar.core.card import (
    card_from_json,
    card_to_json,
    dp_ranks_of,
    enum_name,
    enum_names,
    with_loras,
)
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

from .shapes import R, card_of, sglang_card, sglang_info, trtllm_card, trtllm_info, vllm_card, vllm_info


def test_vllm_shape() -> None:
    card = vllm_card(dp=2)
    assert card.problems == []
    assert (card.engine.name, card.engine.version, card.engine.instance_id) == ("vllm", "0.26.1", "vllm-1")
    assert card.role == "aggregated"
    assert card.schema.revision == 3 and card.schema.release == SCHEMA_RELEASE
    assert card.schema.release_kind == "commit"
    assert card.dp_ranks == [0, 1]
    assert card.capacity is not None and card.capacity.max_loras == 4
    assert card.parallelism is not None and card.parallelism.tensor_parallel_size == 2
    assert card.parallelism.decode_context_parallel_size is None
    assert card.extra == {"kv_cache_dtype": "auto"}
    [m] = card.models
    assert m.served_model_name == "llama"
    assert m.aliases == ["meta-llama/Llama-3.1-8B-Instruct"]  # served name not repeated
    assert m.names == ["llama", "meta-llama/Llama-3.1-8B-Instruct"]
    assert m.tokenizer is not None and m.tokenizer.mode == "auto"
    assert m.tokenizer_modes == ["auto", "slow"]
    assert (m.max_context_length, m.max_output_tokens) == (8192, 4096)
    g = m.generation
    assert g is not None and g.output_logprobs is not None and g.guided_decoding is not None
    assert g.output_logprobs.candidate_selection_modes == ["top_n", "token_ids"]
    assert g.guided_decoding.modes == ["json_schema", "regex", "choice", "json_object"]
    assert g.supports_prefix_cache_bypass is False
    assert m.multimodal is not None
    assert m.multimodal.aggregate_modalities == ["image"]
    assert m.multimodal.source_types == ["url", "data_uri"]
    assert m.multimodal.routing_image_token_id == 32000
    assert m.reasoning_parser is None and m.tool_call_parser == "llama3_json"
    kv = card.kv_connector
    assert kv is not None and not kv.uses_client_bootstrap and kv.bootstrap_endpoint is None
    assert kv.supports_drain is None and kv.supports_abort_cleanup is True
    assert card.lora_adapters is not None and card.lora_adapters[0].base_model == "llama"
    assert card.served_model_names == ["llama", "meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
    assert card.kv_event_sources is None
    assert card.sidecar.version == __version__ and card.sidecar.schema_release == SCHEMA_RELEASE


def test_trtllm_shape_presence_kept() -> None:
    card = trtllm_card()
    assert card.problems == []
    assert card.schema.release == "v1.0.0" and card.schema.release_kind == "tag"
    assert card.dp_ranks == [0]  # size unreported
    assert card.capacity is not None
    assert card.capacity.kv_block_size == 32 and card.capacity.total_kv_blocks is None
    [m] = card.models
    assert m.aliases == [] and m.max_output_tokens is None
    assert m.tokenizer is not None and m.tokenizer.mode is None
    assert m.supports_token_ids_input is False
    g = m.generation
    assert g is not None
    assert g.prompt_logprobs is not None and g.prompt_logprobs.supported is False
    assert g.supports_priority is None and g.supports_stop_in_output is False
    assert g.supports_cache_salt is None
    assert m.multimodal is not None
    assert m.multimodal.aggregate_modalities == ["image", "audio"]
    assert m.multimodal.prefill_decode_modalities == ["image"]
    assert m.multimodal.supports_per_request_media_options is False
    assert m.multimodal.routing_image_token_id is None
    assert card.lora_adapters == []


def test_sglang_shape() -> None:
    card = sglang_card(dp=2)
    assert card.problems == []
    assert card.role == "prefill"
    assert card.schema.release == SCHEMA_RELEASE  # lower-cased
    assert card.dp_ranks == [0, 1]
    [m] = card.models
    assert m.generation is None and m.multimodal is None and m.supports_multimodal is None
    assert m.tokenizer is None
    kv = card.kv_connector
    assert kv is not None and kv.uses_client_bootstrap
    assert kv.bootstrap_endpoint is not None
    assert (kv.bootstrap_endpoint.host, kv.bootstrap_endpoint.port) == ("10.0.0.5", 8998)
    assert card.lora_adapters is None
    assert card.served_model_names == ["deepseek", "ds3"]


@pytest.mark.parametrize("make", [vllm_card, trtllm_card, sglang_card])
def test_json_round_trip(make: object) -> None:
    card = make()  # type: ignore[operator]
    data = card_to_json(card)
    back = card_from_json(data)
    assert back == card
    raw = msgspec.json.decode(data)
    # absent stays null, never a default
    assert "dpRanks" in raw and "problems" in raw and "servedModelNames" in raw
    assert "releaseKind" in raw["schema"]
    assert raw["load"] is None


def test_64_bit_fields_are_decimal_strings_in_json_and_msgpack() -> None:
    """proto3 JSON (docs/PROTOCOL.md): uint64 / int64 travel as strings, exact beyond 2^53."""
    from sidecar.core.int64 import msgpack_encoder
    from sidecar.core.load import LoadTracker

    info, models = vllm_info()
    assert info.capacity is not None
    big = 2**64 - 1
    info.capacity.total_kv_blocks = big
    info.capacity.max_running_requests = 2**53 + 1
    info.capacity.max_batched_tokens = 8192
    card = card_of((info, models), loras=[pb.LoraAdapter(lora_id=2**62, lora_name="a", source_path="/a")])
    tracker = LoadTracker()
    tracker.record(
        pb.LoadInfo(
            timestamp_unix_nanos=1_700_000_000_123_456_789,
            used_kv_blocks=2**60,
            total_kv_blocks=big,
            running_tokens=7,
            waiting_tokens=0,
            ranks=[pb.RankLoadInfo(data_parallel_rank=0, used_kv_blocks=5, total_kv_blocks=big)],
        ),
        now=1.0,
    )
    card = msgspec.structs.replace(card, load=tracker.status(now=1.0))
    for raw in (
        msgspec.json.decode(card_to_json(card)),
        msgspec.msgpack.decode(msgpack_encoder.encode(card)),
    ):
        cap = raw["capacity"]
        assert (cap["totalKvBlocks"], cap["maxRunningRequests"], cap["maxBatchedTokens"]) == (
            str(big),
            str(2**53 + 1),
            "8192",
        )
        assert cap["kvBlockSize"] == 16  # 32-bit: a number
        assert raw["loraAdapters"][0]["loraId"] == str(2**62)
        snap = raw["load"]["snapshot"]
        assert snap["timestampUnixNanos"] == "1700000000123456789"
        assert (snap["usedKvBlocks"], snap["totalKvBlocks"]) == (str(2**60), str(big))
        assert (snap["runningTokens"], snap["waitingTokens"]) == ("7", "0")
        assert snap["ranks"][0]["usedKvBlocks"] == "5" and snap["ranks"][0]["totalKvBlocks"] == str(big)
        assert snap["ranks"][0]["dataParallelRank"] == 0
    back = card_from_json(card_to_json(card))
    assert back == card and back.capacity is not None and back.capacity.total_kv_blocks == big
    with pytest.raises(TypeError):  # an encoder without the hook fails loudly, never sends a number
        msgspec.json.encode(card)


def test_absent_sections_are_null() -> None:
    info, models = sglang_info()
    info.parallelism = None
    info.kv_connector = None
    card = card_of((info, models), loras=None)
    raw = msgspec.json.decode(card_to_json(card))
    assert raw["parallelism"] is None and raw["capacity"] is None and raw["kvConnector"] is None
    assert raw["models"][0]["generation"] is None
    assert card.dp_ranks == [0]
    assert "prefill engine advertises no enabled KV connector" in card.problems


def test_unknown_enum_values_treated_as_unspecified() -> None:
    info, models = vllm_info()
    mm = pb.MultimodalCapabilities.parse(
        bytes(pb.MultimodalCapabilities(aggregate_modalities=[pb.Modality.IMAGE]))
        + bytes([0x08, 0x09, 0x08, 0x00])
    )
    models["llama"].multimodal_capabilities = mm
    card = card_of((info, models))
    assert card.models[0].multimodal is not None
    assert card.models[0].multimodal.aggregate_modalities == ["image"]
    unknown_role = pb.ServerInfo.parse(bytes([0x18, 0x07])).engine_role
    info.engine_role = unknown_role
    card = card_of((info, models))
    assert card.role == "unspecified"
    assert any("no known role" in p for p in card.problems)
    assert enum_name(pb.Modality, 0) is None and enum_name(pb.Modality, 77) is None
    assert enum_names(pb.Modality, [1, 1, 2, 0, 99]) == ["image", "video"]


@pytest.mark.parametrize(
    ("par", "ranks"),
    [
        (None, [0]),
        (pb.ParallelismInfo(), [0]),
        (pb.ParallelismInfo(data_parallel_size=1), [0]),
        (pb.ParallelismInfo(data_parallel_size=4), [0, 1, 2, 3]),
        (pb.ParallelismInfo(data_parallel_size=2, data_parallel_start_rank=2), [2, 3]),
        (pb.ParallelismInfo(data_parallel_start_rank=3), [3]),
        (pb.ParallelismInfo(data_parallel_size=0), [0]),
    ],
)
def test_dp_ranks(par: pb.ParallelismInfo | None, ranks: list[int]) -> None:
    assert dp_ranks_of(par) == ranks


def test_problems() -> None:
    info, models = vllm_info(R.DECODE)
    info.kv_connector = pb.KvConnectorInfo(enabled=False, handoff_profile="x")
    assert "decode engine advertises no enabled KV connector" in card_of((info, models)).problems
    info.kv_connector = pb.KvConnectorInfo(enabled=True)
    problems = card_of((info, models)).problems
    assert problems[0].startswith(
        "decode engine's KV connector advertises no handoff_profile and none derives"
    )
    info, models = sglang_info(R.PREFILL)
    assert info.kv_connector is not None
    info.kv_connector.local_endpoints = []
    assert any("no local bootstrap endpoint" in p for p in card_of((info, models)).problems)
    info, models = sglang_info(R.DECODE)
    assert info.kv_connector is not None
    info.kv_connector.local_endpoints = []
    assert card_of((info, models)).problems == []  # decode takes the prefill's endpoint
    info, models = vllm_info()
    info.parallelism = pb.ParallelismInfo(data_parallel_size=0)
    assert "engine reports data_parallel_size 0" in card_of((info, models)).problems
    info, models = vllm_info()
    info.supported_models = []
    assert any("serves no models" in p for p in card_of((info, {})).problems)


def test_alias_collision_is_a_problem() -> None:
    info, models = vllm_info()
    other = pb.ModelInfo(served_model_name="other", served_model_aliases=["meta-llama/Llama-3.1-8B-Instruct"])
    card = card_of((info, {**models, "other": other}))
    assert any("claimed by both" in p for p in card.problems)


def test_only_model() -> None:
    info, models = vllm_info()
    other = pb.ModelInfo(served_model_name="other", served_model_aliases=["o"], model_id="x/other")
    both = {**models, "other": other}
    assert [m.served_model_name for m in card_of((info, both)).models] == ["llama", "other"]
    assert [m.served_model_name for m in card_of((info, both), only_model="o").models] == ["other"]
    card = card_of((info, both), only_model="nope")
    assert card.models == []
    assert card.problems == [
        "model 'nope' is not served by this engine (serves: llama, meta-llama/Llama-3.1-8B-Instruct, other, o)"
    ]


def test_empty_served_name_falls_back_to_queried_name() -> None:
    info, _ = vllm_info()
    card = card_of((info, {"llama": pb.ModelInfo()}))
    assert card.models[0].served_model_name == "llama"
    assert card.models[0].supports_text_input is None and card.models[0].generation is None


def test_resolver() -> None:
    card = vllm_card()
    r = card.resolve("llama")
    assert r is not None and r.via == "name" and r.lora is None
    r = card.resolve("meta-llama/Llama-3.1-8B-Instruct")
    assert r is not None and r.via == "alias" and r.model.served_model_name == "llama"
    r = card.resolve("sql-lora")
    assert r is not None and r.via == "lora" and r.model.served_model_name == "llama"
    assert r.lora is not None and r.lora.lora_id == 1
    assert card.resolve("nope") is None
    assert card.resolve("") is None
    # adapters of an engine without a LoRA-capable model resolve to nothing
    t = trtllm_card(loras=[pb.LoraAdapter(lora_id=1, lora_name="a", source_path="/a")])
    assert t.lora_adapters is not None and t.lora_adapters[0].base_model is None
    assert t.resolve("a") is None
    assert "a" not in t.served_model_names


def test_with_loras() -> None:
    card = vllm_card()
    new = with_loras(card, [pb.LoraAdapter(lora_id=2, lora_name="chat", source_path="/adapters/chat")])
    assert new.served_model_names == ["llama", "meta-llama/Llama-3.1-8B-Instruct", "chat"]
    assert new.resolve("sql-lora") is None and new.resolve("chat") is not None
    assert card.resolve("sql-lora") is not None  # original untouched
    unknown = with_loras(card, None)
    assert unknown.lora_adapters is None and "sql-lora" not in unknown.served_model_names


def test_kv_event_sources() -> None:
    src = pb.KvEventSource(
        transport="zmq",
        endpoint_addr=pb.KvEndpoint(host="10.0.0.1", port=5557, protocol="tcp"),
        topic="",
        replay_endpoint="tcp://10.0.0.1:5558",
        data_parallel_rank=0,
        encoding="msgpack",
        buffer_steps=10000,
    )
    card = vllm_card(sources=[src, pb.KvEventSource(transport="grpc", encoding="protobuf")])
    assert card.kv_event_sources is not None
    a, b = card.kv_event_sources
    assert a.endpoint is not None and a.endpoint.port == 5557 and a.replay_endpoint == "tcp://10.0.0.1:5558"
    assert a.hwm is None and a.buffer_steps == 10000
    assert b.endpoint is None and b.replay_endpoint is None and b.data_parallel_rank is None
    assert vllm_card(sources=[]).kv_event_sources == []


def test_trtllm_info_shape_builds() -> None:
    info, models = trtllm_info(R.DECODE)
    assert card_of((info, models)).problems == []
