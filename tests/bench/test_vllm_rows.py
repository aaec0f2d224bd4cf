"""The ``vllm`` scenario's figures and table rows from recorded rounds (I/O-free)."""

from __future__ import annotations

from sidecar.bench import report, stats
from sidecar.bench.vllm_bench import _merge


def run(ttft: float, itl: float, tokens: int, seconds: float, sidecar_cpu: float) -> dict[str, object]:
    summary = {"p50": ttft, "p90": ttft, "p99": ttft * 2, "mean": ttft, "count": 1, "max": ttft * 2}
    gaps = {"p50": itl, "p90": itl, "p99": itl * 3, "mean": itl, "count": 10, "max": itl * 3}
    return {
        "ttft_ms": summary,
        "itl_ms": gaps,
        "tokens": tokens,
        "seconds": seconds,
        "cpu_s": {"self": 0.1, "sidecar": sidecar_cpu, "vllm": 1.0, "vllm-child0": 2.0},
    }


def test_merge_and_rows() -> None:
    sidecar = _merge([run(12.0, 4.0, 1000, 2.0, 0.05), run(14.0, 5.0, 1000, 2.0, 0.07)])
    direct = _merge([run(10.0, 4.0, 1000, 1.9, 0.0), run(11.0, 4.5, 1000, 2.1, 0.0)])
    assert sidecar["tokens_per_s"] == 500.0 and sidecar["ttft_ms"]["p50"] == 13.0
    assert sidecar["cpu_us_per_token"]["sidecar"] == 60.0  # 0.12 s over 2000 tokens
    added = {k: stats.added(sidecar[k], direct[k]) for k in ("ttft_ms", "itl_ms")}
    assert added["ttft_ms"]["p50"] == 2.5 and added["itl_ms"]["p50"] == 0.25
    doc = {
        "sidecar": sidecar,
        "direct": direct,
        "added": added,
        "config": {"streams": 8, "tokens": 128, "rounds": 2},
        "vllm_cpu_us_per_token": 1500.0,
    }
    rows = report.rows({"vllm": doc})
    labels = [r[0] for r in rows]
    assert labels[0].startswith("vLLM tokens/s (8 + 8 x 128")
    ttft = next(r for r in rows if r[0].startswith("vLLM TTFT"))
    assert ttft[4] == "+2.50 | +5.00 added"
    cpu = next(r for r in rows if r[0].startswith("vLLM CPU"))
    assert cpu[1] == "60.0 | 100.0 | 1,500"  # sidecar | client | vLLM over both halves
