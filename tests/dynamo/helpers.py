"""Worker cards for the Dynamo plane's unit tests (built from the mock engine's discovery)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from sidecar.core.card import WorkerCard, build_card
from sidecar.core.negotiation import negotiate
from sidecar.mock import flavors
from sidecar.mock.config import EngineConfig
from sidecar.openengine import pb


def mock_card(tmp_path: Path | None = None, **fields: Any) -> WorkerCard:
    """The card a sidecar discovers in front of ``mock-engine`` with ``fields`` (EngineConfig)."""
    if tmp_path is not None:
        fields.setdefault("tokenizer_source", str(tmp_path))
    config = EngineConfig(**fields)
    endpoints = (
        [pb.KvEndpoint(host="127.0.0.1", port=7000, protocol="tcp")] if config.role != "aggregated" else []
    )
    info = flavors.server_info(config, instance="mock-test", endpoints=endpoints)
    name = flavors.model_name(config)
    card = build_card(info, negotiate(info), {name: flavors.model_info(config)}, lora_adapters=[])
    return msgspec.structs.replace(card, kv_publish_endpoints=["tcp://127.0.0.1:5600"])
