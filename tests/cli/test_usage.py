"""Every flag is checked before anything starts: exit 2, one line naming the flag, no traceback
(real processes, as an operator runs them; issue 21 items 2, 3 and 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import cli, one_line_usage_error

RUN = ["run", "--engine", "127.0.0.1:1"]

CASES = [
    ([*RUN, "--call-timeout", "-1"], "--call-timeout"),
    ([*RUN, "--drain-timeout", "-5"], "--drain-timeout"),
    ([*RUN, "--listen", "127.0.0.1:99999"], "--listen"),
    ([*RUN, "--http-listen", "nohost"], "--http-listen"),
    ([*RUN, "--listen", "::1:8600"], "--listen"),
    ([*RUN, "--max-streams", "-3"], "--max-streams"),
    ([*RUN, "--max-streams-per-connection", "0"], "--max-streams-per-connection"),
    ([*RUN, "--startup-deadline", "-1"], "--startup-deadline"),
    ([*RUN, "--abort-timeout", "-1"], "--abort-timeout"),
    ([*RUN, "--health-interval", "0"], "--health-interval"),
    ([*RUN, "--load-interval", "nan"], "--load-interval"),
    ([*RUN, "--stall-timeout", "inf"], "--stall-timeout"),
    ([*RUN, "--lora-root", "relative/dir"], "--lora-root"),
    ([*RUN, "--expected-schema-release", "main"], "--expected-schema-release"),
    ([*RUN, "--ready-file", "/nonexistent-dir/ready.json"], "--ready-file"),
    ([*RUN, "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"], "--tls-cert"),
    (["run", "--engine", "ftp://x"], "--engine"),
    (["describe", "--engine", "ftp://x"], "--engine"),
    (["describe", "--engine", "127.0.0.1:1", "--timeout", "-1"], "--timeout"),
    (["describe", "--engine", "127.0.0.1:1", "--connect-timeout", "-1"], "--connect-timeout"),
    (["conformance", "--engine", "127.0.0.1:1", "--check-timeout", "-1"], "--check-timeout"),
    (["conformance", "--engine", "127.0.0.1:1", "--json", "/nonexistent-dir/report.json"], "--json"),
    (["conformance", "--engine", "ftp://x"], "--engine"),
    (["mock-engine", "--listen", "ftp://x"], "--listen"),
    (["mock-engine", "--listen", "unix:///nonexistent-dir/e.sock"], "--listen"),
    (["mock-engine", "--kv-log", "/nonexistent-dir/kv.jsonl"], "--kv-log"),
    (["mock-engine", "--kv-host", "two words"], "--kv-host"),
    (["mock-engine", "--role", "prefill", "--transfer-host", "a/b"], "--transfer-host"),
    (["mock-engine", "--fault", "nope"], "--fault"),
    ([*RUN, "--kv-publish", "ftp://x"], "--kv-publish"),
    ([*RUN, "--kv-advertise-host", "a b"], "--kv-advertise-host"),
    ([*RUN, "--dynamo-model-path", "/nonexistent-dir/model"], "--dynamo-model-path"),
    (["vllm-engine", "--kv-host", "a b", "--model", "/nonexistent-dir"], "--kv-host"),
    (
        ["vllm-engine", "--ready-file", "/nonexistent-dir/r.json", "--model", "/nonexistent-dir"],
        "--ready-file",
    ),
    (["vllm-engine", "--model", "/tmp", "--listen", "ftp://x"], "--listen"),
    (["bench", "--out", f"{__file__}/under-a-file/out.json"], "--out"),
    (["bench", "--profile", f"{__file__}/under-a-file"], "--profile"),
    (["generate", "--sidecar", "ftp://x", "hi"], "--sidecar"),
    (["disagg", "--prefill", "ftp://x", "--decode", "ws://127.0.0.1:1", "hi"], "--prefill"),
    (
        [
            "disagg",
            "--prefill",
            "ws://127.0.0.1:1",
            "--decode",
            "ws://127.0.0.1:1",
            "--connect-timeout",
            "0",
            "hi",
        ],
        "--connect-timeout",
    ),
    (["bench", "--scenarios", "nope"], "--scenarios"),
    (["bench", "--scale-points", "1,x"], "--scale-points"),
    (["run"], "--engine"),
    (["--log-level", "loud", "run", "--engine", "127.0.0.1:1"], "--log-level"),
    (["run", "--engine", "127.0.0.1:1", "--log-format", "xml"], "--log-format"),
]


@pytest.mark.parametrize(("args", "flag"), CASES, ids=[" ".join(a) for a, _ in CASES])
async def test_bad_flag_value_is_one_line_exit_2(args: list[str], flag: str) -> None:
    done = await cli(*args)
    one_line_usage_error(done, flag)
    assert done.seconds < 10  # refused before any engine wait or startup


@pytest.mark.vllm  # without the extra, vllm-engine stops first at "the 'vllm' extra is not installed"
async def test_vllm_engine_model_directory_is_checked_before_vllm_starts() -> None:
    done = await cli("vllm-engine", "--model", "/nonexistent-dir")
    one_line_usage_error(done, "--model")
    assert done.seconds < 10


async def test_garbage_tls_material_and_empty_token(tmp_path: Path) -> None:
    pem = tmp_path / "garbage.pem"
    pem.write_text("not a certificate\n")
    done = await cli(*RUN, "--tls-cert", str(pem), "--tls-key", str(pem))
    one_line_usage_error(done, "--tls-cert")
    empty = tmp_path / "token"
    empty.write_text("\n")
    for args in (RUN, ["generate", "hi"]):
        done = await cli(*args, "--auth-token-file", str(empty))
        one_line_usage_error(done, "--auth-token-file")


async def test_run_and_describe_refuse_the_same_mistake_alike() -> None:
    run = await cli("run", "--engine", "ftp://x")
    describe = await cli("describe", "--engine", "ftp://x")
    assert run.code == describe.code == 2
