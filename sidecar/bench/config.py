"""Sizes of every scenario: the full run (the figures docs/PERFORMANCE.md reports) and ``--quick`` (seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

SCENARIOS = ("relay", "short", "burst", "latency", "cancel", "scale", "kv", "drain", "dynamo")
#: Run only when asked (``--scenarios vllm``): needs the ``vllm`` extra and starts real vLLM.
OPTIONAL_SCENARIOS = ("vllm", "openai")


@dataclass(frozen=True)
class BenchConfig:
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    # relay throughput: streams x tokens, rounds of (sidecar, EngineClient, grpcio)
    streams: int = 256
    tokens: int = 500
    rounds: int = 3
    connections: int = 8  # WebSocket connections of the load generator
    encoding: str = "msgpack"
    coalesce: bool = True  # ask for coalesced ``events`` frames (used if the sidecar offers them)
    # short requests (1-token completions): concurrent clients for a duration
    short_concurrency: int = 64
    short_seconds: float = 5.0
    short_rounds: int = 3
    # burst: N streams released at once (each size), per client kind; rounds alternate the kinds
    burst_sizes: tuple[int, ...] = (64, 256)
    burst_tokens: int = 16
    burst_bursts: int = 3  # bursts per worker run (each after the previous one ended)
    burst_rounds: int = 3
    # latency: paced streams (tokens/s each), started at random offsets within ramp_s
    latency_streams: int = 64
    latency_rate: float = 30.0
    latency_tokens: int = 150
    latency_ramp_s: float = 1.0
    # cancellation storm
    cancel_streams: int = 1000
    cancel_ramp_s: float = 3.0  # phase 1: open them all (each then has a token)
    cancel_window_s: float = 4.0  # phase 2: each cancelled at a random point of this window (250/s)
    cancel_token_delay_ms: float = 500.0  # 2 tokens/s per stream: a storm, not a relay overload
    cancel_disconnect_group: int = 5
    # scale: idle streams (engine fault stall=1) per point, each on a fresh sidecar
    scale_points: tuple[int, ...] = (1000, 10000)
    scale_streams_per_connection: int = 1000
    # KV bridge (scripts/bench-kvbridge's processes): blast batches, then one paced phase
    kv_batches: int = 20000
    kv_rate: int = 6250  # batches/s of 16 events: 100k events/s
    kv_seconds: float = 3.0
    # drain: streams in flight at SIGTERM, grace (--drain-timeout) shorter than the streams
    drain_streams: int = 256
    drain_grace_s: float = 2.0
    # dynamo: streamed completions through Dynamo's frontend to each worker, rounds alternating
    dynamo_requests: int = 256
    dynamo_concurrency: int = 16
    dynamo_tokens: int = 64
    dynamo_rounds: int = 3
    # vllm (optional): greedy streams through the sidecar and direct, in front of real vLLM
    vllm_streams: int = 8
    vllm_tokens: int = 128
    vllm_prompt_tokens: int = 64
    vllm_rounds: int = 3
    # openai (optional): streamed completions through the OpenAI front vs EngineClient (paced
    # engine), and with the vllm extra the front before vllm-engine vs vllm serve
    openai_tokens: int = 200
    openai_requests: int = 3  # per client, one after the other
    openai_rounds: int = 3
    openai_token_delay_ms: float = 10.0
    openai_vllm: bool = True  # also vs vllm serve when the vllm extra is installed
    openai_vllm_tokens: int = 64
    # the engine
    engine_stream_limit: int = 65536
    engine_lean_load: bool = True  # the engine's GetLoad attributes as small as a real engine's
    profile_dir: Path | None = None
    sidecar_command: tuple[str, ...] = ()  # () = python -m sidecar
    out: Path = field(default_factory=lambda: Path("bench-results") / "bench-results.json")

    def quick_sizes(self) -> BenchConfig:
        """Tiny sizes: every scenario in seconds (the test suite's smoke run)."""
        return replace(
            self,
            quick=True,
            streams=8,
            tokens=50,
            rounds=1,
            connections=2,
            short_concurrency=4,
            short_seconds=0.5,
            short_rounds=1,
            latency_streams=4,
            latency_rate=50.0,
            latency_tokens=10,
            latency_ramp_s=0.1,
            cancel_streams=20,
            cancel_ramp_s=0.2,
            cancel_window_s=0.3,
            cancel_token_delay_ms=20.0,
            cancel_disconnect_group=2,
            scale_points=(50,),
            scale_streams_per_connection=25,
            kv_batches=300,
            kv_rate=1000,
            kv_seconds=0.3,
            drain_streams=8,
            drain_grace_s=0.5,
            burst_sizes=(8,),
            burst_tokens=4,
            burst_bursts=1,
            burst_rounds=1,
            dynamo_requests=16,
            dynamo_concurrency=4,
            dynamo_tokens=8,
            dynamo_rounds=1,
            vllm_streams=2,
            vllm_tokens=16,
            vllm_rounds=1,
            openai_tokens=10,
            openai_requests=1,
            openai_rounds=1,
            openai_token_delay_ms=1.0,
            openai_vllm=False,
        )

    def with_rounds(self, rounds: int) -> BenchConfig:
        """The same sizes with ``rounds`` rounds of each client in every scenario (``--rounds``)."""
        return replace(
            self,
            rounds=rounds,
            short_rounds=rounds,
            burst_rounds=rounds,
            dynamo_rounds=rounds,
            vllm_rounds=rounds,
            openai_rounds=rounds,
        )
