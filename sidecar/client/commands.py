"""``openengine-sidecar generate`` and ``disagg``: CLI clients of running sidecars."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO, TypeVar

import click
import msgspec
import trio

from sidecar.cli_common import error_line
from sidecar.cli_options import EXISTING_FILE, Seconds, command_option, read_token
from sidecar.client.disagg import DisaggFlow, open_disagg
from sidecar.client.sidecar_client import SidecarConnectionError, SidecarStream, open_sidecar, sidecar_url
from sidecar.north import wire

#: Exit status after a Ctrl-C that cancelled the stream (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

_encode_json = msgspec.json.Encoder().encode

F = TypeVar("F", bound=Callable[..., object])


class SidecarUrl(click.ParamType[str]):
    """A sidecar's WebSocket URL (``ws://``/``wss://``; ``HOST:PORT`` means ``ws://HOST:PORT``)."""

    name = "url"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            sidecar_url(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)
        return str(value)


SIDECAR_URL = SidecarUrl()


async def _cancel_on_sigint(stream: SidecarStream, err: TextIO, interrupted: list[bool]) -> None:
    """First Ctrl-C: send ``cancel`` and let the stream run to its ``end``; second: exit at once."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if interrupted:
                err.write("interrupted again: exiting without waiting for the end\n")
                err.flush()
                os._exit(EXIT_INTERRUPTED)
            interrupted.append(True)
            err.write("cancelling… (Ctrl-C again to exit at once)\n")
            err.flush()
            try:
                await stream.cancel()
            except SidecarConnectionError:
                return


async def run_generate(
    url: str,
    prompt: str,
    *,
    max_tokens: int | None = None,
    model: str | None = None,
    as_json: bool = False,
    encoding: str = "json",
    out: TextIO | None = None,
    err: TextIO | None = None,
    handle_sigint: bool = True,
    cancel_timeout: float = 10.0,
    auth_token: str | None = None,
) -> int:
    """Stream one completion to ``out``; return the exit status (0 completed, 1 failed / rejected /
    connection error, 130 cancelled by Ctrl-C). Errors are printed to ``err``."""
    out = out or sys.stdout
    err = err or sys.stderr
    request: dict[str, Any] = {"prompt": prompt}
    if model:
        request["model"] = model
    if max_tokens is not None:
        request["stopping"] = {"maxTokens": max_tokens}
    interrupted: list[bool] = []
    wrote_text = ""
    lost: SidecarConnectionError | None = None
    try:
        async with (
            open_sidecar(url, encoding=encoding, cancel_timeout=cancel_timeout, auth_token=auth_token) as sc,
            sc.generate(request) as stream,
            trio.open_nursery() as nursery,
        ):
            if handle_sigint:
                nursery.start_soon(_cancel_on_sigint, stream, err, interrupted)
            try:
                async for event in stream:
                    if as_json:
                        out.write(_encode_json(event).decode() + "\n")
                    elif event.response.token is not None and event.response.token.text:
                        wrote_text = event.response.token.text
                        out.write(wrote_text)
                    out.flush()
            except SidecarConnectionError as error:
                lost = error  # kept out of the nursery: no exception group
            nursery.cancel_scope.cancel(reason="stream ended")
    except SidecarConnectionError as error:  # connecting, or sending the request
        lost = error
    if lost is not None:
        if wrote_text and not wrote_text.endswith("\n"):
            out.write("\n")
        err.write(error_line(str(lost)) + "\n")
        return 1
    end = stream.end
    assert end is not None
    if as_json:
        out.write(_encode_json(end).decode() + "\n")
    elif wrote_text and not wrote_text.endswith("\n"):
        out.write("\n")
    out.flush()
    if end.outcome == "completed":
        return 0
    err.write(error_line(f"{end.outcome}: {_describe(end.error)}") + "\n")
    if end.outcome == "cancelled" and interrupted:
        return EXIT_INTERRUPTED
    return 1


def _describe(error: wire.ErrorBody | None) -> str:
    if error is None:
        return "no error details"
    retry = " (retryable)" if error.retryable else ""
    return f"{error.code}: {error.message}{retry}"


def client_options(command: str) -> Callable[[F], F]:
    """The flags ``generate`` and ``disagg`` share (each reading its own variables)."""
    option = command_option(command)
    decorators = [
        option("--max-tokens", type=click.IntRange(min=1), default=None, help="Stop after this many tokens."),
        option("--model", default=None, help="Served model name or alias (default: the sidecar's model)."),
        option("--json", "as_json", is_flag=True, help="Print each event and the end as JSON lines."),
        option(
            "--encoding",
            type=click.Choice(["json", "msgpack"]),
            default="json",
            show_default=True,
            help="Frame encoding on the WebSocket(s).",
        ),
        option(
            "--auth-token-file",
            "auth_token",
            type=EXISTING_FILE,
            callback=read_token,
            default=None,
            help="File holding the sidecar's bearer token (for a sidecar run with --auth-token-file).",
        ),
    ]

    def apply(f: F) -> F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


@click.command("generate")
@click.argument("prompt")
@command_option("generate")(
    "--sidecar",
    "sidecar_url",
    type=SIDECAR_URL,
    default="ws://127.0.0.1:8600",
    show_default=True,
    help="Sidecar WebSocket URL (ws:// or wss://; /v1/ws is added when the URL has no path).",
)
@client_options("generate")
def generate(
    prompt: str,
    sidecar_url: str,
    max_tokens: int | None,
    model: str | None,
    as_json: bool,
    encoding: str,
    auth_token: str | None,
) -> None:
    """Stream a completion of PROMPT from a running sidecar.

    Text goes to stdout as it arrives. Ctrl-C cancels the request and waits for the sidecar
    to confirm; a second Ctrl-C exits at once. Exit status: 0 completed, 1 failed or
    rejected (the error is printed), 130 cancelled by Ctrl-C.
    """
    status = trio.run(
        lambda: run_generate(
            sidecar_url,
            prompt,
            max_tokens=max_tokens,
            model=model,
            as_json=as_json,
            encoding=encoding,
            auth_token=auth_token,
        )
    )
    sys.exit(status)


async def _cancel_flow_on_sigint(scope: trio.CancelScope, err: TextIO, interrupted: list[bool]) -> None:
    """First Ctrl-C: cancel the flow (both sides are cancelled and their ends awaited);
    second: exit at once."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if interrupted:
                err.write("interrupted again: exiting without waiting for the sidecars\n")
                err.flush()
                os._exit(EXIT_INTERRUPTED)
            interrupted.append(True)
            err.write("cancelling both sides… (Ctrl-C again to exit at once)\n")
            err.flush()
            scope.cancel(reason="Ctrl-C")


async def run_disagg(
    prefill: Sequence[str],
    decode: Sequence[str],
    prompt: str,
    *,
    max_tokens: int | None = None,
    model: str | None = None,
    as_json: bool = False,
    encoding: str = "json",
    out: TextIO | None = None,
    err: TextIO | None = None,
    handle_sigint: bool = True,
    cancel_timeout: float = 10.0,
    connect_timeout: float = 5.0,
    auth_token: str | None = None,
) -> int:
    """One prefill/decode flow (``sidecar.client.disagg``); the decode's text goes to ``out``.

    ``--json``: one line per event, ``{"phase": "prefill"|"decode", ...the event}``, then the
    flow's end (``{"type": "end", "outcome", "error", "mode", "prefill", "decode", "room",
    "attempts"}``). Returns the exit status (0 completed, 1 failed / rejected, 130 cancelled by
    Ctrl-C); failures and skipped sidecars are printed to ``err``.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    request: dict[str, Any] = {"prompt": prompt}
    if model:
        request["model"] = model
    if max_tokens is not None:
        request["stopping"] = {"maxTokens": max_tokens}
    interrupted: list[bool] = []
    wrote_text = ""
    printed_prefill = 0

    def print_prefill(flow: DisaggFlow) -> None:
        nonlocal printed_prefill
        for event in flow.prefill_events[printed_prefill:]:
            out.write(_encode_json({"phase": "prefill", **msgspec.to_builtins(event)}).decode() + "\n")
        printed_prefill = len(flow.prefill_events)

    async with open_disagg(
        prefill,
        decode,
        encoding=encoding,
        connect_timeout=connect_timeout,
        describe_timeout=connect_timeout,
        cancel_timeout=cancel_timeout,
        auth_token=auth_token,
    ) as pd:
        async with trio.open_nursery() as nursery:
            flow_scope = trio.CancelScope()
            if handle_sigint:
                nursery.start_soon(_cancel_flow_on_sigint, flow_scope, err, interrupted)
            with flow_scope:
                async with pd.generate(request) as flow:
                    async for event in flow:
                        if as_json:
                            print_prefill(flow)
                            out.write(
                                _encode_json({"phase": "decode", **msgspec.to_builtins(event)}).decode()
                                + "\n"
                            )
                        elif event.response.token is not None and event.response.token.text:
                            wrote_text = event.response.token.text
                            out.write(wrote_text)
                        out.flush()
            nursery.cancel_scope.cancel(reason="flow ended")
    end = flow.end
    assert end is not None
    if as_json:
        print_prefill(flow)
        out.write(_encode_json({"type": "end", **msgspec.to_builtins(end)}).decode() + "\n")
    elif wrote_text and not wrote_text.endswith("\n"):
        out.write("\n")
    out.flush()
    for attempt in end.attempts:
        if attempt.result != "completed":
            detail = f"{attempt.code}: {attempt.message}" if attempt.code else attempt.message
            err.write(error_line(f"{attempt.role} {attempt.url}: {attempt.result} ({detail})") + "\n")
    if end.outcome == "completed":
        return 0
    err.write(error_line(f"{end.outcome}: {_describe(end.error)}") + "\n")
    if end.outcome == "cancelled" and interrupted:
        return EXIT_INTERRUPTED
    return 1


@click.command("disagg")
@click.argument("prompt")
@command_option("disagg")(
    "--prefill",
    "prefill_urls",
    type=SIDECAR_URL,
    multiple=True,
    required=True,
    help="Prefill sidecar WebSocket URL (repeatable: tried in order, the next when one is "
    "unreachable or refuses with a retryable error).",
)
@command_option("disagg")(
    "--decode",
    "decode_urls",
    type=SIDECAR_URL,
    multiple=True,
    required=True,
    help="Decode sidecar WebSocket URL (repeatable, tried in order).",
)
@client_options("disagg")
@command_option("disagg")(
    "--connect-timeout",
    type=Seconds(),
    default=5.0,
    show_default=True,
    help="Seconds to connect to and describe one sidecar before trying the next.",
)
def disagg(
    prompt: str,
    prefill_urls: tuple[str, ...],
    decode_urls: tuple[str, ...],
    max_tokens: int | None,
    model: str | None,
    as_json: bool,
    encoding: str,
    connect_timeout: float,
    auth_token: str | None,
) -> None:
    """Generate PROMPT with prefill/decode disaggregation across sidecars.

    Reads the worker cards of both sides, checks they pair (roles, handoff profile, transfer
    backend, media), then runs the handoff the connector uses: context-first (prefill, then
    decode with its KV session) or client bootstrap (both at once, sharing a bootstrap room).
    The decode's text goes to stdout. Ctrl-C cancels both sides and waits for them; a second
    Ctrl-C exits at once. Exit status: 0 completed, 1 failed or rejected, 130 cancelled by Ctrl-C.
    """
    status = trio.run(
        lambda: run_disagg(
            prefill_urls,
            decode_urls,
            prompt,
            max_tokens=max_tokens,
            model=model,
            as_json=as_json,
            encoding=encoding,
            connect_timeout=connect_timeout,
            auth_token=auth_token,
        )
    )
    sys.exit(status)
