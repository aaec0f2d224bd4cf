"""Discovery: ask the engine what it is and build the :class:`~sidecar.core.card.WorkerCard`.

Sequence: ``GetServerInfo`` → :func:`~sidecar.core.negotiation.negotiate` →
``GetModelInfo`` for each supported model → ``GetKvEventSources`` (UNIMPLEMENTED or any
other non-OK status → unknown, ``None``) → ``ListLoras`` when a model advertises
``supports_lora`` (a non-OK status → unknown) → :func:`~sidecar.core.card.build_card`.

Errors: :class:`~sidecar.core.errors.NegotiationError` (revision/release/assertions, an
untested release under ``require_known_release``) and
:class:`~sidecar.core.errors.DiscoveryError` (a failing ``GetModelInfo``, or card
problems when ``strict``) are fatal and not retryable. Transport failures propagate as
the OpenEngine layer's ``EngineUnavailable`` (retryable: call :func:`discover` again).
Deadlines: the caller's (``trio.fail_after`` around the call bounds every RPC).
Cancellation: nothing is held between calls; cancelling leaves no state behind.
"""

from __future__ import annotations

import logging
from typing import Protocol

from sidecar.core.card import WorkerCard, build_card
from sidecar.core.compat import require_known
from sidecar.core.errors import DiscoveryError
from sidecar.core.negotiation import negotiate
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineMessageTooLarge, EngineStatusError

__all__ = ["DiscoveryClient", "compare_cards", "discover", "fetch_loras"]

log = logging.getLogger(__name__)


class DiscoveryClient(Protocol):
    """The part of ``EngineClient`` discovery uses (tests pass fakes)."""

    async def get_server_info(self) -> pb.ServerInfo: ...

    async def get_model_info(self, model: str = "") -> pb.ModelInfo: ...

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest | None = None
    ) -> pb.GetKvEventSourcesResponse: ...

    async def list_loras(self) -> pb.ListLorasResponse: ...


async def _kv_event_sources(client: DiscoveryClient) -> list[pb.KvEventSource] | None:
    try:
        resp = await client.get_kv_event_sources(pb.GetKvEventSourcesRequest())
    except EngineStatusError as err:
        if err.status != "UNIMPLEMENTED":
            log.warning("GetKvEventSources failed (%s); KV event sources unknown", err)
        return None
    return list(resp.sources)


async def fetch_loras(client: DiscoveryClient) -> list[pb.LoraAdapter] | None:
    """``ListLoras``; ``None`` (unknown) when the engine answers a non-OK status or an answer
    over the size bound (``--engine-max-answer-bytes``)."""
    try:
        resp = await client.list_loras()
    except (EngineStatusError, EngineMessageTooLarge) as err:
        log.warning("ListLoras failed (%s); loaded adapters unknown", err)
        return None
    return list(resp.adapters)


async def discover(
    client: DiscoveryClient,
    *,
    expected_engine: str | None = None,
    expected_release: str | None = None,
    model: str | None = None,
    strict: bool = True,
    info: pb.ServerInfo | None = None,
    handoff_profile: str | None = None,
    require_known_release: bool = False,
) -> WorkerCard:
    """Run discovery against ``client`` and return the worker card.

    ``model`` keeps only that model (served name or alias). With ``strict`` (the
    default, used by ``run``), a card with problems raises ``DiscoveryError``; with
    ``strict=False`` (``describe``) the card is returned with its ``problems`` filled.
    ``info`` reuses a ``ServerInfo`` the caller already fetched (no second call).
    ``handoff_profile`` is the operator's ``--handoff-profile``; ``require_known_release``
    raises :class:`NegotiationError` for a release this build was not tested with.
    """
    if info is None:
        info = await client.get_server_info()
    negotiated = negotiate(info, expected_engine=expected_engine, expected_release=expected_release)
    names: list[str] = []
    for name in info.supported_models:
        if name and name not in names:
            names.append(name)
    model_infos: dict[str, pb.ModelInfo] = {}
    for name in names:
        try:
            model_infos[name] = await client.get_model_info(name)
        except EngineStatusError as err:
            raise DiscoveryError(f"GetModelInfo({name!r}) failed for an advertised model: {err}") from err
    sources = await _kv_event_sources(client)
    lora_flags = [mi.supports_lora for mi in model_infos.values()]
    loras: list[pb.LoraAdapter] | None
    if any(flag is True for flag in lora_flags):
        loras = await fetch_loras(client)
    elif lora_flags and all(flag is False for flag in lora_flags):
        loras = []
    else:
        loras = None
    card = build_card(
        info,
        negotiated,
        model_infos,
        kv_event_sources=sources,
        lora_adapters=loras,
        only_model=model,
        handoff_profile=handoff_profile,
    )
    if require_known_release and card.compatibility is not None:
        require_known(info.engine_name, card.compatibility)
    if strict and card.problems:
        more = f" (and {len(card.problems) - 1} more)" if len(card.problems) > 1 else ""
        raise DiscoveryError(f"cannot serve {info.engine_name or 'the engine'}: {card.problems[0]}{more}")
    return card


def compare_cards(old: WorkerCard, new: WorkerCard) -> list[str]:
    """What changed between two discoveries that would make serving ``new`` as ``old`` wrong.

    Returns one-line reasons (empty = compatible): engine name, role, the served models
    (served name, aliases, ``model_id``), DP ranks, and the KV connector's handoff profile,
    transfer backend and bootstrap mode. A new instance id or engine version alone is a
    restart, not a change.
    """
    reasons: list[str] = []
    if old.engine.name != new.engine.name:
        reasons.append(f"engine changed from {old.engine.name!r} to {new.engine.name!r}")
    if old.role != new.role:
        reasons.append(f"engine role changed from {old.role} to {new.role}")
    old_models = {m.served_model_name: m for m in old.models}
    new_models = {m.served_model_name: m for m in new.models}
    for name in old_models.keys() - new_models.keys():
        reasons.append(f"model {name!r} is no longer served")
    for name in new_models.keys() - old_models.keys():
        reasons.append(f"model {name!r} is newly served")
    for name in old_models.keys() & new_models.keys():
        a, b = old_models[name], new_models[name]
        if a.model_id != b.model_id:
            reasons.append(f"model {name!r} changed from {a.model_id!r} to {b.model_id!r}")
        if sorted(a.aliases) != sorted(b.aliases):
            reasons.append(f"aliases of model {name!r} changed from {a.aliases} to {b.aliases}")
    if old.dp_ranks != new.dp_ranks:
        reasons.append(f"DP ranks changed from {old.dp_ranks} to {new.dp_ranks}")
    ok, nk = old.kv_connector, new.kv_connector
    old_kv = None if ok is None else (ok.handoff_profile, ok.transfer_backend, ok.uses_client_bootstrap)
    new_kv = None if nk is None else (nk.handoff_profile, nk.transfer_backend, nk.uses_client_bootstrap)
    if old_kv != new_kv:
        reasons.append(f"KV connector changed from {old_kv} to {new_kv}")
    return sorted(reasons)
