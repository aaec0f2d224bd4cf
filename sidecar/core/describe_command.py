"""``openengine-sidecar describe``: discover an engine and print its worker card, without serving.

Exit status: 0 when the card was printed and the engine is servable; 1 with a one-line
reason on stderr when the engine is unreachable, too slow, fails negotiation or
discovery — or when the card was printed but lists problems that would stop ``run``.
"""

from __future__ import annotations

from collections.abc import Iterable

import click
import msgspec
import trio

from sidecar.cli_common import CommandError
from sidecar.cli_options import ENGINE_ADDRESS, SECONDS, command_option
from sidecar.core.card import EndpointCard, LogprobCard, ModelCard, WorkerCard, card_to_json
from sidecar.core.discovery import discover
from sidecar.core.errors import DiscoveryError, NegotiationError
from sidecar.core.schema_options import schema_options_for
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineClientError, EngineConfigError, EngineUnavailable

__all__ = ["describe", "describe_engine", "format_card"]


class DescribeFailed(Exception):
    """Discovery could not produce a card (``str(err)`` is the one-line reason)."""


async def describe_engine(
    engine: str,
    *,
    model: str | None = None,
    connect_timeout: float = 5.0,
    timeout: float = 30.0,
    expected_engine: str | None = None,
    expected_release: str | None = None,
    require_known_release: bool = False,
    handoff_profile: str | None = None,
) -> WorkerCard:
    """Connect, discover (non-strict) and return the card; :class:`DescribeFailed` otherwise.

    The first call (``GetServerInfo``) is bounded by ``connect_timeout``, the whole discovery
    by ``timeout``.
    """
    try:
        async with open_engine_client(engine) as client:
            with trio.fail_after(timeout):
                try:
                    with trio.fail_after(connect_timeout):
                        info = await client.get_server_info()
                except trio.TooSlowError:
                    raise DescribeFailed(
                        f"engine at {engine} did not answer within {connect_timeout:g} s"
                    ) from None
                return await discover(
                    client,
                    info=info,
                    model=model,
                    strict=False,
                    expected_engine=expected_engine,
                    expected_release=expected_release,
                    require_known_release=require_known_release,
                    handoff_profile=handoff_profile,
                )
    except trio.TooSlowError:
        raise DescribeFailed(f"discovery of {engine} did not finish within {timeout:g} s") from None
    except NegotiationError as err:
        raise DescribeFailed(f"negotiation with {engine} failed: {err}") from err
    except DiscoveryError as err:
        raise DescribeFailed(f"discovery of {engine} failed: {err}") from err
    except EngineConfigError as err:
        raise DescribeFailed(f"invalid engine address {engine!r}: {err}") from err
    except EngineUnavailable as err:
        raise DescribeFailed(f"engine at {engine} is unreachable: {err}") from err
    except EngineClientError as err:
        raise DescribeFailed(f"engine at {engine}: {err}") from err


# --------------------------------------------------------------------------- readable form


def _v(value: object) -> str:
    if value is None:
        return "unknown"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if isinstance(value, list):
        return ", ".join(str(x) for x in value) if value else "none"
    return str(value)


def _ep(ep: EndpointCard) -> str:
    return f"{ep.protocol + '://' if ep.protocol else ''}{ep.host}:{ep.port}"


def _logprobs(cap: LogprobCard | None) -> str:
    if cap is None:
        return "unknown"
    if cap.supported is not True:
        return _v(cap.supported)
    return f"yes (modes: {_v(cap.candidate_selection_modes)}, max top-n: {_v(cap.max_top_n)})"


def _model_lines(m: ModelCard) -> Iterable[str]:
    aliases = f" (aliases: {', '.join(m.aliases)})" if m.aliases else ""
    yield f"Model         {m.served_model_name}{aliases}"
    yield f"  model id          {m.model_id or 'unknown'}"
    tok = m.tokenizer
    tok_s = "unknown" if tok is None else f"{tok.source or 'unknown'} (mode {tok.mode or 'unknown'})"
    yield f"  tokenizer         {tok_s}; modes: {_v(m.tokenizer_modes)}"
    yield f"  limits            context {_v(m.max_context_length)}, output {_v(m.max_output_tokens)}"
    yield f"  input             text {_v(m.supports_text_input)}, token ids {_v(m.supports_token_ids_input)}"
    g = m.generation
    if g is None:
        yield "  generation        unknown"
    else:
        yield f"  prompt logprobs   {_logprobs(g.prompt_logprobs)}"
        yield f"  output logprobs   {_logprobs(g.output_logprobs)}"
        gd = g.guided_decoding
        gd_s = "unknown" if gd is None else (f"yes ({_v(gd.modes)})" if gd.supported else _v(gd.supported))
        yield f"  guided decoding   {gd_s}"
        yield (
            f"  options           max sequences {_v(g.max_num_sequences)}, priority {_v(g.supports_priority)}, "
            f"stop in output {_v(g.supports_stop_in_output)}, cache salt {_v(g.supports_cache_salt)}, "
            f"prefix-cache bypass {_v(g.supports_prefix_cache_bypass)}"
        )
    yield f"  LoRA              {_v(m.supports_lora)}"
    mm = m.multimodal
    if mm is None:
        yield f"  multimodal        {_v(m.supports_multimodal)} (no capabilities reported)"
    else:
        yield (
            f"  multimodal        aggregated: {_v(mm.aggregate_modalities)}; "
            f"prefill/decode: {_v(mm.prefill_decode_modalities)}; sources: {_v(mm.source_types)}"
        )
        yield (
            f"                    per-request options {_v(mm.supports_per_request_media_options)}, "
            f"routing image token {_v(mm.routing_image_token_id)}"
        )
    if m.reasoning_parser or m.tool_call_parser:
        yield f"  parsers           reasoning {_v(m.reasoning_parser)}, tool calls {_v(m.tool_call_parser)}"


def format_card(card: WorkerCard) -> str:
    """The card as a human-readable block (``unknown`` marks unreported values)."""
    e, s = card.engine, card.schema
    lines = [
        f"Engine        {e.name} {e.version} (instance {e.instance_id or 'unknown'})",
        f"Role          {card.role}",
        f"Schema        revision {s.revision} (server {s.server_revision}, minimum client "
        f"{s.minimum_client_revision}), release {s.release} ({s.release_kind})",
        f"Sidecar       {card.sidecar.version}, built for revision {card.sidecar.client_revision}, "
        f"release {card.sidecar.schema_release}",
    ]
    compat = card.compatibility
    if compat is not None:
        lines.append(f"Compatibility {compat.status}: {compat.note}")
    p = card.parallelism
    par = (
        "unknown"
        if p is None
        else f"tp {_v(p.tensor_parallel_size)}, pp {_v(p.pipeline_parallel_size)}, dp {_v(p.data_parallel_size)}"
        + (f", dcp {p.decode_context_parallel_size}" if p.decode_context_parallel_size is not None else "")
    )
    lines.append(f"Parallelism   {par}; DP ranks {_v(card.dp_ranks)}")
    c = card.capacity
    if c is None:
        lines.append("Capacity      unknown")
    else:
        lines.append(
            f"Capacity      KV block {_v(c.kv_block_size)} tokens, {_v(c.total_kv_blocks)} blocks, "
            f"{_v(c.max_running_requests)} running, {_v(c.max_batched_tokens)} batched tokens, "
            f"{_v(c.max_loras)} LoRAs"
        )
    kv = card.kv_connector
    if kv is None:
        lines.append("KV connector  none reported")
    else:
        source = (
            f" ({kv.handoff_profile_source})"
            if kv.handoff_profile_source in ("derived", "configured")
            else ""
        )
        lines.append(
            f"KV connector  {kv.transfer_backend or 'unknown backend'}, profile {kv.handoff_profile or 'none'}"
            f"{source}, enabled {_v(kv.enabled)}, client bootstrap {_v(kv.supports_client_bootstrap)}"
        )
        if kv.local_endpoints:
            lines.append(f"              local endpoints: {', '.join(_ep(x) for x in kv.local_endpoints)}")
        if kv.bootstrap_endpoint is not None:
            lines.append(f"              bootstrap endpoint: {_ep(kv.bootstrap_endpoint)}")
    if card.kv_event_sources is None:
        lines.append("KV events     unknown (GetKvEventSources unavailable)")
    elif not card.kv_event_sources:
        lines.append("KV events     none")
    for src in card.kv_event_sources or ():
        where = _ep(src.endpoint) if src.endpoint else "no endpoint"
        lines.append(
            f"KV events     {src.transport} {where} rank {_v(src.data_parallel_rank)} {src.encoding}"
            + (f", replay {src.replay_endpoint}" if src.replay_endpoint else "")
        )
    if card.kv_publish_endpoints:
        lines.append(f"KV publish    {', '.join(card.kv_publish_endpoints)}")
    if card.lora_adapters is None:
        lines.append("LoRA adapters unknown")
    elif not card.lora_adapters:
        lines.append("LoRA adapters none")
    for a in card.lora_adapters or ():
        lines.append(f"LoRA adapter  {a.lora_name} (id {a.lora_id}) {a.source_path} on {_v(a.base_model)}")
    for m in card.models:
        lines.extend(_model_lines(m))
    lines.append(f"Served names  {_v(card.served_model_names)}")
    for warning in card.warnings:
        lines.append(f"WARNING       {warning}")
    for problem in card.problems:
        lines.append(f"PROBLEM       {problem}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command


option = command_option("describe")


@click.command("describe")
@option(
    "--engine",
    type=ENGINE_ADDRESS,
    required=True,
    help="Engine address: host:port, http://host:port or unix:///path.",
)
@option("--json", "as_json", is_flag=True, default=False, help="Print the worker card as JSON.")
@option("--model", default=None, help="Describe only this model (served name or alias).")
@option(
    "--connect-timeout", type=SECONDS, default=5.0, show_default=True, help="Seconds to wait for the engine."
)
@option("--timeout", type=SECONDS, default=30.0, show_default=True, help="Seconds for the whole discovery.")
@option("--expected-engine", default=None, help="Fail unless the engine reports this name.")
@schema_options_for("describe")
def describe(
    engine: str,
    as_json: bool,
    model: str | None,
    connect_timeout: float,
    timeout: float,
    expected_engine: str | None,
    expected_schema_release: str | None,
    require_known_release: bool,
    handoff_profile: str | None,
) -> None:
    """Connect to an engine, negotiate, discover, and print its worker card."""

    async def main() -> WorkerCard | DescribeFailed:
        try:
            return await describe_engine(
                engine,
                model=model,
                connect_timeout=connect_timeout,
                timeout=timeout,
                expected_engine=expected_engine,
                expected_release=expected_schema_release,
                require_known_release=require_known_release,
                handoff_profile=handoff_profile,
            )
        except DescribeFailed as err:
            return err

    card = trio.run(main)
    if isinstance(card, DescribeFailed):
        raise CommandError(str(card))
    if as_json:
        click.echo(msgspec.json.format(card_to_json(card), indent=2).decode())
    else:
        click.echo(format_card(card))
    if card.problems:
        raise CommandError(f"the sidecar would not serve this engine: {card.problems[0]}")
