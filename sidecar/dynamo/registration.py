"""What this worker registers with Dynamo, derived from the worker card (pure, no Dynamo import).

One :class:`ModelRegistration` per served model, and one :class:`LoraRegistration` per
loaded adapter:

- token input (Dynamo's frontend tokenizes with the model directory's tokenizer and
  sends token ids; the engine must accept them);
- model types ``chat`` + ``completions``; a prefill engine registers the ``prefill`` marker
  type only (no OpenAI surface), as Dynamo's own prefill workers do;
- worker type from the role (``aggregated`` / ``prefill`` / ``decode``; a decode worker
  needs a prefill peer, a prefill worker a decode peer);
- served name and aliases; KV block size; per-DP-rank capacity (``total_kv_blocks`` and
  ``max_running_requests`` divided by the DP size); DP start rank and size; context length;
  the engine's tool-call and reasoning parsers;
- the tokenizer source as the model path: it must be a local directory (the frontend reads
  ``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` there) — otherwise
  :class:`RegistrationError`, naming ``--dynamo-model-path``;
- a client-bootstrap (SGLang-style) prefill engine registers its bootstrap endpoint, so
  Dynamo's prefill router hands both sides the same ``bootstrap_info``;
- media by capability: the modalities the card accepts for this role and the sources it
  advertises are recorded (``media``); every model registers WITHOUT a media decoder or
  fetcher, so the frontend passes each URL or data URI through in ``multi_modal_data``
  (``media.py``: an OpenEngine engine fetches and decodes media itself, and a
  frontend-decoded tensor has no ``MediaItem`` form). A text-only card registers the same
  way; its sidecar refuses every request carrying media. :func:`media_routing_note` says
  whether Dynamo's media-aware KV routing will match the engine's KV events.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from sidecar.core.card import ROLE_AGGREGATED, ROLE_DECODE, ROLE_PREFILL, ModelCard, WorkerCard
from sidecar.dynamo.config import DynamoConfig

__all__ = [
    "LoraRegistration",
    "MediaPlan",
    "ModelRegistration",
    "RegistrationError",
    "media_routing_note",
    "plan_registrations",
]

_ROLES = (ROLE_AGGREGATED, ROLE_PREFILL, ROLE_DECODE)
#: Peer worker types each role depends on (Dynamo's model-serving readiness), as its workers do.
_NEEDS = {ROLE_PREFILL: [[ROLE_DECODE]], ROLE_DECODE: [[ROLE_PREFILL]]}


class RegistrationError(Exception):
    """The card cannot be registered with Dynamo (one line for the operator)."""


@dataclass(frozen=True)
class LoraRegistration:
    lora_name: str
    lora_id: int
    #: The base model's directory (Dynamo registers the adapter against its base model card).
    base_model_path: str
    base_model: str


@dataclass(frozen=True)
class MediaPlan:
    """What media the registered worker takes (URL pass-through; see the module doc)."""

    #: Modalities accepted for this worker's role (``image`` / ``video`` / ``audio``).
    modalities: list[str]
    #: Sources the engine advertises (``url`` / ``data_uri`` / ``raw_bytes``).
    sources: list[str]
    #: The engine's image placeholder for media-aware KV routing (``None``: none).
    routing_image_token_id: int | None

    def describe(self) -> str:
        if not self.modalities:
            return "text only (requests with media are refused)"
        return f"{', '.join(self.modalities)} (URL pass-through; sources {', '.join(self.sources) or 'none'})"


@dataclass(frozen=True)
class ModelRegistration:
    name: str
    model_path: str
    worker_type: str  # aggregated / prefill / decode
    #: ``["chat", "completions"]``, or ``["prefill"]`` for a prefill engine.
    model_types: list[str]
    aliases: list[str] = field(default_factory=list)
    kv_block_size: int | None = None
    context_length: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dp_start_rank: int = 0
    dp_size: int = 1
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    #: Client-bootstrap prefill: the engine's rendezvous endpoint (host, port).
    bootstrap: tuple[str, int] | None = None
    #: DNF of peer worker types this worker needs (decode: ``[["prefill"]]``, prefill: ``[["decode"]]``).
    needs: list[list[str]] = field(default_factory=list)
    loras: list[LoraRegistration] = field(default_factory=list)
    media: MediaPlan = field(default_factory=lambda: MediaPlan([], [], None))


def _media_plan(model: ModelCard, role: str) -> MediaPlan:
    mm = model.multimodal
    if mm is None:
        return MediaPlan([], [], None)
    modalities = mm.aggregate_modalities if role == ROLE_AGGREGATED else mm.prefill_decode_modalities
    return MediaPlan(list(modalities), list(mm.source_types), mm.routing_image_token_id)


def media_routing_note(plan: ModelRegistration, frontend_token_id: int | None) -> tuple[int, str] | None:
    """(log level, message) on whether Dynamo's media-aware KV routing matches this engine.

    ``frontend_token_id``: the placeholder Dynamo's frontend fills with pad values for this
    model directory (Dynamo's ``resolve_routing_image_token_id``; ``None``: it does not build
    media-aware routing for this model). ``None`` when the worker takes no images.
    """
    media = plan.media
    if "image" not in media.modalities:
        return None
    engine = media.routing_image_token_id
    if engine is None:
        return logging.INFO, "the engine reports no routing_image_token_id: images route by their text prefix"
    if frontend_token_id is None:
        return logging.INFO, (
            f"Dynamo does not build media-aware routing for the model directory {plan.model_path} "
            "(it knows the image token counts of some model families only): images route by their text prefix"
        )
    if frontend_token_id != engine:
        return logging.WARNING, (
            f"Dynamo's frontend fills token {frontend_token_id} per image but the engine reports "
            f"routing_image_token_id {engine}: image blocks will not match; media-aware routing is lost"
        )
    return logging.INFO, f"media-aware KV routing on image token {engine}"


def _per_rank(total: int | None, ranks: int) -> int | None:
    if total is None:
        return None
    return max(1, total // max(1, ranks)) if total else 0


def _model_path(model: ModelCard, config: DynamoConfig) -> str:
    path = config.model_path
    if path is None:
        source = model.tokenizer.source if model.tokenizer is not None else None
        if not source:
            raise RegistrationError(
                f"model {model.served_model_name!r}: the engine reports no tokenizer source; Dynamo's "
                "frontend tokenizes with a local model directory: give --dynamo-model-path DIR"
            )
        path = source
        what = "tokenizer source"
    else:
        what = "--dynamo-model-path"
    if not os.path.isdir(path):
        raise RegistrationError(
            f"model {model.served_model_name!r}: {what} {path!r} is not a local directory; Dynamo's "
            "frontend tokenizes with the model directory's tokenizer: give --dynamo-model-path DIR "
            "(a directory with tokenizer.json, tokenizer_config.json and config.json)"
        )
    return os.path.abspath(path)


def plan_registrations(card: WorkerCard, config: DynamoConfig) -> list[ModelRegistration]:
    """The registrations of ``card`` (see the module doc); raises :class:`RegistrationError`."""
    role = card.role
    if role not in _ROLES:
        raise RegistrationError(f"engine role {role!r} cannot be registered with Dynamo")
    if not card.models:
        raise RegistrationError("the engine serves no models")
    if config.model_path is not None and len(card.models) > 1:
        raise RegistrationError("--dynamo-model-path needs an engine serving exactly one model")
    cap = card.capacity
    ranks = card.dp_ranks or [0]
    dp_size = len(ranks)
    bootstrap = None
    kv = card.kv_connector
    if role == ROLE_PREFILL and kv is not None and kv.uses_client_bootstrap and kv.bootstrap_endpoint:
        bootstrap = (kv.bootstrap_endpoint.host, kv.bootstrap_endpoint.port)
    plans = []
    for model in card.models:
        if model.supports_token_ids_input is False:
            raise RegistrationError(
                f"model {model.served_model_name!r} does not accept token ids; Dynamo sends token ids"
            )
        path = _model_path(model, config)
        loras = [
            LoraRegistration(
                lora_name=a.lora_name, lora_id=a.lora_id, base_model_path=path, base_model=a.base_model
            )
            for a in card.lora_adapters or ()
            if a.base_model == model.served_model_name
        ]
        parsers = config.parsers and role != ROLE_PREFILL
        plans.append(
            ModelRegistration(
                name=model.served_model_name,
                model_path=path,
                worker_type=role,
                model_types=["prefill"] if role == ROLE_PREFILL else ["chat", "completions"],
                aliases=list(model.aliases),
                kv_block_size=cap.kv_block_size if cap else None,
                context_length=model.max_context_length,
                total_kv_blocks=_per_rank(cap.total_kv_blocks if cap else None, dp_size),
                max_num_seqs=_per_rank(cap.max_running_requests if cap else None, dp_size),
                max_num_batched_tokens=cap.max_batched_tokens if cap else None,
                dp_start_rank=ranks[0],
                dp_size=dp_size,
                tool_call_parser=model.tool_call_parser if parsers else None,
                reasoning_parser=model.reasoning_parser if parsers else None,
                bootstrap=bootstrap,
                needs=_NEEDS.get(role, []),
                loras=loras,
                media=_media_plan(model, role),
            )
        )
    return plans
