"""Security defaults and options of ``openengine-sidecar run``, end to end: loopback-only
defaults, bearer-token authentication on the WebSocket and HTTP listeners (probes open unless
``--auth-probes``), TLS on both listeners (a throwaway CA made with trustme), and no secrets
or prompt text in the logs even at ``--log-level debug``."""

from __future__ import annotations

import json
import re
import ssl
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
from trio_websocket import ConnectionRejected, HandshakeError, open_websocket_url

from sidecar.addresses import split_host_port
from sidecar.childproc import loopback_run_args
from sidecar.client.sidecar_client import SidecarConnectionError, open_sidecar
from sidecar.run_command import run
from tests.e2e.harness import Sidecar, generate_request, mock_engine, sidecar, spawn

pytestmark = pytest.mark.subprocess

TLS_READY = re.compile(r"serving (wss://\S+) and (https://\S+)")
TOKEN = "s3cr3t-" + uuid.uuid4().hex
#: trio-websocket's client waits for its connect timeout when the TLS handshake fails
QUICK = {"connect_timeout": 1.0, "cancel_timeout": 1.0}


def test_defaults_listen_on_loopback_only() -> None:
    defaults = {p.name: p.default for p in run.params}
    assert defaults["listen"] == "127.0.0.1:8600"
    assert defaults["http_listen"] == "127.0.0.1:8601"
    assert defaults["kv_publish"] == "tcp://127.0.0.1:5600"
    assert defaults["kv_replay"] == "tcp://127.0.0.1:5700"
    assert defaults["auth_token"] is None  # no auth unless asked for ...
    assert defaults["tls_cert"] is None and defaults["tls_key"] is None
    assert defaults["open_probes"] is True  # ... and then the probes stay open unless --auth-probes
    # a host left out is loopback too, never all interfaces
    assert split_host_port(":9000") == ("127.0.0.1", 9000)
    assert split_host_port("[::1]:9000") == ("::1", 9000)


async def _get(url: str, *, token: str | None = None, verify: Any = True) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(verify=verify) as client:
        return await client.get(url, headers=headers, timeout=5)


async def _completes(url: str, **kw: Any) -> None:
    async with open_sidecar(url, **kw) as client, client.generate(generate_request(max_tokens=3)) as s:
        assert len([e async for e in s]) == 4
    assert s.end is not None and s.end.outcome == "completed"


async def _handshake_status(
    url: str, headers: list[tuple[bytes, bytes]] | None = None, **kw: Any
) -> tuple[int, Any]:
    with pytest.raises(ConnectionRejected) as rejected:
        async with open_websocket_url(url, extra_headers=headers, **kw):
            pass
    return rejected.value.status_code, rejected.value.body


@pytest.mark.parametrize("probes", ["open", "closed"])
async def test_bearer_token_on_websocket_and_http(aio_loop: Any, tmp_path: Path, probes: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # trailing newline of an editor or a Secret: stripped
    extra = ["--auth-token-file", str(token_file)] + (["--auth-probes"] if probes == "closed" else [])
    with trio.fail_after(40):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine, sidecar(engine.address, *extra) as sc:
            # WebSocket: refused at the handshake with a bare 401, whatever is wrong
            for headers in (
                None,
                [(b"authorization", f"Bearer {TOKEN}x".encode())],
                [(b"authorization", f"Bearer {TOKEN[:-1]}".encode())],
                [(b"authorization", TOKEN.encode())],
                [(b"authorization", b"Basic " + TOKEN.encode())],
                [(b"x-auth", f"Bearer {TOKEN}".encode())],
            ):
                status, body = await _handshake_status(sc.ws, headers)
                assert status == 401 and not body, (headers, status, body)
            with pytest.raises(SidecarConnectionError):
                await _completes(sc.ws, auth_token="wrong")
            await _completes(sc.ws, auth_token=TOKEN)
            # HTTP: the API needs the token; the probes only with --auth-probes
            for path in ("/metrics", "/v1/worker", "/v1/load", "/v1/schema", "/health", "/ready"):
                probe = path in ("/health", "/ready")
                anonymous = await _get(sc.http + path)
                wrong = await _get(sc.http + path, token=TOKEN + "x")
                right = await _get(sc.http + path, token=TOKEN)
                assert right.status_code == 200, path
                if probe and probes == "open":
                    assert anonymous.status_code == 200 and wrong.status_code == 200, path
                else:
                    assert anonymous.status_code == 401 and wrong.status_code == 401, path
                    assert anonymous.content == b"" and wrong.content == b"", path  # no detail
    assert not any(TOKEN in line for line in sc.proc.lines)


@asynccontextmanager
async def tls_sidecar(engine_address: str, cert: Path, key: Path, *args: str) -> AsyncIterator[Sidecar]:
    argv = [
        *loopback_run_args(engine_address),
        "--no-kv-events",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    ]
    async with spawn([*argv, *args]) as proc:
        m = await proc.wait_for_line(TLS_READY)
        yield Sidecar(proc, m.group(1), m.group(2))


def _throwaway_ca(tmp_path: Path) -> tuple[trustme.CA, Path, Path]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    for i, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(str(cert), append=i > 0)
    server.private_key_pem.write_to_path(str(key))
    return ca, cert, key


async def test_tls_on_both_listeners(aio_loop: Any, tmp_path: Path) -> None:
    ca, cert, key = _throwaway_ca(tmp_path)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with trio.fail_after(40):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm") as engine,
            tls_sidecar(engine.address, cert, key, "--auth-token-file", str(token_file)) as sc,
        ):
            assert sc.ws.startswith("wss://127.0.0.1:") and sc.http.startswith("https://127.0.0.1:")
            # TLS with a client that trusts the CA, the token travelling inside it
            assert (await _get(sc.http + "/ready", verify=trusted)).status_code == 200
            assert (await _get(sc.http + "/metrics", token=TOKEN, verify=trusted)).status_code == 200
            assert (await _get(sc.http + "/metrics", verify=trusted)).status_code == 401
            await _completes(sc.ws, ssl_context=trusted, auth_token=TOKEN)
            status, _ = await _handshake_status(sc.ws, None, ssl_context=trusted)
            assert status == 401
            # a client that does not trust the certificate is refused by its own TLS check
            with pytest.raises(httpx.ConnectError):
                await _get(sc.http + "/ready")
            with pytest.raises((SidecarConnectionError, ssl.SSLError, HandshakeError)):
                await _completes(sc.ws, ssl_context=ssl.create_default_context(), auth_token=TOKEN, **QUICK)
            # plaintext to the TLS ports gets no service
            with pytest.raises((httpx.HTTPError, httpx.RemoteProtocolError)):
                await _get(sc.http.replace("https://", "http://") + "/ready")
            # (plaintext WebSocket on the TLS port: closed at the handshake timeout, see
            # test_ws_handshake.py; trio-websocket's client would wait for it here)
            # the sidecar shrugs all of that off
            await _completes(sc.ws, ssl_context=trusted, auth_token=TOKEN)


async def _debug_log_of_a_busy_sidecar(tmp_path: Path, marker: str, metadata_value: str) -> list[str]:
    """Run a sidecar at --log-level debug with auth through completed, rejected, failed and
    cancelled streams, refused handshakes and protocol errors, every request carrying
    ``marker`` as its prompt (and elsewhere), its metadata carrying ``metadata_value``; return
    the sidecar's log lines."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with trio.fail_after(40):
        async with mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "5") as engine:
            async with spawn(
                [
                    "--log-level",
                    "debug",
                    "run",
                    "--engine",
                    engine.address,
                    "--listen",
                    "127.0.0.1:0",
                    "--http-listen",
                    "127.0.0.1:0",
                    "--no-kv-events",
                    "--auth-token-file",
                    str(token_file),
                    "--inactivity-timeout",
                    "0.5",
                ]
            ) as proc:
                m = await proc.wait_for_line(re.compile(r"serving (ws://\S+) and (http://\S+)"))
                ws, http = m.group(1), m.group(2)
                md = {"x-user-data": metadata_value, "openengine-routing-key": metadata_value}
                async with open_sidecar(ws, auth_token=TOKEN) as client:
                    for request in (
                        generate_request(prompt=f"tell me {marker}", max_tokens=3),  # completes
                        generate_request(
                            prompt=marker, stopping={"maxTokens": 2, "conditions": [{"stopText": marker}]}
                        ),
                        generate_request(prompt=marker, model=f"no-such-{marker}"),  # rejected
                        generate_request(
                            prompt=marker, max_tokens=50, extra={"mock": {"faults": ["error-after=1"]}}
                        ),
                        generate_request(
                            prompt=marker, max_tokens=50, extra={"mock": {"faults": ["stall=1"]}}
                        ),
                        generate_request(
                            prompt=marker, max_tokens=50, extra={"mock": {"faults": ["token-after-finish"]}}
                        ),
                    ):
                        async with client.generate(request, md) as s:
                            async for _ in s:
                                pass
                    async with client.generate(generate_request(prompt=marker, max_tokens=500), md) as s:
                        async for _ in s:
                            break  # leaves the block: cancel + Abort
                auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
                async with open_websocket_url(ws, extra_headers=auth) as raw:
                    await raw.send_message(json.dumps({"type": marker, "stream": 1}))
                    await raw.get_message()
                    await raw.send_message(
                        json.dumps(
                            {"type": "generate", "stream": 2, "request": {"prompt": marker, marker: 1}}
                        )
                    )
                    await raw.get_message()
                with pytest.raises(ConnectionRejected):
                    async with open_websocket_url(
                        ws, extra_headers=[(b"authorization", f"Bearer {marker}".encode())]
                    ):
                        pass
                assert (await _get(http + "/metrics", token=marker)).status_code == 401
                assert (await _get(http + "/metrics", token=TOKEN)).status_code == 200
    assert any(" DEBUG " in line for line in proc.lines)  # the level really was debug
    return proc.lines


async def test_no_prompt_or_token_in_debug_logs(aio_loop: Any, tmp_path: Path) -> None:
    marker = "MARKER-" + uuid.uuid4().hex
    lines = await _debug_log_of_a_busy_sidecar(tmp_path, marker, "user-42")
    leaks = [line for line in lines if marker in line or TOKEN in line]
    assert leaks == [], "\n".join(leaks)


async def test_no_metadata_values_in_debug_logs(aio_loop: Any, tmp_path: Path) -> None:
    value = "MD-" + uuid.uuid4().hex
    lines = await _debug_log_of_a_busy_sidecar(tmp_path, "MARKER-" + uuid.uuid4().hex, value)
    leaks = [line for line in lines if value in line]
    assert leaks == [], "\n".join(leaks[:3])
