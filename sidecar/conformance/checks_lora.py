"""LoRA lifecycle: argument checks, disabled engines, load / list / generate / unload.

``lora.lifecycle`` needs an adapter the engine can really load: ``--lora-path`` (an
absolute directory as the engine sees it). It loads the adapter under a fresh name and
unloads it again before it ends.
"""

from __future__ import annotations

import os
import secrets

from sidecar.conformance.context import Context, describe_status
from sidecar.conformance.model import Skip, check, require
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError
from sidecar.openengine.releases import spec_url

LORA = spec_url("lora-lifecycle")


async def _load(ctx: Context, adapter: pb.LoraAdapter) -> str:
    """``OK`` / ``OK already_loaded`` or ``status <NAME>``."""
    try:
        reply = await ctx.client().load_lora(pb.LoadLoraRequest(adapter=adapter))
    except EngineStatusError as err:
        return f"status {err.status}"
    return "OK already_loaded" if reply.already_loaded else "OK"


async def _unload(ctx: Context, name: str) -> str:
    try:
        await ctx.client().unload_lora(pb.UnloadLoraRequest(lora_name=name))
    except EngineStatusError as err:
        return f"status {err.status}"
    return "OK"


async def _supports(ctx: Context) -> bool | None:
    return (await ctx.model_info()).supports_lora


#: The path of the invalid LoadLora calls: never the real adapter, so a lenient engine loads nothing.
BOGUS_PATH = "/conformance/no-such-adapter"


@check(
    "lora.errors",
    rule="LoadLora refuses a non-positive lora_id, an empty name and a relative source_path with "
    "INVALID_ARGUMENT; UnloadLora of an unknown adapter answers NOT_FOUND; a LoRA-disabled engine answers "
    "FAILED_PRECONDITION",
    ref=LORA,
)
async def errors(ctx: Context) -> str | None:
    supported = await _supports(ctx)
    name = f"conformance-{ctx.run_id}-bad"
    if supported is None:
        raise Skip("ModelInfo does not report supports_lora")
    if supported is False:
        outcome = await _load(ctx, pb.LoraAdapter(lora_id=1, lora_name=name, source_path=BOGUS_PATH))
        require(
            outcome in ("status FAILED_PRECONDITION", "status UNIMPLEMENTED"),
            f"LoadLora on an engine without LoRA support answered {outcome}, not FAILED_PRECONDITION",
        )
        return f"LoRA disabled: {outcome}"
    cases = [
        ("lora_id 0", pb.LoraAdapter(lora_id=0, lora_name=name, source_path=BOGUS_PATH)),
        ("lora_id -5", pb.LoraAdapter(lora_id=-5, lora_name=name, source_path=BOGUS_PATH)),
        ("empty lora_name", pb.LoraAdapter(lora_id=7, lora_name="", source_path=BOGUS_PATH)),
        (
            "relative source_path",
            pb.LoraAdapter(lora_id=7, lora_name=name, source_path="adapters/conformance"),
        ),
    ]
    problems = []
    for what, adapter in cases:
        outcome = await _load(ctx, adapter)
        if outcome.startswith("OK"):
            await _unload(ctx, adapter.lora_name)
        if outcome != "status INVALID_ARGUMENT":
            problems.append(f"LoadLora with {what} answered {outcome}, not INVALID_ARGUMENT")
    outcome = await _unload(ctx, f"conformance-{ctx.run_id}-never-loaded")
    if outcome != "status NOT_FOUND":
        problems.append(f"UnloadLora of an unknown adapter answered {outcome}, not NOT_FOUND")
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(cases) + 1} refusals"


def _listed(reply: pb.ListLorasResponse, adapter: pb.LoraAdapter) -> bool:
    return any(
        a.lora_name == adapter.lora_name
        and a.lora_id == adapter.lora_id
        and a.source_path == adapter.source_path
        for a in reply.adapters
    )


@check(
    "lora.lifecycle",
    rule="LoadLora loads, the same (id, name, path) again is idempotent (already_loaded), a conflict is "
    "ALREADY_EXISTS, ListLoras shows it, Generate accepts lora_name, UnloadLora removes it, unloading "
    "again is NOT_FOUND",
    ref=LORA,
)
async def lifecycle(ctx: Context) -> str | None:
    if await _supports(ctx) is not True:
        raise Skip("the model does not advertise supports_lora")
    path = ctx.options.lora_path
    if not path:
        raise Skip("needs --lora-path: an adapter directory the engine can load")
    if not os.path.isabs(path):
        raise Skip(f"--lora-path {path!r} is not absolute")
    client = ctx.client()
    name = f"conformance-{ctx.run_id}"
    adapter = pb.LoraAdapter(lora_id=100_000 + secrets.randbelow(900_000), lora_name=name, source_path=path)
    problems = []
    outcome = await _load(ctx, adapter)
    require(outcome == "OK", f"LoadLora of {path!r} answered {outcome}")
    try:
        again = await _load(ctx, adapter)
        if again != "OK already_loaded":
            problems.append(f"loading the same adapter again answered {again}, not OK with already_loaded")
        conflict = pb.LoraAdapter(lora_id=adapter.lora_id + 1, lora_name=name, source_path=path)
        clash = await _load(ctx, conflict)
        if clash != "status ALREADY_EXISTS":
            problems.append(
                f"loading name {name!r} with another lora_id answered {clash}, not ALREADY_EXISTS"
            )
        if not _listed(await client.list_loras(), adapter):
            problems.append("ListLoras does not list the loaded adapter")
        if await ctx.standalone() == "aggregated":
            rec = await ctx.record(await ctx.request("lora", max_tokens=2, lora_name=name), timeout=15.0)
            if rec.refused:
                problems.append(f"Generate with lora_name {name!r} was refused: {describe_status(rec)}")
    finally:
        gone = await _unload(ctx, name)
    if gone != "OK":
        problems.append(f"UnloadLora answered {gone}")
    if _listed(await client.list_loras(), adapter):
        problems.append("ListLoras still lists the adapter after UnloadLora")
    twice = await _unload(ctx, name)
    if twice != "status NOT_FOUND":
        problems.append(f"unloading it again answered {twice}, not NOT_FOUND")
    require(not problems, problems[0] if problems else "", problems)
    return f"adapter {name} (id {adapter.lora_id})"
