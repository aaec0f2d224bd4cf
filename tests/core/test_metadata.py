from __future__ import annotations

import re

import pytest

from sidecar.core.errors import Rejection
from sidecar.core.metadata import normalize_metadata, valid_traceparent, valid_tracestate
from sidecar.openengine import pb

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_empty() -> None:
    for md in (None, {}, []):
        n = normalize_metadata(md)
        assert n.pairs == ()
        assert n.as_dict() == {}
        assert (n.routing_key, n.target_dp_rank, n.priority, n.traceparent, n.tracestate) == (None,) * 5


def test_all_openengine_keys() -> None:
    n = normalize_metadata(
        {
            "openengine-routing-key": "tenant-a/session 42",
            "openengine-target-dp-rank": "007",
            "openengine-priority": "-5",
            "traceparent": TP,
            "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        },
        dp_ranks=[0, 7],
    )
    assert n.routing_key == "tenant-a/session 42"
    assert n.target_dp_rank == 7
    assert n.priority == -5
    assert n.traceparent == TP
    assert n.tracestate == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    assert n.pairs == (
        ("openengine-routing-key", "tenant-a/session 42"),
        ("openengine-target-dp-rank", "7"),
        ("openengine-priority", "-5"),
        ("traceparent", TP),
        ("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
    )


def test_keys_are_folded_to_lower_case() -> None:
    n = normalize_metadata({"OpenEngine-Priority": "3"})
    assert n.pairs == (("openengine-priority", "3"),)


def test_application_keys_forwarded_or_rejected() -> None:
    n = normalize_metadata({"x-tenant": "a", "my.app_key": "b"})
    assert n.pairs == (("x-tenant", "a"), ("my.app_key", "b"))
    assert n.application_keys == ("x-tenant", "my.app_key")
    with pytest.raises(Rejection, match="not an OpenEngine key"):
        normalize_metadata({"x-tenant": "a"}, allow_application_keys=False)


@pytest.mark.parametrize(
    ("md", "fragment"),
    [
        ([("openengine-priority", "1"), ("openengine-priority", "2")], "more than once"),
        ([("openengine-priority", "1"), ("OPENENGINE-PRIORITY", "2")], "more than once"),
        ({"openengine-routing-key": ""}, "must not be empty"),
        ({"openengine-routing-key": "caf\u00e9"}, "not printable ASCII"),
        ({"openengine-routing-key": "a\nb"}, "not printable ASCII"),
        ({"openengine-target-dp-rank": ""}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "-1"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "+1"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": " 1"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "0x1"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "1.0"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "4294967296"}, "not a base-10 uint32"),
        ({"openengine-target-dp-rank": "\u0661"}, "not printable ASCII"),  # Arabic-Indic digit one
        ({"openengine-target-dp-rank": "2"}, "not a DP rank of this worker (0, 1)"),
        ({"openengine-priority": ""}, "not a base-10 int32"),
        ({"openengine-priority": "2147483648"}, "not a base-10 int32"),
        ({"openengine-priority": "-2147483649"}, "not a base-10 int32"),
        ({"openengine-priority": "high"}, "not a base-10 int32"),
        ({"openengine-priority": "1e3"}, "not a base-10 int32"),
        ({"openengine-priority": "+3"}, "not a base-10 int32"),
        ({"traceparent": "garbage"}, "not a valid W3C traceparent"),
        ({"traceparent": TP, "tracestate": "a=b,a=c"}, "not a valid W3C tracestate"),
        ({"tracestate": "a=b"}, "tracestate given without traceparent"),
        ({"openengine-target": "1"}, "unknown OpenEngine metadata key"),
        ({"openengine-deadline-ms": "1"}, "unknown OpenEngine metadata key"),
        ({"grpc-timeout": "1S"}, "reserved"),
        ({"te": "trailers"}, "reserved"),
        ({"content-type": "application/grpc"}, "reserved"),
        ({"trace-bin": "AAAA"}, "reserved"),
        ({":authority": "x"}, "not a valid gRPC key"),
        ({"bad key": "x"}, "not a valid gRPC key"),
        ({"": "x"}, "not a valid gRPC key"),
        ({"k\u00e9y": "x"}, "not an ASCII string"),
        ({"x-num": 5}, "must be a string"),
        ({"x-big": "a" * 5000}, "longer than 4096"),
        ({f"x-{i}": "v" for i in range(65)}, "too many metadata keys"),
        ({f"x-{i}": "v" * 3000 for i in range(3)}, "larger than 8192"),
    ],
)
def test_rejections(md: object, fragment: str) -> None:
    with pytest.raises(Rejection, match=re.escape(fragment)) as exc:
        normalize_metadata(md, dp_ranks=[0, 1])  # type: ignore[arg-type]
    assert exc.value.code == pb.ErrorCode.INVALID_ARGUMENT
    assert exc.value.retryable is False


def test_dp_rank_membership_skipped_without_ranks() -> None:
    assert normalize_metadata({"openengine-target-dp-rank": "4294967295"}).target_dp_rank == 2**32 - 1


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (TP, True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", True),  # future version
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", False),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", False),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", False),
        ("", False),
    ],
)
def test_traceparent(value: str, ok: bool) -> None:
    assert valid_traceparent(value) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("rojo=00f067aa0ba902b7", True),
        ("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", True),
        ("a=1,,b=2", True),
        ("tenant@vendor=x", True),
        ("a/b*c_d-e=val ue", True),
        ("", True),
        ("a=", False),
        ("=b", False),
        ("A=b", False),
        ("a=b=c", False),
        ("a=b,a=c", False),
        ("a=b\u00e9", False),
        ("a=trailing ", True),  # OWS is stripped around members
        (",".join(f"k{i}=v" for i in range(32)), True),
        (",".join(f"k{i}=v" for i in range(33)), False),
        ("tenant@Vendor=x", False),
    ],
)
def test_tracestate(value: str, ok: bool) -> None:
    assert valid_tracestate(value) is ok
