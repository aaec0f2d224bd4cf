"""``mock-engine`` as a real process, through the ``run_mock_engine`` helper."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineUnavailable
from tests.mock_engines import MockEngineStartError, run_mock_engine

from .helpers import collect, request, token_ids

ROLE_ENUM = {
    "aggregated": pb.EngineRole.AGGREGATED,
    "prefill": pb.EngineRole.PREFILL,
    "decode": pb.EngineRole.DECODE,
}


@pytest.mark.parametrize(
    ("flavor", "role"), [("trtllm", "decode"), ("vllm", "prefill"), ("sglang", "aggregated")]
)
async def test_process_serves_and_stops_on_sigterm(
    aio_loop: Any, tmp_path: Path, flavor: str, role: str
) -> None:
    with trio.fail_after(30):
        async with run_mock_engine(tmp_path, flavor, role, dp_size=2, alias=["a", "b"]) as eng:
            assert eng.info["flavor"] == flavor and eng.info["pid"] == eng.pid
            async with open_engine_client(eng.address) as client:
                info = await client.get_server_info()
                assert info.engine_role == ROLE_ENUM[role]
                assert info.parallelism is not None and info.parallelism.data_parallel_size == 2
                assert (await client.get_model_info("b")).served_model_aliases == ["a", "b"]
            eng.terminate()
            assert await eng.wait() == 0
        assert "serving OpenEngine on" in eng.log_text()


async def test_process_pair_over_real_sockets(aio_loop: Any, tmp_path: Path) -> None:
    req = request("x", prompt=" ba be" * 20, stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True))
    with trio.fail_after(40):
        async with (
            run_mock_engine(tmp_path, "vllm", "prefill", listen="unix") as pre,
            run_mock_engine(tmp_path, "vllm", "decode") as dec,
            run_mock_engine(tmp_path, "vllm", "aggregated", fast=True) as agg,
        ):
            assert pre.address.startswith("unix://")
            async with (
                open_engine_client(pre.address) as p,
                open_engine_client(dec.address) as d,
                open_engine_client(agg.address) as a,
            ):
                ready = (await collect(p, req))[-1].prefill_ready
                assert ready is not None and ready.kv_session is not None
                decode_req = pb.GenerateRequest.parse(bytes(req))
                decode_req.kv = pb.KvOptions(session=ready.kv_session)
                assert token_ids(await collect(d, decode_req)) == token_ids(await collect(a, req))


async def test_crash_after_exits_the_process(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with run_mock_engine(tmp_path, faults=["crash-after=2"]) as eng:
            async with open_engine_client(eng.address) as client:
                with pytest.raises(EngineUnavailable):
                    await collect(
                        client, request(stopping=pb.StoppingOptions(max_tokens=50, ignore_eos=True))
                    )
            assert await eng.wait() == 70


async def test_bad_flags_fail_to_start(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30), pytest.raises(MockEngineStartError, match="unknown fault"):
        async with run_mock_engine(tmp_path, faults=["bogus"]):
            pass


async def test_environment_configures_only_mock_flags(aio_loop: Any, tmp_path: Path) -> None:
    env = {"OPENENGINE_SIDECAR_MOCK_MODEL": "env-model", "OPENENGINE_SIDECAR_MOCK_FAULT": "no-usage"}
    with trio.fail_after(30):
        async with run_mock_engine(tmp_path, env=env) as eng, open_engine_client(eng.address) as client:
            assert (await client.get_server_info()).supported_models == ["env-model"]
            events = await collect(client, request(max_tokens=2))
            assert events[-1].usage is None


def test_ready_file_and_sigint(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "mock-engine",
            "--listen",
            "127.0.0.1:0",
            "--kv-events",
            "none",
            "--ready-file",
            str(ready),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the one "serving" line comes after the ready file is written
        assert "serving OpenEngine on" in line
        info = json.loads(ready.read_text())
        assert info["address"].startswith("127.0.0.1:") and info["kv_events"] == "none"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_sigterm_with_streams_in_flight(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with run_mock_engine(tmp_path, "sglang", token_delay_ms=20) as eng:
            async with open_engine_client(eng.address) as client:
                with pytest.raises(EngineUnavailable):
                    async with client.generate(
                        request(stopping=pb.StoppingOptions(max_tokens=1000, ignore_eos=True))
                    ) as s:
                        await s.__anext__()
                        eng.terminate()
                        async for _ in s:
                            pass
            assert await eng.wait() == 0
