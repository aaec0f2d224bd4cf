"""Release forms, the table of known releases, revision numberings and compatibility (I/O-free)."""

from __future__ import annotations

import pytest

from sidecar.core.card import build_card
from sidecar.core.compat import assess, require_known
from sidecar.core.errors import NegotiationError
from sidecar.core.handoff_profiles import derive_profile, effective_profile, parse_profile
from sidecar.core.negotiation import negotiate, parse_release
from sidecar.openengine import pb
from sidecar.openengine.releases import FEATURES, KNOWN_RELEASES, find_known
from sidecar.openengine.releases import parse_release as parse

A66 = "a66ff6f73a65e262a7c3edd5ea6fd0d8701d402f"
DEF = "4def7c50b05e0674a0c3b26917399155535966e4"
B31 = "31be5dbeaaf5737a008abe9d29f0c07f3e80a4ef"
BSR = "334e348dc5854e4b99a3a0d25d8ff376"
OTHER = "0123456789abcdef0123456789abcdef01234567"


def info(
    rev: int = 1,
    minimum: int = 1,
    release: str = B31,
    *,
    role: pb.EngineRole = pb.EngineRole.AGGREGATED,
    kv: pb.KvConnectorInfo | None = None,
    name: str = "vllm",
) -> pb.ServerInfo:
    return pb.ServerInfo(
        engine_name=name,
        engine_role=role,
        supported_models=["m"],
        schema_revision=rev,
        minimum_client_revision=minimum,
        schema_release=release,
        kv_connector=kv,
    )


# (advertised, kind, normalized)
FORMS = [
    (A66, "commit", A66),
    (A66.upper(), "commit", A66),
    (BSR, "bsr", BSR),
    (BSR.upper(), "bsr", BSR),
    (f"buf.build/openengine/openengine:{BSR}", "bsr", f"buf.build/openengine/openengine:{BSR}"),
    (f"buf.build/openengine/openengine:{BSR.upper()}", "bsr", f"buf.build/openengine/openengine:{BSR}"),
    (f"bsr.example.com/team/openengine-fork:{BSR}", "bsr", f"bsr.example.com/team/openengine-fork:{BSR}"),
    ("v0.1.0", "tag", "v0.1.0"),
    ("openengine-v1.2.3-rc.1", "tag", "openengine-v1.2.3-rc.1"),
]
MUTABLE = [
    "",
    "main",
    "unreleased",
    "a66ff6f",  # short SHA
    BSR[:31],
    BSR + "0",  # 33 hex: neither form
    "buf.build/openengine/openengine:main",  # a label moves
    "buf.build/openengine/openengine:v0.1.0",
    "buf.build/openengine/openengine",
    f"buf.build/openengine:{BSR}",  # no module
    f"https://buf.build/openengine/openengine:{BSR}",
    f"buf.build/OpenEngine/openengine:{BSR}",
]


@pytest.mark.parametrize(("value", "kind", "normalized"), FORMS)
def test_every_immutable_release_form_is_accepted(value: str, kind: str, normalized: str) -> None:
    n = negotiate(info(release=value))
    assert (n.release_kind, n.release) == (kind, normalized)
    assert parse_release(value) == normalized  # --expected-schema-release takes it too
    negotiate(info(release=value), expected_release=value)


@pytest.mark.parametrize("value", MUTABLE)
def test_mutable_or_malformed_releases_are_refused(value: str) -> None:
    with pytest.raises(NegotiationError, match="not an immutable schema release"):
        negotiate(info(release=value))
    with pytest.raises(ValueError, match="not an immutable schema release"):
        parse_release(value)


@pytest.mark.parametrize(
    ("expected", "advertised", "ok"),
    [
        (BSR, f"buf.build/openengine/openengine:{BSR}", True),  # the commit names it
        (f"buf.build/openengine/openengine:{BSR}", BSR, True),
        (f"buf.build/openengine/openengine:{BSR}", f"buf.build/other/openengine:{BSR}", False),
        (BSR, "f" * 32, False),
        (BSR, A66, False),
        (A66[:32], A66, False),  # a prefix of a source commit is not a BSR commit of it
    ],
)
def test_expected_bsr_release(expected: str, advertised: str, ok: bool) -> None:
    if ok:
        negotiate(info(release=advertised), expected_release=expected)
    else:
        with pytest.raises(NegotiationError, match="expected schema release"):
            negotiate(info(release=advertised), expected_release=expected)


def test_known_release_table_matches_upstream() -> None:
    by_name = {k.name: k for k in KNOWN_RELEASES}
    assert set(by_name) == {"a66ff6f", "4def7c5", "31be5db"}
    assert (by_name["a66ff6f"].revision, by_name["a66ff6f"].numbering) == (3, "original")
    assert (by_name["4def7c5"].revision, by_name["4def7c5"].numbering) == (1, "original")
    assert (by_name["31be5db"].revision, by_name["31be5db"].numbering) == (1, "restarted")
    assert by_name["a66ff6f"].features == set(FEATURES)
    assert by_name["4def7c5"].features == set()
    assert by_name["31be5db"].features == set(FEATURES) - {"drain"}
    for k in KNOWN_RELEASES:
        assert all(len(c) == 40 for c in k.source_commits) and k.minimum_client_revision == 1
    release = parse(A66.upper())
    assert release is not None and find_known(release) is by_name["a66ff6f"]


# (revision, release, connector, numbering): "revision 1" names two schemas
NUMBERING = [
    (3, A66, None, "original"),
    (1, DEF, None, "original"),
    (1, B31, None, "restarted"),
    (1, BSR, None, "restarted"),  # published through the registry: the restarted numbering
    (2, OTHER, None, "original"),  # only the original numbering reached 2 and 3
    (1, OTHER, None, "original"),
    (1, OTHER, pb.KvConnectorInfo(enabled=True, handoff_profile="vllm.kv_transfer_params.v1"), "restarted"),
    (1, OTHER, pb.KvConnectorInfo(enabled=True, supports_client_bootstrap=False), "restarted"),
]


@pytest.mark.parametrize(("rev", "release", "kv", "numbering"), NUMBERING)
def test_revision_numbering(rev: int, release: str, kv: pb.KvConnectorInfo | None, numbering: str) -> None:
    assert negotiate(info(rev, 1, release, kv=kv)).numbering == numbering


def test_client_revision_follows_the_numbering() -> None:
    """A revision-2 client requirement is met in the original numbering (we speak 3) but not in
    the restarted one (we speak 1): the refusal says which."""
    assert negotiate(info(3, 2, OTHER)).client_revision == 3
    with pytest.raises(NegotiationError, match=r"requires a newer client.*revision 1 \(restarted numbering"):
        negotiate(info(2, 2, BSR))
    n = negotiate(info(2, 1, BSR))
    assert (n.revision, n.client_revision, n.server_newer) == (1, 1, True)


def _models(*, tokenizer: bool = False, multimodal: bool = False) -> dict[str, pb.ModelInfo]:
    mi = pb.ModelInfo(model_id="m", served_model_name="m")
    if tokenizer:
        mi.tokenizer = pb.TokenizerInfo(source="s", mode="auto")
    if multimodal:
        mi.multimodal_capabilities = pb.MultimodalCapabilities(aggregate_modalities=[pb.Modality.IMAGE])
    return {"m": mi}


@pytest.mark.parametrize(
    ("rev", "release", "models", "status", "known", "resembles"),
    [
        (3, A66, _models(tokenizer=True, multimodal=True), "known", "a66ff6f", "a66ff6f"),
        (1, DEF, _models(), "known", "4def7c5", "4def7c5"),
        (1, B31, _models(tokenizer=True), "known", "31be5db", "31be5db"),
        (1, OTHER, _models(), "untested", None, "4def7c5"),
        (1, OTHER, _models(tokenizer=True), "untested", None, "31be5db"),
        (1, BSR, _models(tokenizer=True, multimodal=True), "untested", None, "31be5db"),
        (3, OTHER, _models(tokenizer=True), "untested", None, "a66ff6f"),
        (2, OTHER, _models(), "untested", None, None),
        (4, A66, _models(), "untested", None, None),  # a known release with the wrong revision
    ],
)
def test_compatibility(
    rev: int,
    release: str,
    models: dict[str, pb.ModelInfo],
    status: str,
    known: str | None,
    resembles: str | None,
) -> None:
    i = info(rev, 1, release)
    negotiated, compat, warning = assess(i, negotiate(i), models)
    assert (compat.status, compat.known_release, compat.resembles) == (status, known, resembles)
    assert set(compat.features) == set(FEATURES)
    if status == "known":
        assert warning is None
        require_known("vllm", compat)
    else:
        assert warning is not None and "\n" not in warning
        assert str(negotiated.release) in warning and "untested" in warning
        assert compat.features["drain"] is None  # only a Drain call would tell
        with pytest.raises(NegotiationError, match="--require-known-release"):
            require_known("vllm", compat)


def test_revision_one_decided_by_model_features() -> None:
    """An untested revision-1 source release whose models carry tokenizer info is the restarted
    schema (31be5db-like); without it the original one (4def7c5-like)."""
    i = info(1, 1, OTHER)
    assert assess(i, negotiate(i), _models(tokenizer=True))[0].numbering == "restarted"
    assert assess(i, negotiate(i), _models())[0].numbering == "original"


def test_card_carries_compatibility_and_known_releases() -> None:
    i = info(1, 1, DEF)
    card = build_card(i, negotiate(i), _models())
    assert card.compatibility is not None and card.compatibility.status == "known"
    assert card.compatibility.features == dict.fromkeys(FEATURES, False)
    assert [k.name for k in card.sidecar.known_releases] == [k.name for k in KNOWN_RELEASES]
    assert card.warnings == []


# --------------------------------------------------------------------------- handoff profiles

DERIVED = [
    ("vllm", "nixl", "vllm.kv_transfer_params.v1"),
    ("vLLM", "NIXL", "vllm.kv_transfer_params.v1"),
    ("tensorrt_llm", "ucx", "tensorrt_llm.disaggregated_params.v1"),
    ("tensorrt-llm", "nixl", "tensorrt_llm.disaggregated_params.v1"),
    ("trtllm", "mpi", "tensorrt_llm.disaggregated_params.v1"),
    ("sglang", "mooncake", "sglang.bootstrap.v1"),
    ("sglang", "nixl", "sglang.bootstrap.v1"),
    ("vllm", "mooncake", None),  # another connector, another contract
    ("vllm", "", None),
    ("sglang", "ucx", None),
    ("someengine", "nixl", None),
    ("", "nixl", None),
]


@pytest.mark.parametrize(("engine", "backend", "profile"), DERIVED)
def test_handoff_profile_derivation(engine: str, backend: str, profile: str | None) -> None:
    assert derive_profile(engine, backend) == profile


def test_effective_profile() -> None:
    adv = effective_profile("decode", "vllm", "vllm.kv_transfer_params.v1", "nixl", None)
    assert (adv.profile, adv.source, adv.warning, adv.problem) == (
        "vllm.kv_transfer_params.v1",
        "advertised",
        None,
        None,
    )
    clash = effective_profile("decode", "vllm", "vllm.kv_transfer_params.v1", "nixl", "x.y.v1")
    assert clash.problem is not None and "contradicts" in clash.problem
    derived = effective_profile("prefill", "sglang", "", "mooncake", None)
    assert (derived.profile, derived.source) == ("sglang.bootstrap.v1", "derived")
    assert derived.warning is not None and "derived sglang.bootstrap.v1" in derived.warning
    configured = effective_profile("prefill", "vllm", "", "mooncake", "vllm.kv_transfer_params.v1")
    assert (configured.profile, configured.source) == ("vllm.kv_transfer_params.v1", "configured")
    none = effective_profile("prefill", "vllm", "", "mooncake", None)
    assert (none.profile, none.source) == ("", None)
    assert none.problem is not None and "--handoff-profile" in none.problem


@pytest.mark.parametrize("value", ["vllm", "vllm.kv_transfer_params", "Vllm.x.v1", "a b.v1", ""])
def test_handoff_profile_flag_is_validated(value: str) -> None:
    with pytest.raises(ValueError, match="not a handoff profile name"):
        parse_profile(value)
    assert parse_profile(" tensorrt_llm.disaggregated_params.v1 ") == "tensorrt_llm.disaggregated_params.v1"


def test_legacy_connector_card_derives_and_warns() -> None:
    kv = pb.KvConnectorInfo(enabled=True, transfer_backend="nixl", local_endpoints=[])
    i = info(1, 1, DEF, role=pb.EngineRole.DECODE, kv=kv)
    card = build_card(i, negotiate(i), _models())
    assert card.problems == []
    assert card.kv_connector is not None
    assert (card.kv_connector.handoff_profile, card.kv_connector.handoff_profile_source) == (
        "vllm.kv_transfer_params.v1",
        "derived",
    )
    assert not card.kv_connector.requires_session_profile
    assert len(card.warnings) == 1 and "derived vllm.kv_transfer_params.v1" in card.warnings[0]
    kv.transfer_backend = "lmcache"
    card = build_card(i, negotiate(i), _models())
    assert card.problems and "set --handoff-profile" in card.problems[0]
    card = build_card(i, negotiate(i), _models(), handoff_profile="vllm.kv_transfer_params.v1")
    assert card.problems == [] and card.kv_connector is not None
    assert card.kv_connector.handoff_profile_source == "configured"
