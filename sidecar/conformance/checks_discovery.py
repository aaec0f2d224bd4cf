"""Discovery checks: revision and release, presence, model names, KV sources, connector vs role."""

from __future__ import annotations

from typing import Any

from sidecar.conformance.context import Context
from sidecar.conformance.kv_watch import kv_sources
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.core.handoff_profiles import derive_profile
from sidecar.core.negotiation import RELEASE_FORMS, numbering_of
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError
from sidecar.openengine.releases import (
    CLIENT_REVISIONS,
    OLDEST_SERVER_REVISION,
    find_known,
    parse_release,
    spec_url,
)

IDENTITY = spec_url("server-identity-deployment-capacity-and-engine-roles")
MODELS = spec_url("model-identity-and-capabilities")
KV = spec_url("kv-connector-and-kv-events")
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0"})
TRANSPORTS = frozenset({"grpc", "zmq"})
ENCODINGS = frozenset({"protobuf", "msgpack"})


@check(
    "discovery.revision",
    rule="schema_revision is non-zero and supported; minimum_client_revision is populated, not above "
    "schema_revision, and admits this client in the engine's revision numbering (original: revision 3, "
    "whose servers advertise 1; restarted: revision 1)",
    ref=IDENTITY,
)
async def revision(ctx: Context) -> str | None:
    info = await ctx.server_info()
    rev, minimum = info.schema_revision, info.minimum_client_revision
    release = parse_release(info.schema_release)
    numbering = numbering_of(release, info) if release is not None else "original"
    client = CLIENT_REVISIONS[numbering]
    problems = []
    if rev == 0:
        problems.append("schema_revision is 0 (invalid: zero is not a revision)")
    elif rev < OLDEST_SERVER_REVISION:
        problems.append(
            f"schema_revision {rev} is older than the oldest supported ({OLDEST_SERVER_REVISION})"
        )
    if minimum == 0:
        problems.append("minimum_client_revision is 0 (not populated)")
    elif rev and minimum > rev:
        problems.append(f"minimum_client_revision {minimum} is above schema_revision {rev}")
    elif minimum > client:
        problems.append(
            f"minimum_client_revision {minimum} rejects revision-{client} clients ({numbering} numbering) "
            "such as this suite"
        )
    if numbering == "original" and rev == 3 and minimum not in (0, 1):
        problems.append(f"revision-3 servers advertise minimum_client_revision 1, not {minimum}")
    require(not problems, problems[0] if problems else "", problems)
    return f"schema_revision {rev}, minimum_client_revision {minimum} ({numbering} numbering)"


@check(
    "discovery.release",
    rule="schema_release is immutable: a 40-hex source commit, a 32-hex Buf Schema Registry commit "
    "(alone or as buf.build/<owner>/<module>:<commit>) or a signed release tag (not main, a module label, "
    "unreleased, a short SHA or empty)",
    ref=IDENTITY,
)
async def release(ctx: Context) -> str | None:
    value = (await ctx.server_info()).schema_release
    parsed = parse_release(value)
    require(parsed is not None, f"schema_release {value!r} is not an immutable release ({RELEASE_FORMS})")
    assert parsed is not None
    known = find_known(parsed)
    return f"{parsed.form} {parsed}" + (
        f" (known release {known.name})" if known else " (untested by this build)"
    )


def _at_least_one(where: str, values: dict[str, Any]) -> list[str]:
    return [
        f"{where}.{name} is present and {value}: a value that cannot be zero must be absent when unknown"
        for name, value in values.items()
        if value is not None and value < 1
    ]


def _capability(where: str, cap: Any) -> list[str]:
    if cap is not None and cap.supported is None:
        return [f"{where} is present but `supported` is absent (absent message = unreported)"]
    return []


@check(
    "discovery.presence",
    rule="absent = unknown, present zero/false = a reported value: scalars that cannot be zero are absent "
    "when unknown; capability messages report `supported`; reported load is consistent",
    ref=IDENTITY,
)
async def presence(ctx: Context) -> str | None:
    info = await ctx.server_info()
    problems: list[str] = []
    par = info.parallelism
    if par is not None:
        problems += _at_least_one(
            "parallelism",
            {
                "tensor_parallel_size": par.tensor_parallel_size,
                "pipeline_parallel_size": par.pipeline_parallel_size,
                "data_parallel_size": par.data_parallel_size,
                "decode_context_parallel_size": par.decode_context_parallel_size,
            },
        )
    cap = info.capacity
    if cap is not None:
        problems += _at_least_one(
            "capacity",
            {
                "kv_block_size": cap.kv_block_size,
                "total_kv_blocks": cap.total_kv_blocks,
                "max_running_requests": cap.max_running_requests,
                "max_batched_tokens": cap.max_batched_tokens,
            },
        )
    mi = await ctx.model_info()
    problems += _at_least_one(
        "ModelInfo", {"max_context_length": mi.max_context_length, "max_output_tokens": mi.max_output_tokens}
    )
    gen = mi.generation
    if gen is not None:
        problems += _at_least_one("generation", {"max_num_sequences": gen.max_num_sequences})
        problems += _capability("generation.prompt_logprobs", gen.prompt_logprobs)
        problems += _capability("generation.output_logprobs", gen.output_logprobs)
        problems += _capability("generation.guided_decoding", gen.guided_decoding)
    try:
        load = await ctx.client().get_load(include_per_rank=True)
    except EngineStatusError:
        load = pb.LoadInfo()
    used, total = load.used_kv_blocks, load.total_kv_blocks
    if used is not None and total is not None and used > total:
        problems.append(f"LoadInfo.used_kv_blocks {used} > total_kv_blocks {total}")
    require(not problems, problems[0] if problems else "", problems)
    return None


async def _accepts(ctx: Context, name: str) -> str | None:
    """None if a one-token Generate naming ``name`` is accepted, else why not."""
    req = await ctx.request("alias", max_tokens=1)
    req.model = name
    rec = await ctx.record(req, timeout=10.0)
    if rec.refused:
        return f"Generate with model {name!r} was refused: status {rec.status} ({rec.status_message})"
    return None


@check(
    "discovery.model-names",
    rule="every supported model and alias resolves with GetModelInfo to the same served_model_name; "
    "aliases are accepted by Generate",
    ref=MODELS,
)
async def model_names(ctx: Context) -> str | None:
    info = await ctx.server_info()
    client = ctx.client()
    problems: list[str] = []
    primary: dict[str, pb.ModelInfo] = {}
    for name in info.supported_models:
        try:
            mi = await client.get_model_info(name)
        except EngineStatusError as err:
            problems.append(f"GetModelInfo({name!r}) for a supported model answered {err.status}")
            continue
        if not mi.served_model_name:
            problems.append(f"GetModelInfo({name!r}): served_model_name is empty")
        elif name != mi.served_model_name and name not in mi.served_model_aliases:
            problems.append(
                f"GetModelInfo({name!r}) answers served_model_name {mi.served_model_name!r} "
                f"without {name!r} among its aliases {list(mi.served_model_aliases)}"
            )
        primary[name] = mi
    standalone = await ctx.standalone() == "aggregated"
    for name, mi in primary.items():
        if mi.served_model_name in mi.served_model_aliases:
            problems.append(f"{name!r}: served_model_name is repeated among its aliases")
        for alias in list(mi.served_model_aliases)[:4]:
            try:
                other = await client.get_model_info(alias)
            except EngineStatusError as err:
                problems.append(
                    f"alias {alias!r} of {mi.served_model_name!r}: GetModelInfo answered {err.status}"
                )
                continue
            if other.served_model_name != mi.served_model_name:
                problems.append(
                    f"alias {alias!r} resolves to {other.served_model_name!r}, not {mi.served_model_name!r}"
                )
            elif standalone and (why := await _accepts(ctx, alias)):
                problems.append(f"alias {alias!r}: {why}")
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(primary)} model(s), {sum(len(m.served_model_aliases) for m in primary.values())} alias(es)"


@check(
    "discovery.unknown-model",
    rule="GetModelInfo for a model the server does not serve answers NOT_FOUND",
    ref=MODELS,
)
async def unknown_model(ctx: Context) -> str | None:
    name = f"conformance-no-such-model-{ctx.run_id}"
    try:
        mi = await ctx.client().get_model_info(name)
    except EngineStatusError as err:
        require(err.status == "NOT_FOUND", f"GetModelInfo({name!r}) answered {err.status}, not NOT_FOUND")
        return None
    raise Fail(
        f"GetModelInfo({name!r}) answered OK (served_model_name {mi.served_model_name!r}), not NOT_FOUND"
    )


def _replay_host(endpoint: str) -> str | None:
    rest = endpoint.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else None


@check(
    "discovery.kv-sources-routable",
    rule="every KV event source names a known transport and encoding and a connectable host:port "
    "(never a bind wildcard), replay endpoint included",
    ref=KV,
)
async def kv_sources_routable(ctx: Context) -> str | None:
    sources = await kv_sources(ctx)
    if not sources:
        raise Skip("the engine advertises no KV event sources")
    problems = []
    for s in sources:
        where = f"source for rank {s.data_parallel_rank} ({s.transport or 'no transport'})"
        if s.transport not in TRANSPORTS:
            problems.append(f"{where}: transport {s.transport!r} is not grpc or zmq")
        if s.encoding and s.encoding not in ENCODINGS:
            problems.append(f"{where}: encoding {s.encoding!r} is not protobuf or msgpack")
        ep = s.endpoint_addr
        if ep is None:
            problems.append(f"{where}: no endpoint_addr")
        else:
            if ep.host.strip("[]").lower() in WILDCARDS:
                problems.append(f"{where}: endpoint_addr host {ep.host!r} is a bind wildcard, not routable")
            if not 0 < ep.port < 65536:
                problems.append(f"{where}: endpoint_addr port {ep.port} is not a connectable port")
        if s.replay_endpoint:
            host = _replay_host(s.replay_endpoint)
            if host is None or host.lower() in WILDCARDS:
                problems.append(f"{where}: replay_endpoint {s.replay_endpoint!r} is not a routable host:port")
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(sources)} source(s)"


@check(
    "discovery.kv-sources-ranks",
    rule="KV event sources are rank-complete: every data-parallel rank of the server has a source "
    "attributed to it, and none names a rank the server does not have",
    ref=KV,
)
async def kv_sources_ranks(ctx: Context) -> str | None:
    sources = await kv_sources(ctx)
    if not sources:
        raise Skip("the engine advertises no KV event sources")
    ranks = await ctx.dp_ranks()
    problems = []
    seen = {s.data_parallel_rank for s in sources}
    if None in seen and len(ranks) > 1:
        problems.append(f"a source has no data_parallel_rank on a server with {len(ranks)} DP ranks")
    seen.discard(None)
    if not seen and len(ranks) == 1:
        seen = set(ranks)
    missing = [r for r in ranks if r not in seen]
    if missing:
        problems.append(f"no KV event source for DP rank(s) {missing} (server ranks {ranks})")
    extra = sorted(r for r in seen if r is not None and r not in ranks)
    if extra:
        problems.append(f"source(s) for rank(s) {extra} the server does not have (ranks {ranks})")
    require(not problems, problems[0] if problems else "", problems)
    return f"ranks {ranks}"


@check(
    "discovery.connector-role",
    rule="the role is known and the KV connector fits it: prefill and decode engines advertise an "
    "enabled connector with a handoff profile (schemas without the field: one derives from engine name and "
    "transfer backend) and transfer backend (client-bootstrap prefill: a local endpoint); Health agrees "
    "with the advertised role",
    ref=IDENTITY,
)
async def connector_role(ctx: Context) -> str | None:
    info = await ctx.server_info()
    role = info.engine_role
    problems = []
    notes: list[str] = []
    if role not in (pb.EngineRole.AGGREGATED, pb.EngineRole.PREFILL, pb.EngineRole.DECODE):
        raise Fail(f"engine_role is {role!r}: not a role a client can route to")
    kv = info.kv_connector
    name = pb.EngineRole(role).name.lower()
    if role != pb.EngineRole.AGGREGATED:
        if kv is None or kv.enabled is not True:
            problems.append(f"{name} engine: kv_connector is {'absent' if kv is None else 'not enabled'}")
        else:
            if not kv.handoff_profile:
                acceptable, why = _missing_profile(info, kv)
                (notes if acceptable else problems).append(f"{name} engine: {why}")
            if not kv.transfer_backend:
                problems.append(f"{name} engine: kv_connector.transfer_backend is empty")
            if role == pb.EngineRole.PREFILL and kv.supports_client_bootstrap:
                eps = [e for e in kv.local_endpoints if e.host and e.port]
                if not eps:
                    problems.append("client-bootstrap prefill engine advertises no local bootstrap endpoint")
    health = await ctx.client().health(pb.HealthRequest(role=role))
    for hc in health.checks:
        if hc.name == "role" and hc.state == pb.HealthState.NOT_READY:
            problems.append(f"Health asked about role {name} reports the role check NOT_READY: {hc.message}")
    require(not problems, problems[0] if problems else "", problems)
    return "; ".join([name, *notes])


def _missing_profile(info: pb.ServerInfo, kv: pb.KvConnectorInfo) -> tuple[bool, str]:
    """Whether an empty ``handoff_profile`` is acceptable (a schema without the field whose
    profile derives), and why."""
    release = parse_release(info.schema_release)
    known = find_known(release) if release is not None else None
    derived = derive_profile(info.engine_name, kv.transfer_backend)
    if known is not None and "handoffProfile" in known.features:
        return False, f"kv_connector.handoff_profile is empty although schema {known.name} defines it"
    if derived is None:
        return False, (
            f"kv_connector.handoff_profile is empty and none derives from engine {info.engine_name!r} with "
            f"transfer backend {kv.transfer_backend!r}"
        )
    schema = f"schema {known.name}" if known is not None else "schema (untested release)"
    return True, f"{schema} has no handoff_profile: derived {derived}"
