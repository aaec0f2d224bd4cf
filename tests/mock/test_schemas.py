"""Simulated engines built on each OpenEngine schema (``mock-engine --schema``, ``--release-form``).

What each schema defines is written here from upstream (ai-dynamo/openengine at the commit),
independently of the table the mock and the sidecar share, and checked on the wire.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import trio

from sidecar.mock.schemas import BSR_MODULE, synthetic_bsr_commit
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError

from .helpers import collect, engine, kind, request, token_ids

# schema -> (source commit, schema_revision, fields defined: the set of features below)
UPSTREAM = {
    "a66ff6f": (
        "a66ff6f73a65e262a7c3edd5ea6fd0d8701d402f",
        3,
        {"drain", "profile", "bootstrap", "tokenizer", "mm"},
    ),
    "4def7c5": ("4def7c50b05e0674a0c3b26917399155535966e4", 1, set()),
    "31be5db": ("31be5dbeaaf5737a008abe9d29f0c07f3e80a4ef", 1, {"profile", "bootstrap", "tokenizer", "mm"}),
}
REQ: dict[str, Any] = {
    "prompt": " ba be bi" * 12,
    "stopping": pb.StoppingOptions(max_tokens=6, ignore_eos=True),
}


@pytest.mark.parametrize("schema", list(UPSTREAM))
@pytest.mark.parametrize("form", ["source", "bsr", "bsr-ref"])
async def test_discovery_advertises_the_schema(aio_loop: Any, schema: str, form: str) -> None:
    commit, revision, defined = UPSTREAM[schema]
    async with engine(flavor="sglang", role="prefill", schema=schema, release_form=form) as (_, client):
        with trio.fail_after(10):
            info = await client.get_server_info()
            mi = await client.get_model_info()
    assert (info.schema_revision, info.minimum_client_revision) == (revision, 1)
    bsr = synthetic_bsr_commit(commit)
    assert re.fullmatch(r"[0-9a-f]{32}", bsr)
    assert info.schema_release == {"source": commit, "bsr": bsr, "bsr-ref": f"{BSR_MODULE}:{bsr}"}[form]
    kv = info.kv_connector
    assert kv is not None and kv.enabled and kv.transfer_backend == "mooncake"
    assert bool(kv.handoff_profile) is ("profile" in defined)  # KvConnectorInfo field 10
    assert (kv.supports_client_bootstrap is not None) is ("bootstrap" in defined)  # field 11
    assert (mi.tokenizer is not None) is ("tokenizer" in defined)  # ModelInfo field 11
    assert (mi.multimodal_capabilities is not None) is ("mm" in defined)  # ModelInfo field 29


@pytest.mark.parametrize("schema", list(UPSTREAM))
async def test_drain_only_where_the_schema_has_it(aio_loop: Any, schema: str) -> None:
    async with engine(schema=schema) as (_, client):
        request_ = pb.DrainRequest(stop_accepting_new_requests=False, deadline_ms=0)
        with trio.fail_after(10):
            try:
                async with client.drain(request_) as stream:
                    states = [ev.state async for ev in stream]
            except EngineStatusError as err:
                states = [err.status]
    if "drain" in UPSTREAM[schema][2]:
        assert states[-1] == pb.DrainState.COMPLETE
    else:
        assert states == ["UNIMPLEMENTED"]


async def test_legacy_engine_cannot_see_media_options(aio_loop: Any) -> None:
    """``media_options`` (field 14) is unknown to 4def7c5: ignored, not refused like a66ff6f's
    vLLM refuses an unknown option key."""
    opts = pb.Struct.from_dict({"image": {"no_such_option": 1}})
    for schema, refused in (("a66ff6f", True), ("4def7c5", False)):
        async with engine(flavor="vllm", schema=schema) as (_, client):
            try:
                events = await collect(client, request("m", media_options=opts))
                outcome = kind(events[-1])
            except EngineStatusError as err:
                outcome = err.status
        assert outcome == ("INVALID_ARGUMENT" if refused else "finished"), schema


@pytest.mark.parametrize(
    ("flavor", "schema"), [("sglang", "4def7c5"), ("vllm", "4def7c5"), ("trtllm", "31be5db")]
)
async def test_pd_handoff_within_a_schema(aio_loop: Any, flavor: str, schema: str) -> None:
    """Context-first on every schema without client bootstrap (SGLang on 4def7c5 too): the
    prefill's session names no profile where the schema has none, and the decode takes it."""
    async with (
        engine(flavor=flavor, role="aggregated", schema=schema) as (_, agg),
        engine(flavor=flavor, role="prefill", schema=schema) as (_, pre),
        engine(flavor=flavor, role="decode", schema=schema) as (_, dec),
    ):
        reference = token_ids(await collect(agg, request("a", **REQ)))
        events = await collect(pre, request("p", **REQ))
        assert kind(events[-1]) == "prefill_ready"
        session = events[-1].prefill_ready.kv_session  # type: ignore[union-attr]
        assert session is not None and session.bootstrap is None
        assert bool(session.handoff_profile) is ("profile" in UPSTREAM[schema][2])
        decode = request("d", **REQ)
        decode.kv = pb.KvOptions(session=session)
        assert token_ids(await collect(dec, decode)) == reference


async def test_legacy_sglang_prefill_refuses_a_bootstrap(aio_loop: Any) -> None:
    """4def7c5 has no KvBootstrap: a session on a prefill request is a role mismatch there."""
    boot = pb.KvBootstrap(endpoint=pb.KvEndpoint(host="127.0.0.1", port=1), room_id=7)
    req = request("p", **REQ)
    req.kv = pb.KvOptions(session=pb.KvSessionRef(bootstrap=boot))
    async with engine(flavor="sglang", role="prefill", schema="4def7c5") as (_, client):
        with pytest.raises(EngineStatusError) as exc:
            await collect(client, req)
    assert exc.value.status == "FAILED_PRECONDITION" and "role mismatch" in exc.value.message


def test_config_and_cli_refuse_unknown_schemas() -> None:
    from click.testing import CliRunner

    from sidecar.mock.command import mock_engine
    from sidecar.mock.config import EngineConfig

    with pytest.raises(ValueError, match="schema must be one of"):
        EngineConfig(schema="main")
    with pytest.raises(ValueError, match="release_form must be one of"):
        EngineConfig(release_form="tag")
    result = CliRunner().invoke(mock_engine, ["--schema", "main"])
    assert result.exit_code == 2 and "'main' is not one of" in result.output
