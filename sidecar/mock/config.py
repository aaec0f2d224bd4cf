"""Configuration of one simulated engine (what ``mock-engine``'s flags produce)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sidecar.mock.faults import Faults
from sidecar.mock.schemas import RELEASE_FORMS, SCHEMAS

Flavor = Literal["trtllm", "vllm", "sglang"]
Role = Literal["aggregated", "prefill", "decode"]
KvEventsMode = Literal["auto", "zmq", "grpc", "none"]
OrphanPolicy = Literal["hold", "release"]

FLAVORS: tuple[str, ...] = ("trtllm", "vllm", "sglang")
#: Schemas a simulated engine can be built on (``sidecar.mock.schemas``).
SCHEMA_NAMES: tuple[str, ...] = tuple(SCHEMAS)
ROLES: tuple[str, ...] = ("aggregated", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a simulated engine needs to start.

    Capacities are per data-parallel rank (as in vLLM, where each DP rank is an engine
    core): ``max_running`` running + ``max_queue`` queued requests and
    ``total_kv_blocks`` blocks per rank; discovery reports the whole server's totals.
    """

    flavor: Flavor = "vllm"
    role: Role = "aggregated"
    listen: str = "127.0.0.1:0"
    model: str = ""  # "" = the flavour's default model name
    aliases: tuple[str, ...] = ()
    tokenizer_source: str = ""  # "" = the mock tokenizer's id (TokenizerInfo.source)
    text_only: bool = False  # advertise no multimodal capabilities, refuse every media item
    dp_size: int = 1
    tp_size: int = 1
    kv_block_size: int = 16
    total_kv_blocks: int = 4096
    max_running: int = 64
    max_queue: int = 256
    max_context_length: int = 8192
    max_output_tokens: int = 4096
    token_delay_ms: float = 0.0
    first_token_delay_ms: float = 0.0
    kv_events: KvEventsMode = "auto"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # 0 = ephemeral ports
    kv_event_format: Literal["map", "array"] = "map"
    kv_buffer_steps: int = 10_000
    kv_log: str = ""  # "" = no ground-truth log file
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    kv_session_timeout_s: float = 60.0
    bootstrap_timeout_s: float = 30.0
    enable_lora: bool = True
    max_loras: int = 4
    check_lora_path: bool = True
    orphans: OrphanPolicy = "release"
    orphan_timeout_s: float = 30.0
    fast: bool = False
    seed: int = 0
    instance_id: str = ""  # "" = derived from flavour, role and listen address
    engine_version: str = ""  # "" = the flavour's default
    faults: Faults = field(default_factory=Faults)
    schema: str = "a66ff6f"  # the OpenEngine schema the engine is built on (SCHEMA_NAMES)
    release_form: str = "source"  # how it advertises its release (RELEASE_FORMS)

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.schema not in SCHEMA_NAMES:
            raise ValueError(f"schema must be one of {SCHEMA_NAMES}, got {self.schema!r}")
        if self.release_form not in RELEASE_FORMS:
            raise ValueError(f"release_form must be one of {RELEASE_FORMS}, got {self.release_form!r}")
        for name in ("dp_size", "tp_size", "kv_block_size", "total_kv_blocks", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")

    @property
    def token_delay_s(self) -> float:
        return 0.0 if self.fast else self.token_delay_ms / 1000.0

    @property
    def first_token_delay_s(self) -> float:
        return 0.0 if self.fast else self.first_token_delay_ms / 1000.0

    @property
    def kv_events_transport(self) -> str:
        """``zmq``, ``grpc`` or ``none`` after resolving ``auto`` per flavour."""
        if self.kv_events != "auto":
            return self.kv_events
        return "grpc" if self.flavor == "trtllm" else "zmq"
