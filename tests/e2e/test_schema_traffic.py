"""Real traffic against the published JSON Schema (docs/protocol.schema.json, GET /v1/schema).

A real sidecar in front of the simulated engine (an aggregated one, and a prefill one for
``prefillReady`` and ``releaseKvSession``), a raw WebSocket client that records every message
both ways -- in JSON and in msgpack -- and the independent ``jsonschema`` validator: every
client message kind (each call method's params), every server message kind (each event kind,
``events``, each ``end`` outcome, each method's successful and failed ``result``, both kinds
of ``protocol_error``), and the HTTP answers (``/v1/worker``, ``/v1/load``) must validate.
The test also proves it saw every kind. msgpack frames are validated as the JSON they map to
(a ``bin`` is base64 text: docs/PROTOCOL.md)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from sidecar.north import wire
from sidecar.openengine import pb
from tests.e2e.harness import eventually, generate_request, mock_engine, sidecar
from tests.north.test_schema import SCHEMA_FILE, as_json, errors

SIDECAR_ARGS = ("--no-kv-events", "--load-interval", "0.1")
EVENT_KINDS = {"prompt", "token", "prefillReady", "finished", "error"}


class Validators:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._cache: dict[str, Any] = {}

    def __getitem__(self, definition: str) -> Any:
        if definition not in self._cache:
            doc = {k: v for k, v in self.schema.items() if k != "anyOf"}
            doc["$ref"] = f"#/$defs/{definition}"
            self._cache[definition] = jsonschema.Draft202012Validator(doc)
        return self._cache[definition]


class Recorder:
    """Validates and counts every message of one or more connections (see module doc)."""

    def __init__(self, validators: Validators) -> None:
        self.v = validators
        self.methods: dict[Any, str] = {}  # call id -> method, to check result bodies
        self.seen: Counter[str] = Counter()
        self.problems: list[str] = []

    def check(self, definition: str, value: Any, what: str) -> None:
        found = errors(self.v[definition], value)
        if found:
            self.problems.append(
                f"{what} is not a valid {definition}: {found[:3]} in {json.dumps(value)[:300]}"
            )

    def sent(self, frame: str | bytes, *, valid: bool) -> None:
        """``valid=False``: a message the sidecar refuses as invalid -- the schema must refuse it too."""
        msg = as_json(frame)
        enc = "json" if isinstance(frame, str) else "msgpack"
        if msg.get("type") == "call":
            self.methods[msg["call"]] = msg["method"]
        if not valid:
            if not errors(self.v["ClientMessage"], msg):
                self.problems.append(f"the schema accepts {json.dumps(msg)[:300]}, which the sidecar refuses")
            self.seen[f"client invalid {enc}"] += 1
            return
        self.check("ClientMessage", msg, f"sent {enc} {msg.get('type')}")
        self.seen[f"client {msg['type']} {enc}"] += 1
        if msg["type"] == "call":
            self.check(f"call.{msg['method']}.params", msg.get("params") or {}, f"{msg['method']} params")

    def received(self, frame: str | bytes) -> Any:
        msg = as_json(frame)
        enc = "json" if isinstance(frame, str) else "msgpack"
        self.check("ServerMessage", msg, f"received {enc} {msg.get('type')}")
        self.seen[f"server {msg['type']} {enc}"] += 1
        for item in msg["items"] if msg["type"] == "events" else [msg]:
            self._count(item, enc)
        return msg

    def _count(self, msg: dict[str, Any], enc: str) -> None:
        kind = msg["type"]
        if kind == "event":
            (event_kind,) = EVENT_KINDS & set(msg["response"])
            self.seen[f"event {event_kind} {enc}"] += 1
        elif kind == "end":
            self.seen[f"end {msg['outcome']} {enc}"] += 1
        elif kind == "result":
            method = self.methods[msg["call"]]
            self.seen[f"result {method} {'ok' if msg['ok'] else 'error'} {enc}"] += 1
            if msg["ok"]:
                self.check(f"call.{method}.result", msg["body"], f"{method} result body")
        elif kind == "protocol_error":
            self.seen[f"protocol_error {'id' if 'stream' in msg or 'call' in msg else 'plain'} {enc}"] += 1


class Client:
    """One raw connection whose every frame goes through the recorder."""

    def __init__(self, ws: WebSocketConnection, rec: Recorder, encoding: str) -> None:
        self.ws, self.rec, self.encoding = ws, rec, encoding
        self.n = 0

    async def send(self, msg: dict[str, Any], *, valid: bool = True) -> None:
        frame: str | bytes = json.dumps(msg) if self.encoding == "json" else msgspec.msgpack.encode(msg)
        self.rec.sent(frame, valid=valid)
        await self.ws.send_message(frame)

    async def next(self) -> dict[str, Any]:
        msg: dict[str, Any] = self.rec.received(await self.ws.get_message())
        return msg

    async def until(self, kind: str, key: str, value: Any) -> list[dict[str, Any]]:
        """Messages up to and including the first ``kind`` whose ``key`` is ``value``."""
        got = []
        while True:
            msg = await self.next()
            got.append(msg)
            if msg["type"] == kind and msg.get(key) == value:
                return got

    async def stream(self, stream: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
        await self.send({"type": "generate", "stream": stream, "request": request})
        return await self.until("end", "stream", stream)

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, ok: bool = True, valid: bool = True
    ) -> Any:
        """A call and its result (``ok`` expected); ``valid=False``: a message the schema refuses."""
        self.n += 1
        call_id: Any = self.n if self.n % 2 else f"c{self.n}"
        msg: dict[str, Any] = {"type": "call", "call": call_id, "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg, valid=valid)
        (*_, result) = await self.until("result", "call", call_id)
        assert result["ok"] is ok, (method, params, result)
        return result.get("body")


async def aggregated_traffic(c: Client, lora_dir: Path) -> None:
    logprobs = {
        "returnPromptLogprobs": True,
        "promptCandidates": {"topN": 2},
        "returnOutputLogprobs": True,
        "outputCandidates": {"topN": 2},
    }
    msgs = await c.stream(1, generate_request(max_tokens=3, response=logprobs, sampling={"seed": "7"}))
    assert msgs[-1]["outcome"] == "completed"
    assert (await c.stream("r", generate_request(model="no-such-model")))[-1]["outcome"] == "rejected"
    failing = generate_request(max_tokens=5, extra={"mock": {"faults": ["error-after=1"]}})
    assert (await c.stream(2, failing))[-1]["outcome"] == "failed"
    stalled = generate_request(max_tokens=50, extra={"mock": {"faults": ["stall=1"]}})
    await c.send({"type": "generate", "stream": "s", "request": stalled})
    await c.until("event", "stream", "s")
    await c.send({"type": "generate", "stream": "s", "request": generate_request()})  # id in use
    await c.until("protocol_error", "stream", "s")
    await c.send({"type": "bogus"}, valid=False)
    await c.until("protocol_error", "message", "invalid message: Invalid value 'bogus' - at `$.type`")
    await c.send({"type": "cancel", "stream": "s"})
    assert (await c.until("end", "stream", "s"))[-1]["outcome"] == "cancelled"

    adapter = {"loraId": "5", "loraName": "sql", "sourcePath": str(lora_dir)}
    await c.call("describe")
    await c.call("describe", {"x": 1}, ok=False, valid=False)
    await c.call("load", {"includePerRank": True})
    await c.call("load", {"includePerRank": "yes"}, ok=False, valid=False)
    await c.call("health")
    await c.call("health", {"includeInferenceProbe": True, "role": "ENGINE_ROLE_AGGREGATED"})
    await c.call("health", {"model": "no-such-model", "includeInferenceProbe": True}, ok=False)
    await c.call("loadLora", {"adapter": adapter})
    await c.call("loadLora", {"adapter": {**adapter, "loraId": "0"}}, ok=False)
    await c.call("listLoras", {})
    await c.call("listLoras", {"bogus": 1}, ok=False, valid=False)
    await c.call("unloadLora", {"loraName": "sql"})
    await c.call("unloadLora", {"loraName": "sql"}, ok=False)
    await c.call("noSuchMethod", ok=False, valid=False)


async def prefill_traffic(c: Client) -> None:
    msgs = await c.stream(1, generate_request(max_tokens=1))
    ready = [m for m in msgs if m["type"] == "event" and "prefillReady" in m["response"]]
    assert len(ready) == 1 and msgs[-1]["outcome"] == "completed"
    await c.call("releaseKvSession", {"kvSessionBytes": ready[0]["kvSessionBytes"]})
    unknown = pb.KvSessionRef(session_id="nobody-holds-this", transfer_backend="nixl")
    await c.call("releaseKvSession", {"kvSessionBytes": base64.b64encode(bytes(unknown)).decode()}, ok=False)


async def coalesced_events(url: str, rec: Recorder, encoding: str) -> None:
    """A client that opted in to ``events`` frames (coalesce=1) and reads only after its streams
    ended: what queued up meanwhile comes coalesced (bounded: a few rounds at most)."""
    async with open_websocket_url(url + "?coalesce=1") as ws:
        c = Client(ws, rec, encoding)
        for round_ in range(20):
            streams = [f"{round_}-{i}" for i in range(8)]
            for s in streams:
                await c.send({"type": "generate", "stream": s, "request": generate_request(max_tokens=64)})
            ends = 0
            while ends < len(streams):
                msg = await c.next()
                items = msg["items"] if msg["type"] == "events" else [msg]
                ends += sum(1 for m in items if m["type"] == "end")
            if rec.seen[f"server events {encoding}"]:
                return


def expected_kinds() -> set[str]:
    kinds = set()
    for enc in ("json", "msgpack"):
        kinds |= {f"client {t} {enc}" for t in ("generate", "cancel", "call")}
        kinds |= {f"server {t} {enc}" for t in ("event", "events", "end", "result", "protocol_error")}
        kinds |= {f"event {k} {enc}" for k in EVENT_KINDS}
        kinds |= {f"end {o} {enc}" for o in wire.OUTCOMES}
        kinds |= {f"result {m} {r} {enc}" for m in wire.CALL_METHODS for r in ("ok", "error")}
        kinds |= {f"protocol_error {k} {enc}" for k in ("id", "plain")}
        kinds.add(f"client invalid {enc}")
    return kinds


async def test_real_traffic_of_every_message_kind_validates(aio_loop: Any, tmp_path: Path) -> None:
    lora_dir = tmp_path / "loras" / "sql"
    lora_dir.mkdir(parents=True)
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--dp-size", "2") as agg,
            mock_engine(tmp_path, "--flavor", "vllm", "--role", "prefill", name="prefill") as pre,
            sidecar(agg.address, *SIDECAR_ARGS) as sc,
            sidecar(pre.address, *SIDECAR_ARGS) as psc,
            httpx.AsyncClient() as http,
        ):
            served = await http.get(sc.http + "/v1/schema", timeout=5)
            assert served.status_code == 200
            assert served.headers["content-type"] == "application/schema+json"
            assert served.content == SCHEMA_FILE.read_bytes()  # the published schema is the served one
            schema = served.json()
            jsonschema.Draft202012Validator.check_schema(schema)
            rec = Recorder(Validators(schema))
            await eventually(lambda: _snapshot(http, sc.http))
            for encoding in ("json", "msgpack"):
                async with open_websocket_url(sc.ws) as ws:
                    await aggregated_traffic(Client(ws, rec, encoding), lora_dir)
                async with open_websocket_url(psc.ws) as ws:
                    await prefill_traffic(Client(ws, rec, encoding))
            for encoding in ("json", "msgpack"):
                await coalesced_events(sc.ws, rec, encoding)
            for url, definition in (
                (sc.http + "/v1/worker", "WorkerCard"),
                (sc.http + "/v1/load", "LoadStatus"),
            ):
                body = (await http.get(url, timeout=5)).json()
                rec.check(definition, body, f"GET {url}")
            body = (await http.get(psc.http + "/v1/worker", timeout=5)).json()
            rec.check("WorkerCard", body, "GET /v1/worker of the prefill sidecar")
    print(f"observed: {dict(sorted(rec.seen.items()))}")
    assert rec.problems == [], "\n".join(rec.problems[:10])
    missing = expected_kinds() - set(rec.seen)
    assert not missing, f"never observed: {sorted(missing)}"


async def _snapshot(http: httpx.AsyncClient, base: str) -> bool:
    return (await http.get(base + "/v1/load", timeout=5)).json()["snapshot"] is not None
