"""The guard of ``sidecar.north._trio_websocket_internals``: every trio-websocket internal the
sidecar uses exists in the installed release (a release that renames or drops one fails here,
not in production), and no other north module names one."""

from __future__ import annotations

import ast
from pathlib import Path

import trio
import trio_websocket
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from sidecar.north import _trio_websocket_internals as internals
from sidecar.north import ws_batch
from tests.fuzz.rawws import RawWs
from tests.north.test_ws_adapter import serving

NORTH = Path(internals.__file__).parent


def test_pinned_trio_websocket_series() -> None:
    # the internals module reaches into 0.12's internals: review it before moving the pin
    assert trio_websocket.__version__.startswith("0.12."), trio_websocket.__version__


def test_every_private_method_used_exists_in_the_library() -> None:
    missing = [m for m in internals.PRIVATE_METHODS if not hasattr(WebSocketConnection, m)]
    assert missing == [], f"trio-websocket no longer has {missing}: review _trio_websocket_internals"


async def test_the_internals_exist_on_a_served_connection() -> None:
    seen: list[WebSocketConnection] = []

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        seen.append(ws)
        try:
            await ws.get_message()
        except ConnectionClosed:
            pass

    with trio.fail_after(10):
        async with serving(handler) as url:
            ws = await RawWs.connect(url)
            await ws.send_text("done")
            await ws.aclose()
    (conn,) = seen
    assert isinstance(conn, internals.SidecarWebSocket)
    assert internals.missing_internals(conn) == []
    assert ws_batch.supported(conn)
    assert isinstance(internals.write_lock(conn), trio.StrictFIFOLock)
    assert isinstance(internals.transport(conn), trio.abc.Stream)


def test_no_other_north_module_names_a_trio_websocket_internal() -> None:
    names = set(internals.PRIVATE_NAMES)
    found = []
    for path in sorted(NORTH.glob("*.py")):
        if path.name == "_trio_websocket_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in names
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == [], found
