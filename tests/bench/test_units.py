"""I/O-free parts of the benchmark: frame parser, statistics, analysis, profile summary, report."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.bench import analysis, profile, report, stats
from sidecar.bench.north_load import latency_figures
from sidecar.bench.wsclient import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_TEXT,
    FrameParser,
    WsError,
    _mask,
    encode_frame,
)


def server_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    n = len(payload)
    b0 = (0x80 if fin else 0) | opcode
    if n < 126:
        head = bytes((b0, n))
    elif n < 1 << 16:
        head = bytes((b0, 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((b0, 127)) + n.to_bytes(8, "big")
    return head + payload


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 200_000])
def test_parser_lengths_and_byte_by_byte_feeding(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    data = server_frame(OP_BINARY, payload) + server_frame(OP_TEXT, b"next")
    parser = FrameParser()
    if size <= 200:
        out = [m for i in range(len(data)) for m in parser.feed(data[i : i + 1])]
    else:
        out = parser.feed(data[:7]) + parser.feed(data[7:])
    assert out == [(OP_BINARY, payload), (OP_TEXT, b"next")]


def test_parser_joins_fragments_around_control_frames() -> None:
    data = (
        server_frame(OP_TEXT, b"he", fin=False)
        + server_frame(OP_PING, b"p")
        + server_frame(0x0, b"ll", fin=False)
        + server_frame(0x0, b"o")
        + server_frame(OP_CLOSE, (1000).to_bytes(2, "big"))
    )
    assert FrameParser().feed(data) == [(OP_PING, b"p"), (OP_TEXT, b"hello"), (OP_CLOSE, b"\x03\xe8")]


def test_parser_rejects_a_stray_continuation() -> None:
    with pytest.raises(WsError):
        FrameParser().feed(server_frame(0x0, b"x"))


@pytest.mark.parametrize("size", [0, 3, 4, 5, 130, 70_000])
def test_client_frames_are_masked_and_parse_back(size: int) -> None:
    payload = bytes((i * 7) & 0xFF for i in range(size))
    key = b"\x01\x02\xfe\xff"
    frame = encode_frame(OP_BINARY, payload, key)
    assert frame[0] == 0x80 | OP_BINARY and frame[1] & 0x80  # FIN, masked
    if size:
        assert payload not in frame
    assert FrameParser().feed(frame) == [(OP_BINARY, payload)]
    assert _mask(_mask(payload, key), key) == payload


def test_percentiles_and_summary() -> None:
    assert stats.pct([], 50) != stats.pct([], 50)  # NaN
    assert stats.pct([5], 99) == 5
    assert stats.pct([1, 2, 3, 4], 50) == 2.5
    assert stats.pct(list(range(101)), 99) == 99
    s = stats.summary([1.0, 2.0, 3.0], scale=1000)
    assert s["count"] == 3 and s["p50"] == 2000 and s["max"] == 3000 and s["mean"] == 2000
    assert stats.added(
        {"p50": 3, "p90": 4, "p99": 9, "max": 10, "mean": 3},
        {"p50": 1, "p90": 1, "p99": 2, "max": 3, "mean": 1},
    ) == {
        "p50": 2,
        "p90": 3,
        "p99": 7,
        "max": 7,
        "mean": 2,
    }


def test_proc_parsers() -> None:
    text = "1234 (python3 (x) y) S 1 1 1 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 0 0"
    assert stats.parse_stat_cpu(text) == pytest.approx(300 / stats.CLK_TCK)
    assert stats.parse_status_kib("Name:\tpython\nVmRSS:\t  51234 kB\nVmSwap:\t0 kB\n") == 51234
    assert stats.cpu_seconds() > 0 and stats.rss_kib() > 0


def test_latency_figures_from_records() -> None:
    ms = 1_000_000
    out = latency_figures(
        [0, 100 * ms],
        [[30 * ms, 60 * ms, 95 * ms], [140 * ms]],
        [[str(29 * ms), str(59 * ms), "x"], [str(138 * ms)]],
    )
    assert out["ttft_ms"]["count"] == 2 and out["ttft_ms"]["max"] == pytest.approx(40)
    assert sorted([out["itl_ms"]["p50"], out["itl_ms"]["max"]]) == [pytest.approx(32.5), pytest.approx(35)]
    assert out["oneway_ms"]["count"] == 3 and out["oneway_ms"]["max"] == pytest.approx(2)


def test_cancel_figures_match_engine_records() -> None:
    records = [
        {"request_id": "a", "kind": "cancel", "cancel_us": 1_000},
        {"request_id": "b", "kind": "drop", "cancel_us": 2_000},
        {"request_id": "c", "kind": "cancel", "cancel_us": 3_000},
    ]
    fig = analysis.cancel_figures(records, {"a": 3_000.0, "b": 2_500.0, "zzz": 1.0})
    assert fig["cancels"] == 3
    assert fig["by_kind_ms"]["cancel"]["p50"] == pytest.approx(2.0)
    assert fig["by_kind_ms"]["drop"]["p50"] == pytest.approx(0.5)
    assert fig["latency_ms"]["max"] == pytest.approx(2.0)
    assert fig["not_seen_by_engine"] == {"cancel": 1}
    assert analysis.leaks({"requests_in_flight": 3.0, "requests_leaked": 3.0}) == 3


def _run(tps: float, tokens: int, cpu: dict[str, float]) -> dict[str, object]:
    return {"tokens_per_s": tps, "tokens": tokens, "seconds": tokens / tps, "cpu_s": cpu}


def test_relay_figures_and_goals() -> None:
    rounds = {
        "sidecar": [_run(10_000, 1000, {"self": 0.02, "sidecar": 0.09, "engine": 0.02})] * 3,
        "engineclient": [_run(12_000, 1000, {"self": 0.05, "engine": 0.02})],
        "grpcio": [_run(30_000, 1000, {"self": 0.03, "engine": 0.02})],
    }
    fig = analysis.relay_figures(rounds)  # type: ignore[arg-type]
    assert fig["sidecar"]["sidecar_cpu_us_per_token"] == pytest.approx(90)
    assert fig["grpcio"]["client_cpu_us_per_token"] == pytest.approx(30)
    assert fig["ratios"]["sidecar_cpu_per_token_vs_grpcio"] == pytest.approx(3)
    assert fig["ratios"]["throughput_vs_engineclient"] == pytest.approx(10 / 12)
    goals = {g["goal"]: g for g in analysis.goals({"relay": fig})}
    assert goals["relay tokens/s at 256 streams"]["met"] is True
    assert goals["relay vs direct EngineClient"]["met"] is True  # 0.83x >= 0.7x
    assert goals["relay vs direct grpcio client"]["met"] is False  # 0.33x < 0.95x
    assert goals["sidecar CPU/token vs grpcio client"]["met"] is False  # 3x > 1.1x
    fast = {
        **fig,
        "ratios": {
            **fig["ratios"],
            "throughput_vs_engineclient": 0.9,
            "throughput_vs_grpcio": 1.4,
            "sidecar_cpu_per_token_vs_grpcio": 0.6,
        },
    }
    goals = {g["goal"]: g for g in analysis.goals({"relay": fast})}
    assert all(
        goals[k]["met"]
        for k in (
            "relay vs direct EngineClient",
            "relay vs direct grpcio client",
            "sidecar CPU/token vs grpcio client",
        )
    )
    drain = {"exit_s": 3.5, "grace_s": 2.0}
    (g,) = analysis.goals({"drain": drain})
    assert g["met"] is False
    (g,) = analysis.goals({"drain": {"exit_s": math.nan, "grace_s": 2.0}})
    assert g["met"] is None and g["value"] is None


def test_profile_summary_counts_self_and_inclusive_time() -> None:
    text = "\n".join(
        [
            "main (a/site-packages/trio/_run.py:10);pump (/x/sidecar/core/relay.py:5);parse (b/betterproto2/__init__.py:9) 6",
            "main (a/site-packages/trio/_run.py:10);pump (/x/sidecar/core/relay.py:7) 3",
            "main (a/site-packages/trio/_run.py:11);send (y/trio/_socket.py:3) 1",
            "garbage line",
        ]
    )
    s = profile.summarize(text)
    assert s["samples"] == 10
    top = s["self"][0]
    assert top["function"] == "parse (betterproto2/__init__.py)" and top["share"] == pytest.approx(0.6)
    incl = {r["function"]: r["share"] for r in s["inclusive"]}
    assert incl["pump (sidecar/core/relay.py)"] == pytest.approx(0.9)
    assert incl["main (trio/_run.py)"] == pytest.approx(1.0)
    assert "parse (betterproto2/__init__.py)" in profile.render(s)


def test_report_renders_partial_results() -> None:
    results = {
        "drain": {"streams": 4, "grace_s": 1.0, "exit_s": 1.2},
        "scale": {"points": [{"streams": 100, "rss_kib_per_stream": 12.5}]},
    }
    table = report.render_table(results)
    assert "drain" in table and "12.5" in table
    goals = report.render_goals(analysis.goals(results))
    assert "yes" in goals
    assert report.render_table({}) == "(no results)"


def test_ratio_with_zero_cpu_is_nan_not_a_crash() -> None:
    import math

    from sidecar.bench.analysis import ratio

    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(3.0, 0.0))
    assert math.isnan(ratio(3.0, math.nan))


def test_report_renders_unmeasured_ratios_as_dashes() -> None:
    """A quick run can measure 0 CPU ticks for a client: its ratio is NaN in memory and
    ``null`` in the JSON the table is rendered from (this crashed the table once)."""
    relay = {
        "config": {"streams": 2, "tokens": 3, "rounds": 1},
        "sidecar": {"tokens_per_s": 10.0, "sidecar_cpu_us_per_token": 5.0},
        "engineclient": {"tokens_per_s": 12.0},
        "grpcio": {"tokens_per_s": 14.0, "client_cpu_us_per_token": 0.0},
        "ratios": {"throughput_vs_engineclient": 0.83, "sidecar_cpu_per_token_vs_grpcio": None},
    }
    short = {
        "config": {"concurrency": 2},
        "sidecar": {"requests_per_s": 5.0},
        "ratio_vs_engineclient": float("nan"),
    }
    table = report.render_table({"relay": relay, "short": short})
    assert "0.83x" in table and "- " in table and "nan" not in table.lower()


def test_cpu_profiler_samples_where_the_cpu_goes(tmp_path: Path) -> None:
    """``sidecar.bench.cpuprof`` charges CPU-time samples to the running stack and writes the
    collapsed stacks ``profile.summarize`` reads."""
    out = tmp_path / "prof.txt"
    code = (
        "import time\n"
        "from sidecar.bench import cpuprof\n"
        f"cpuprof.start({str(out)!r}, 250)\n"
        "def spin():\n"
        "    end = time.process_time() + 0.4\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "spin()\n"
        "time.sleep(0.3)\n"  # idle: no samples
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    summary = profile.summarize(out.read_text())
    assert summary["samples"] >= 20  # 0.4 s of CPU at 250 Hz, allowing a coarse kernel timer
    spin = next(r for r in summary["inclusive"] if r["function"].startswith("spin "))
    assert spin["share"] > 0.8


@pytest.mark.parametrize("quick", [False, True])
def test_rounds_option_sets_every_scenarios_rounds(quick: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --rounds N`` (the A/B runs of docs/PERFORMANCE.md) reaches short, burst, dynamo and
    vllm too, not only relay."""
    from click.testing import CliRunner

    from sidecar.bench import command

    seen: list[Any] = []

    async def fake_run(config: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(command, "_until_signal", fake_run)
    args = ["--scenarios", "short,burst", "--rounds", "2", *(["--quick"] if quick else [])]
    result = CliRunner().invoke(command.bench, args)
    assert result.exit_code == 130, result.output  # the fake run returned no document
    (config,) = seen
    rounds = (
        config.rounds,
        config.short_rounds,
        config.burst_rounds,
        config.dynamo_rounds,
        config.vllm_rounds,
    )
    assert rounds == (2, 2, 2, 2, 2)
    assert config.short_concurrency == (4 if quick else 64)  # sizes untouched


def test_table_cells_with_pipes_and_line_breaks_keep_the_columns() -> None:
    """Issue 21 item 10: a ``|`` in a cell (a goal such as "p99 | p50") broke the Markdown columns."""
    goals = [{"goal": "a | b", "value": 1.5, "unit": "ms", "target": "< 2\n(p99)", "met": True}]
    lines = report.render_goals(goals).splitlines()
    assert len(lines) == 3, lines  # header, rule, one row: the line break did not split the row
    columns = {len([c for c in re.split(r"(?<!\\)\|", line)[1:-1]]) for line in lines}
    assert columns == {4}, lines
    assert "a \\| b" in lines[2] and "< 2 (p99)" in lines[2], lines


def test_default_results_path_is_ignored_by_git() -> None:
    from sidecar.bench.command import DEFAULT_OUT

    root = Path(__file__).resolve().parents[2]
    assert not DEFAULT_OUT.is_absolute() and DEFAULT_OUT.parts[0] == "bench-results"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", str(DEFAULT_OUT)],
        cwd=root,
        capture_output=True,
        timeout=30,
    )
    assert ignored.returncode == 0, f"{DEFAULT_OUT} is not git-ignored"
