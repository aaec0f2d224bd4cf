"""Worker card → Dynamo registrations, and the --dynamo* flags (no Dynamo needed)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import msgspec
import pytest
from click.testing import CliRunner

from sidecar.core.card import LoraCard
from sidecar.dynamo.config import DynamoConfig, DynamoConfigError
from sidecar.dynamo.options import dynamo_config, dynamo_options
from sidecar.dynamo.registration import MediaPlan, RegistrationError, media_routing_note, plan_registrations
from tests.dynamo.helpers import mock_card


def test_aggregated_card(tmp_path: Path) -> None:
    card = mock_card(tmp_path, aliases=("a1", "a2"), dp_size=2, max_running=8, total_kv_blocks=100)
    card = msgspec.structs.replace(
        card,
        lora_adapters=[LoraCard(lora_id=3, lora_name="ad", source_path="/x", base_model="Qwen/Qwen3-0.6B")],
    )
    (plan,) = plan_registrations(card, DynamoConfig())
    assert plan.name == "Qwen/Qwen3-0.6B" and plan.aliases == ["a1", "a2"]
    assert plan.model_path == str(tmp_path) and plan.worker_type == "aggregated"
    assert plan.model_types == ["chat", "completions"] and plan.needs == []
    assert plan.kv_block_size == 16 and plan.context_length == 8192
    assert (plan.dp_start_rank, plan.dp_size) == (0, 2)
    assert plan.total_kv_blocks == 100 and plan.max_num_seqs == 8  # per DP rank
    assert plan.reasoning_parser == "qwen3" and plan.tool_call_parser == "hermes"
    assert [(lo.lora_name, lo.lora_id, lo.base_model_path) for lo in plan.loras] == [("ad", 3, str(tmp_path))]
    assert plan.bootstrap is None
    (plain,) = plan_registrations(card, DynamoConfig(parsers=False))
    assert plain.reasoning_parser is None and plain.tool_call_parser is None


def test_prefill_and_decode_roles(tmp_path: Path) -> None:
    (prefill,) = plan_registrations(mock_card(tmp_path, role="prefill"), DynamoConfig())
    assert prefill.worker_type == "prefill" and prefill.model_types == ["prefill"]
    assert prefill.reasoning_parser is None and prefill.bootstrap is None and prefill.needs == [["decode"]]
    (decode,) = plan_registrations(mock_card(tmp_path, role="decode"), DynamoConfig())
    assert decode.worker_type == "decode" and decode.model_types == ["chat", "completions"]
    assert decode.needs == [["prefill"]]
    (sglang,) = plan_registrations(mock_card(tmp_path, role="prefill", flavor="sglang"), DynamoConfig())
    assert sglang.bootstrap == ("127.0.0.1", 7000)  # client bootstrap: registered for Dynamo's prefill router


def test_tokenizer_source_must_be_a_local_directory(tmp_path: Path) -> None:
    card = mock_card()  # source: openengine-sidecar/mock-tokenizer-v1
    with pytest.raises(RegistrationError, match=r"not a local directory.*--dynamo-model-path"):
        plan_registrations(card, DynamoConfig())
    (plan,) = plan_registrations(card, DynamoConfig(model_path=str(tmp_path)))
    assert plan.model_path == str(tmp_path)
    with pytest.raises(RegistrationError, match="--dynamo-model-path"):
        plan_registrations(card, DynamoConfig(model_path=str(tmp_path / "missing")))


def test_component_defaults() -> None:
    assert DynamoConfig().endpoint_path("aggregated") == "dynamo.backend.generate"
    assert DynamoConfig().endpoint_path("prefill") == "dynamo.prefill.generate"
    assert DynamoConfig(namespace="ns", component="w").endpoint_path("prefill") == "ns.w.generate"
    with pytest.raises(DynamoConfigError):
        DynamoConfig(namespace="a.b").validate()


def _parse(args: list[str], env: dict[str, str] | None = None) -> Any:
    seen: dict[str, Any] = {}

    @click.command()
    @dynamo_options
    def cmd(**kw: Any) -> None:
        seen["config"] = dynamo_config(kw)

    result = CliRunner().invoke(cmd, args, env=env or {}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen["config"]


def test_flags_and_dynamo_environment() -> None:
    assert _parse([]) is None
    config = _parse(
        ["--dynamo"],
        env={"DYN_NAMESPACE": "prod", "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "nats"},
    )
    assert (config.namespace, config.discovery_backend, config.request_plane) == ("prod", "file", "nats")
    assert config.event_plane == "zmq" and config.kv_events is True
    config = _parse(
        ["--dynamo-namespace", "flag"],
        env={
            "OPENENGINE_SIDECAR_DYNAMO": "1",
            "DYN_NAMESPACE": "env",
            "OPENENGINE_SIDECAR_DYNAMO_NAMESPACE": "x",
        },
    )
    assert config.namespace == "flag"
    config = _parse(
        [],
        env={
            "OPENENGINE_SIDECAR_DYNAMO": "1",
            "OPENENGINE_SIDECAR_DYNAMO_NAMESPACE": "x",
            "DYN_NAMESPACE": "env",
        },
    )
    assert config.namespace == "x"  # the sidecar's own variable wins over DYN_*


def test_media_by_capability(tmp_path: Path) -> None:
    """Every card registers for URL pass-through; the plan records what the role accepts."""
    (agg,) = plan_registrations(mock_card(tmp_path, flavor="sglang"), DynamoConfig())
    assert agg.media == MediaPlan(["image", "video", "audio"], ["url", "data_uri", "raw_bytes"], 3)
    assert agg.media.describe() == "image, video, audio (URL pass-through; sources url, data_uri, raw_bytes)"
    (pd,) = plan_registrations(mock_card(tmp_path, flavor="trtllm", role="prefill"), DynamoConfig())
    assert pd.media.modalities == ["image", "video"]
    (text,) = plan_registrations(mock_card(tmp_path, text_only=True), DynamoConfig())
    assert text.media == MediaPlan([], [], None) and "refused" in text.media.describe()
    assert media_routing_note(text, 3) is None  # no images, nothing to route by


def test_media_routing_note(tmp_path: Path) -> None:
    (plan,) = plan_registrations(mock_card(tmp_path, flavor="vllm"), DynamoConfig())
    assert media_routing_note(plan, 3) == (logging.INFO, "media-aware KV routing on image token 3")
    level, message = media_routing_note(plan, 151655) or (0, "")
    assert (
        level == logging.WARNING and "fills token 151655" in message and "routing_image_token_id 3" in message
    )
    level, message = media_routing_note(plan, None) or (0, "")
    assert level == logging.INFO and "images route by their text prefix" in message
    blind = replace(plan.media, routing_image_token_id=None)
    note = media_routing_note(replace(plan, media=blind), 3)
    assert note is not None and "reports no routing_image_token_id" in note[1]
