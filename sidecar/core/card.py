"""The worker card: what the engine behind this sidecar is and can do, built from discovery.

Every struct here is a ``msgspec.Struct`` that encodes to JSON as is (``GET /v1/worker``,
the ``describe`` call and command), with lowerCamelCase names (``dpRanks``, ``kvConnector``)
as everywhere in the north protocol; Python attributes stay snake_case. Presence is kept: ``None`` means the engine did not
report the value (unknown), which is distinct from a reported ``False`` / ``0`` / ``[]``.
Enum values appear as short lower-case names (``"aggregated"``, ``"top_n"``,
``"json_schema"``, ``"image"``, ``"data_uri"``); enum values this build does not know
are treated as unspecified and dropped from lists (the schema's api.md: never an error).

:func:`build_card` is pure; :mod:`sidecar.core.discovery` feeds it. Things that make the
engine unservable are listed in :attr:`WorkerCard.problems` (discovery raises on them).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from sidecar import __version__
from sidecar.core.compat import CompatibilityCard, KnownReleaseCard, assess, known_release_cards
from sidecar.core.handoff_profiles import ProfileChoice, effective_profile
from sidecar.core.int64 import Int64, Uint64, json_decode, json_encoder, u64
from sidecar.core.load import LoadSnapshot, LoadStatus, LoadTracker, RankLoad
from sidecar.core.negotiation import NegotiatedRevision
from sidecar.json_types import JSONObject
from sidecar.openengine import pb
from sidecar.openengine.releases import CLIENT_REVISION, OLDEST_SERVER_REVISION, SCHEMA_RELEASE
from sidecar.version import source_commit

__all__ = [
    "ROLE_AGGREGATED",
    "ROLE_DECODE",
    "ROLE_PREFILL",
    "ROLE_UNSPECIFIED",
    "CapacityCard",
    "EndpointCard",
    "EngineCard",
    "GenerationCard",
    "GuidedDecodingCard",
    "KvConnectorCard",
    "KvEventSourceCard",
    "LoadSnapshot",
    "LoadStatus",
    "LoadTracker",
    "LogprobCard",
    "LoraCard",
    "ModelCard",
    "MultimodalCard",
    "ParallelismCard",
    "RankLoad",
    "ResolvedModel",
    "SidecarCard",
    "TokenizerCard",
    "WorkerCard",
    "build_card",
    "card_from_json",
    "card_to_json",
    "dp_ranks_of",
    "enum_name",
    "enum_names",
    "lora_cards",
    "model_card",
    "with_loras",
]

ROLE_UNSPECIFIED = "unspecified"
ROLE_AGGREGATED = "aggregated"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"

_E = TypeVar("_E", bound=enum.IntEnum)


def enum_name(cls: type[_E], value: int) -> str | None:
    """Short lower-case name of a known, non-zero enum value; ``None`` for 0 or unknown values."""
    member = cls._value2member_map_.get(int(value))
    if member is None or int(value) == 0:
        return None
    return member.name.lower()


def enum_names(cls: type[_E], values: Iterable[int]) -> list[str]:
    """Known non-zero values as short names, de-duplicated, in order (unknown items ignored)."""
    out: list[str] = []
    for v in values:
        name = enum_name(cls, v)
        if name is not None and name not in out:
            out.append(name)
    return out


def _opt_str(s: str) -> str | None:
    return s if s else None


def _struct_dict(s: pb.Struct | None) -> JSONObject | None:
    if s is None:
        return None
    d = s.to_dict()
    return d if isinstance(d, dict) else None


class _Card(msgspec.Struct, kw_only=True, rename="camel"):
    """Base of card structs: JSON field names in lowerCamelCase, like the rest of the north protocol.

    An ``extra`` field (the engine's free-form ``Struct``, a JSON object) is left untyped: msgspec
    cannot decode the recursive ``sidecar.json_types.JSONObject``."""


# --------------------------------------------------------------------------- engine & schema


class EngineCard(_Card):
    name: str
    version: str
    instance_id: str


class SidecarCard(_Card):
    """This build: its version and the schema it was generated from."""

    version: str = __version__
    #: Source commit of this build (:func:`sidecar.version.source_commit`).
    commit: str = msgspec.field(default_factory=source_commit)
    schema_release: str = SCHEMA_RELEASE
    client_revision: int = CLIENT_REVISION
    oldest_server_revision: int = OLDEST_SERVER_REVISION
    #: The schema releases this build was tested with (docs/COMPATIBILITY.md).
    known_releases: list[KnownReleaseCard] = msgspec.field(default_factory=known_release_cards)


class CapacityCard(_Card):
    kv_block_size: int | None
    total_kv_blocks: Uint64 | None
    max_running_requests: Uint64 | None
    max_batched_tokens: Uint64 | None
    max_loras: int | None


class ParallelismCard(_Card):
    tensor_parallel_size: int | None
    pipeline_parallel_size: int | None
    data_parallel_size: int | None
    data_parallel_rank: int | None
    data_parallel_start_rank: int | None
    decode_context_parallel_size: int | None


class EndpointCard(_Card):
    host: str
    port: int
    protocol: str = ""

    @classmethod
    def from_pb(cls, ep: pb.KvEndpoint) -> EndpointCard:
        return cls(host=ep.host, port=int(ep.port), protocol=ep.protocol)

    def same_address(self, host: str, port: int) -> bool:
        """Same host (case-insensitive) and port; protocol is not compared."""
        return self.host.casefold() == host.casefold() and self.port == port


class KvConnectorCard(_Card):
    enabled: bool | None
    transfer_backend: str
    handoff_profile: str
    local_endpoints: list[EndpointCard]
    supported_protocols: list[str]
    supports_remote_prefill: bool | None
    supports_decode_pull: bool | None
    supports_abort_cleanup: bool | None
    supports_drain: bool | None
    schema_version: int | None
    supports_client_bootstrap: bool | None
    #: Rendezvous endpoint a P/D client puts in ``KvBootstrap`` (first local endpoint) when
    #: the connector uses client bootstrap; ``None`` otherwise.
    bootstrap_endpoint: EndpointCard | None
    #: Where ``handoff_profile`` came from: ``advertised`` by the engine, ``configured``
    #: (``--handoff-profile``) or ``derived`` from engine name and transfer backend (an
    #: engine whose schema has no such field); ``None`` when there is none.
    handoff_profile_source: Literal["advertised", "configured", "derived"] | None = None

    @property
    def requires_session_profile(self) -> bool:
        """Sessions from this connector's engines name their profile (the engine advertises one)."""
        return self.handoff_profile_source == "advertised"

    @property
    def uses_client_bootstrap(self) -> bool:
        """Requests carry a client-created ``KvBootstrap`` (SGLang style); only when advertised true."""
        return self.supports_client_bootstrap is True


class KvEventSourceCard(_Card):
    transport: str
    endpoint: EndpointCard | None
    topic: str
    replay_endpoint: str | None
    data_parallel_rank: int | None
    encoding: str
    schema_version: int | None
    buffer_steps: int | None
    hwm: int | None
    max_queue_size: int | None


class LoraCard(_Card):
    lora_id: Int64
    lora_name: str
    source_path: str
    #: Served name of the model the adapter applies to (the first LoRA-capable model).
    base_model: str | None


# --------------------------------------------------------------------------- models


class TokenizerCard(_Card):
    source: str | None
    mode: str | None


class LogprobCard(_Card):
    supported: bool | None
    #: ``top_n`` / ``token_ids`` / ``all``.
    candidate_selection_modes: list[str]
    max_top_n: int | None


class GuidedDecodingCard(_Card):
    supported: bool | None
    #: ``json_schema`` / ``regex`` / ``ebnf_grammar`` / ``structural_tag`` / ``choice`` / ``json_object``.
    modes: list[str]


class GenerationCard(_Card):
    prompt_logprobs: LogprobCard | None
    output_logprobs: LogprobCard | None
    guided_decoding: GuidedDecodingCard | None
    max_num_sequences: int | None
    supports_priority: bool | None
    supports_stop_in_output: bool | None
    supports_cache_salt: bool | None
    supports_prefix_cache_bypass: bool | None


class MultimodalCard(_Card):
    #: ``image`` / ``video`` / ``audio`` accepted for normal (aggregated) generation.
    aggregate_modalities: list[str]
    #: Modalities accepted on the prefill/decode path (may be a strict subset).
    prefill_decode_modalities: list[str]
    #: ``url`` / ``data_uri`` / ``raw_bytes``.
    source_types: list[str]
    supports_per_request_media_options: bool | None
    #: Placeholder token for media-aware KV routing; ``None`` → no media-aware routing.
    routing_image_token_id: int | None


class ModelCard(_Card):
    served_model_name: str
    aliases: list[str]
    model_id: str
    tokenizer: TokenizerCard | None
    tokenizer_modes: list[str]
    max_context_length: int | None
    max_output_tokens: int | None
    supports_text_input: bool | None
    supports_token_ids_input: bool | None
    generation: GenerationCard | None
    supports_lora: bool | None
    supports_multimodal: bool | None
    multimodal: MultimodalCard | None
    reasoning_parser: str | None
    tool_call_parser: str | None
    extra: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        """Every name generation accepts for this model: the served name, then the aliases."""
        return [self.served_model_name, *[a for a in self.aliases if a != self.served_model_name]]


# --------------------------------------------------------------------------- the card


class ResolvedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A generation ``model`` name resolved against the card."""

    model: ModelCard
    #: Set when the name was a loaded adapter's name (``model`` is then its base model).
    lora: LoraCard | None = None
    via: Literal["name", "alias", "lora"] = "name"


class WorkerCard(_Card):
    engine: EngineCard
    schema: NegotiatedRevision
    #: ``aggregated`` / ``prefill`` / ``decode`` / ``unspecified``.
    role: str
    models: list[ModelCard]
    capacity: CapacityCard | None
    parallelism: ParallelismCard | None
    #: DP ranks this engine serves: ``data_parallel_start_rank`` … ``+ data_parallel_size - 1``
    #: (start 0 and size 1 when unreported).
    dp_ranks: list[int]
    kv_connector: KvConnectorCard | None
    #: ``GetKvEventSources``; ``None`` when the engine does not implement it.
    kv_event_sources: list[KvEventSourceCard] | None
    #: Where this sidecar republishes KV events (filled by the run command from its config).
    kv_publish_endpoints: list[str] = msgspec.field(default_factory=list)
    #: Loaded adapters; ``None`` when unknown (LoRA support unreported, or listing failed),
    #: ``[]`` when none are loaded or no model supports LoRA.
    lora_adapters: list[LoraCard] | None = None
    #: Every name a generation request may use: served names, aliases, loaded adapters.
    served_model_names: list[str] = msgspec.field(default_factory=list)
    #: Latest load (maintained by the run command's poller).
    load: LoadStatus | None = None
    sidecar: SidecarCard = msgspec.field(default_factory=SidecarCard)
    #: Reasons this engine cannot be served as discovered (empty when servable).
    problems: list[str] = msgspec.field(default_factory=list)
    extra: dict[str, Any] | None = None
    #: Is the engine's schema release one this build was tested with, and which schema
    #: features its answers carry (docs/COMPATIBILITY.md).
    compatibility: CompatibilityCard | None = None
    #: Served, with a caveat: one line each (``run`` logs each once as a WARNING).
    warnings: list[str] = msgspec.field(default_factory=list)

    def resolve(self, name: str) -> ResolvedModel | None:
        """Served name, then alias, then loaded adapter name → model entry; ``None`` if unknown."""
        for m in self.models:
            if m.served_model_name == name:
                return ResolvedModel(model=m, via="name")
        for m in self.models:
            if name in m.aliases:
                return ResolvedModel(model=m, via="alias")
        for lora in self.lora_adapters or ():
            if lora.lora_name == name and lora.base_model is not None:
                base = self.model_named(lora.base_model)
                if base is not None:
                    return ResolvedModel(model=base, lora=lora, via="lora")
        return None

    def model_named(self, served_name: str) -> ModelCard | None:
        return next((m for m in self.models if m.served_model_name == served_name), None)

    def lora_named(self, name: str) -> LoraCard | None:
        return next((a for a in self.lora_adapters or () if a.lora_name == name), None)


def card_to_json(card: WorkerCard) -> bytes:
    """JSON bytes of the card (``GET /v1/worker``), 64-bit integers as decimal strings."""
    return json_encoder.encode(card)


def card_from_json(data: bytes | str) -> WorkerCard:
    """The card back from its JSON (``card_to_json``, ``GET /v1/worker``, ``describe``)."""
    card: WorkerCard = json_decode(data, WorkerCard)
    return card


def dp_ranks_of(parallelism: pb.ParallelismInfo | None) -> list[int]:
    """``data_parallel_start_rank`` … ``+ data_parallel_size`` (defaults: start 0, size 1)."""
    if parallelism is None:
        return [0]
    start = parallelism.data_parallel_start_rank or 0
    size = parallelism.data_parallel_size or 1
    return list(range(start, start + size))


def _logprob_card(c: pb.LogprobCapabilities | None) -> LogprobCard | None:
    if c is None:
        return None
    return LogprobCard(
        supported=c.supported,
        candidate_selection_modes=enum_names(pb.CandidateTokenSelectionMode, c.candidate_selection_modes),
        max_top_n=c.max_top_n,
    )


def _generation_card(g: pb.GenerationCapabilities | None) -> GenerationCard | None:
    if g is None:
        return None
    guided = g.guided_decoding
    return GenerationCard(
        prompt_logprobs=_logprob_card(g.prompt_logprobs),
        output_logprobs=_logprob_card(g.output_logprobs),
        guided_decoding=None
        if guided is None
        else GuidedDecodingCard(
            supported=guided.supported, modes=enum_names(pb.GuidedDecodingMode, guided.modes)
        ),
        max_num_sequences=g.max_num_sequences,
        supports_priority=g.supports_priority,
        supports_stop_in_output=g.supports_stop_in_output,
        supports_cache_salt=g.supports_cache_salt,
        supports_prefix_cache_bypass=g.supports_prefix_cache_bypass,
    )


def _multimodal_card(m: pb.MultimodalCapabilities | None) -> MultimodalCard | None:
    if m is None:
        return None
    return MultimodalCard(
        aggregate_modalities=enum_names(pb.Modality, m.aggregate_modalities),
        prefill_decode_modalities=enum_names(pb.Modality, m.prefill_decode_modalities),
        source_types=enum_names(pb.MediaSourceType, m.source_types),
        supports_per_request_media_options=m.supports_per_request_media_options,
        routing_image_token_id=m.routing_image_token_id,
    )


def model_card(queried_name: str, mi: pb.ModelInfo) -> ModelCard:
    """A :class:`ModelCard` from ``GetModelInfo(queried_name)``."""
    served = mi.served_model_name or queried_name
    aliases: list[str] = []
    for a in mi.served_model_aliases:
        if a and a != served and a not in aliases:
            aliases.append(a)
    tok = mi.tokenizer
    return ModelCard(
        served_model_name=served,
        aliases=aliases,
        model_id=mi.model_id,
        tokenizer=None
        if tok is None
        else TokenizerCard(source=_opt_str(tok.source), mode=_opt_str(tok.mode)),
        tokenizer_modes=list(mi.tokenizer_modes),
        max_context_length=mi.max_context_length,
        max_output_tokens=mi.max_output_tokens,
        supports_text_input=mi.supports_text_input,
        supports_token_ids_input=mi.supports_token_ids_input,
        generation=_generation_card(mi.generation),
        supports_lora=mi.supports_lora,
        supports_multimodal=mi.supports_multimodal,
        multimodal=_multimodal_card(mi.multimodal_capabilities),
        reasoning_parser=_opt_str(mi.reasoning_parser),
        tool_call_parser=_opt_str(mi.tool_call_parser),
        extra=_struct_dict(mi.extra),
    )


def _connector_card(c: pb.KvConnectorInfo | None, choice: ProfileChoice) -> KvConnectorCard | None:
    if c is None:
        return None
    local = [EndpointCard.from_pb(e) for e in c.local_endpoints]
    bootstrap = local[0] if c.supports_client_bootstrap is True and local else None
    return KvConnectorCard(
        enabled=c.enabled,
        transfer_backend=c.transfer_backend,
        handoff_profile=choice.profile,
        handoff_profile_source=choice.source,
        local_endpoints=local,
        supported_protocols=list(c.supported_protocols),
        supports_remote_prefill=c.supports_remote_prefill,
        supports_decode_pull=c.supports_decode_pull,
        supports_abort_cleanup=c.supports_abort_cleanup,
        supports_drain=c.supports_drain,
        schema_version=c.schema_version,
        supports_client_bootstrap=c.supports_client_bootstrap,
        bootstrap_endpoint=bootstrap,
    )


def _source_card(s: pb.KvEventSource) -> KvEventSourceCard:
    return KvEventSourceCard(
        transport=s.transport,
        endpoint=None if s.endpoint_addr is None else EndpointCard.from_pb(s.endpoint_addr),
        topic=s.topic,
        replay_endpoint=_opt_str(s.replay_endpoint),
        data_parallel_rank=s.data_parallel_rank,
        encoding=s.encoding,
        schema_version=s.schema_version,
        buffer_steps=s.buffer_steps,
        hwm=s.hwm,
        max_queue_size=s.max_queue_size,
    )


def lora_cards(adapters: Iterable[pb.LoraAdapter], models: Sequence[ModelCard]) -> list[LoraCard]:
    """Adapters as card entries, attached to the first model advertising ``supports_lora``."""
    base = next((m.served_model_name for m in models if m.supports_lora is True), None)
    return [
        LoraCard(lora_id=Int64(a.lora_id), lora_name=a.lora_name, source_path=a.source_path, base_model=base)
        for a in adapters
    ]


def _served_names(models: Sequence[ModelCard], loras: Sequence[LoraCard] | None) -> list[str]:
    names: list[str] = []
    for m in models:
        names.extend(n for n in m.names if n not in names)
    for a in loras or ():
        if a.base_model is not None and a.lora_name not in names:
            names.append(a.lora_name)
    return names


def with_loras(card: WorkerCard, adapters: Iterable[pb.LoraAdapter] | None) -> WorkerCard:
    """A copy of ``card`` with the loaded adapters replaced (``None`` → unknown)."""
    loras = None if adapters is None else lora_cards(adapters, card.models)
    return msgspec.structs.replace(
        card, lora_adapters=loras, served_model_names=_served_names(card.models, loras)
    )


def _role_name(role: int) -> str:
    return enum_name(pb.EngineRole, role) or ROLE_UNSPECIFIED


def _problems(
    info: pb.ServerInfo,
    role: str,
    models: Sequence[ModelCard],
    kv: KvConnectorCard | None,
    choice: ProfileChoice,
) -> list[str]:
    problems: list[str] = []
    if role == ROLE_UNSPECIFIED:
        problems.append("engine reports no known role (engine_role unspecified)")
    if not models:
        problems.append("engine serves no models (supported_models is empty)")
    seen: dict[str, str] = {}
    for m in models:
        for n in m.names:
            if n in seen and seen[n] != m.served_model_name:
                problems.append(
                    f"model name {n!r} is claimed by both {seen[n]!r} and {m.served_model_name!r}"
                )
            seen.setdefault(n, m.served_model_name)
    p = info.parallelism
    if p is not None and p.data_parallel_size == 0:
        problems.append("engine reports data_parallel_size 0")
    if role in (ROLE_PREFILL, ROLE_DECODE):
        if kv is None or kv.enabled is False:
            problems.append(f"{role} engine advertises no enabled KV connector")
        elif choice.problem is not None:
            problems.append(choice.problem)
        elif role == ROLE_PREFILL and kv.uses_client_bootstrap and kv.bootstrap_endpoint is None:
            problems.append("prefill engine uses client bootstrap but advertises no local bootstrap endpoint")
    return problems


def build_card(
    info: pb.ServerInfo,
    negotiated: NegotiatedRevision,
    model_infos: Mapping[str, pb.ModelInfo],
    *,
    kv_event_sources: Sequence[pb.KvEventSource] | None = None,
    lora_adapters: Sequence[pb.LoraAdapter] | None = None,
    only_model: str | None = None,
    handoff_profile: str | None = None,
) -> WorkerCard:
    """Assemble a :class:`WorkerCard` from discovery answers (pure).

    ``model_infos`` maps each name passed to ``GetModelInfo`` to its answer, in
    ``supported_models`` order. ``only_model`` keeps just the model with that served
    name or alias (a problem is recorded if none matches). ``lora_adapters`` is
    ``None`` when adapters are unknown. ``handoff_profile`` is the operator's
    ``--handoff-profile`` (used when a P/D engine advertises none; see
    :mod:`sidecar.core.handoff_profiles`). Never raises for engine content: anything
    unservable is listed in ``problems``, what is served with a caveat in ``warnings``.
    """
    models = [model_card(name, mi) for name, mi in model_infos.items()]
    problems: list[str] = []
    if only_model is not None:
        chosen = [m for m in models if only_model in m.names]
        if not chosen:
            served = ", ".join(n for m in models for n in m.names) or "none"
            problems.append(f"model {only_model!r} is not served by this engine (serves: {served})")
        models = chosen[:1]
    role = _role_name(info.engine_role)
    warnings: list[str] = []
    negotiated, compatibility, compat_warning = assess(info, negotiated, model_infos)
    if compat_warning is not None:
        warnings.append(compat_warning)
    c = info.kv_connector
    choice = ProfileChoice(
        c.handoff_profile if c is not None else "", "advertised" if c and c.handoff_profile else None
    )
    if role in (ROLE_PREFILL, ROLE_DECODE) and c is not None and c.enabled is not False:
        choice = effective_profile(
            role, info.engine_name, c.handoff_profile, c.transfer_backend, handoff_profile
        )
        if choice.warning is not None:
            warnings.append(choice.warning)
    kv = _connector_card(c, choice)
    if not problems:
        problems.extend(_problems(info, role, models, kv, choice))
    loras = None if lora_adapters is None else lora_cards(lora_adapters, models)
    cap = info.capacity
    par = info.parallelism
    return WorkerCard(
        engine=EngineCard(name=info.engine_name, version=info.engine_version, instance_id=info.instance_id),
        schema=negotiated,
        role=role,
        models=models,
        capacity=None
        if cap is None
        else CapacityCard(
            kv_block_size=cap.kv_block_size,
            total_kv_blocks=u64(cap.total_kv_blocks),
            max_running_requests=u64(cap.max_running_requests),
            max_batched_tokens=u64(cap.max_batched_tokens),
            max_loras=cap.max_loras,
        ),
        parallelism=None
        if par is None
        else ParallelismCard(
            tensor_parallel_size=par.tensor_parallel_size,
            pipeline_parallel_size=par.pipeline_parallel_size,
            data_parallel_size=par.data_parallel_size,
            data_parallel_rank=par.data_parallel_rank,
            data_parallel_start_rank=par.data_parallel_start_rank,
            decode_context_parallel_size=par.decode_context_parallel_size,
        ),
        dp_ranks=dp_ranks_of(par),
        kv_connector=kv,
        kv_event_sources=None if kv_event_sources is None else [_source_card(s) for s in kv_event_sources],
        lora_adapters=loras,
        served_model_names=_served_names(models, loras),
        problems=problems,
        extra=_struct_dict(info.extra),
        compatibility=compatibility,
        warnings=warnings,
    )
