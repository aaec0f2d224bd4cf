from __future__ import annotations

import pytest

from sidecar.core.errors import DiscoveryError, NegotiationError
from sidecar.core.negotiation import engine_names_match, negotiate, parse_release, release_kind
from sidecar.openengine import pb
from sidecar.openengine.releases import CLIENT_REVISION, OLDEST_SERVER_REVISION, SCHEMA_RELEASE

SHA = SCHEMA_RELEASE


def info(rev: int = 3, minimum: int = 1, release: str = SHA, name: str = "vllm") -> pb.ServerInfo:
    return pb.ServerInfo(
        engine_name=name, schema_revision=rev, minimum_client_revision=minimum, schema_release=release
    )


# (server revision, minimum client revision, accepted?, reason fragment)
REVISION_MATRIX = [
    (0, 0, False, "schema_revision 0"),
    (0, 1, False, "schema_revision 0"),
    (3, 0, False, "minimum_client_revision 0"),
    (1, 1, True, ""),
    (2, 1, True, ""),
    (3, 1, True, ""),
    (3, 2, True, ""),
    (3, 3, True, ""),
    (3, 4, False, "minimum_client_revision 4 above its own schema_revision 3"),
    (4, 1, True, ""),  # newer additive revision
    (4, 3, True, ""),
    (4, 4, False, "minimum_client_revision 4: it requires a newer client"),
    (9, 5, False, "minimum_client_revision 5: it requires a newer client"),
    (100, 1, True, ""),
]


@pytest.mark.parametrize(("rev", "minimum", "ok", "reason"), REVISION_MATRIX)
def test_revision_matrix(rev: int, minimum: int, ok: bool, reason: str) -> None:
    if ok:
        n = negotiate(info(rev, minimum))
        assert n.server_revision == rev
        assert n.minimum_client_revision == minimum
        assert n.client_revision == CLIENT_REVISION
        assert n.revision == min(rev, CLIENT_REVISION)
        assert n.server_newer is (rev > CLIENT_REVISION)
    else:
        with pytest.raises(NegotiationError, match=reason) as exc:
            negotiate(info(rev, minimum))
        assert "\n" not in str(exc.value)


def test_server_older_than_oldest_supported() -> None:
    with pytest.raises(NegotiationError, match="supports revisions >= 3"):
        negotiate(info(2, 1), oldest_server_revision=3)
    assert negotiate(info(3, 1), oldest_server_revision=3).revision == 3
    assert OLDEST_SERVER_REVISION == 1


def test_client_revision_parameter() -> None:
    with pytest.raises(
        NegotiationError,
        match="minimum_client_revision 3: it requires a newer client; this sidecar speaks OpenEngine revision 2",
    ):
        negotiate(info(3, 3), client_revision=2)
    n = negotiate(info(3, 1), client_revision=2)
    assert (n.revision, n.server_newer) == (2, True)


# (release, accepted?, kind)
RELEASE_MATRIX = [
    (SHA, True, "commit"),
    (SHA.upper(), True, "commit"),
    ("0" * 40, True, "commit"),
    ("v1.2.3", True, "tag"),
    ("v0.0.1", True, "tag"),
    ("openengine-v1.2.3", True, "tag"),
    ("v1.2.3-rc.1", True, "tag"),
    ("v1.2.3-rc1", True, "tag"),
    ("v10.20.30-beta.2", True, "tag"),
    ("openengine-v2.0.0-alpha.1", True, "tag"),
    ("", False, None),
    ("main", False, None),
    ("master", False, None),
    ("unreleased", False, None),
    ("HEAD", False, None),
    ("a66ff6f", False, None),  # short SHA
    (SHA[:39], False, None),
    (SHA + "0", False, None),
    ("g" * 40, False, None),
    ("v1.2", False, None),
    ("1.2.3", False, None),
    ("v1.2.3-dirty", False, None),
    ("v1.2.3-SNAPSHOT", False, None),
    ("release/v1.2.3", False, None),
    (" v1.2.3", False, None),
    (SHA + "\n", False, None),
]


@pytest.mark.parametrize(("release", "ok", "kind"), RELEASE_MATRIX)
def test_release_matrix(release: str, ok: bool, kind: str | None) -> None:
    assert release_kind(release) == kind
    if ok:
        n = negotiate(info(release=release))
        assert n.release_kind == kind
        assert n.release == (release.lower() if kind == "commit" else release)
    else:
        with pytest.raises(NegotiationError, match="not an immutable schema release"):
            negotiate(info(release=release))


def test_empty_release_reason_is_readable() -> None:
    with pytest.raises(NegotiationError, match="advertises an empty schema_release"):
        negotiate(info(release=""))


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        ("vllm", "vllm", True),
        ("VLLM", "vllm", True),
        ("tensorrt-llm", "tensorrt_llm", True),
        ("TensorRT_LLM", "tensorrt_llm", True),
        ("sglang", "vllm", False),
        ("vllm", "", False),
        ("vllm", "vllm-fork", False),
    ],
)
def test_expected_engine(expected: str, actual: str, ok: bool) -> None:
    assert engine_names_match(expected, actual) is ok
    if ok:
        negotiate(info(name=actual), expected_engine=expected)
    else:
        with pytest.raises(NegotiationError, match="expected engine"):
            negotiate(info(name=actual), expected_engine=expected)


@pytest.mark.parametrize(
    ("expected", "advertised", "ok"),
    [
        (SHA, SHA, True),
        (SHA.upper(), SHA, True),
        (SHA, SHA.upper(), True),
        ("v1.2.3", "v1.2.3", True),
        ("v1.2.3", "v1.2.4", False),
        ("v1.2.3", "openengine-v1.2.3", False),
        ("0" * 40, SHA, False),
        ("v1.2.3", SHA, False),
    ],
)
def test_expected_release(expected: str, advertised: str, ok: bool) -> None:
    if ok:
        negotiate(info(release=advertised), expected_release=expected)
    else:
        with pytest.raises(NegotiationError, match="expected schema release"):
            negotiate(info(release=advertised), expected_release=expected)


def test_invalid_expected_release_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="not an immutable"):
        negotiate(info(), expected_release="main")
    with pytest.raises(ValueError):
        parse_release("abc1234")
    assert parse_release(f"  {SHA.upper()} ") == SHA
    assert parse_release("v1.0.0") == "v1.0.0"


def test_order_revision_checked_before_release_and_engine() -> None:
    with pytest.raises(NegotiationError, match="schema_revision 0"):
        negotiate(info(0, 1, release="main", name="x"), expected_engine="y")
    with pytest.raises(NegotiationError, match="not an immutable"):
        negotiate(info(release="main", name="x"), expected_engine="y")


def test_negotiation_error_is_a_discovery_error() -> None:
    assert issubclass(NegotiationError, DiscoveryError)
