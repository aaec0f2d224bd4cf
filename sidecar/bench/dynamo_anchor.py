"""The fleet benchmark's anchor: the leanest plain-asyncio Python Dynamo worker doing the sidecar's job.

    python -m sidecar.bench.dynamo_anchor --engine ADDR --pb2-dir DIR --model-path TOKDIR \\
        --model-name NAME --engine-model MODEL --namespace NS   (DYN_* planes from the environment)

It registers ``NAME`` (token input, chat + completions, the tokenizer directory as model
path) on ``NS.backend.generate`` and serves it: per Dynamo request one OpenEngine
``Generate`` stream over grpcio (asyncio API, official protobuf/upb bindings generated at
run time into ``DIR`` by :mod:`sidecar.bench.pb2`), each token event mapped to Dynamo's
chunk ``{"token_ids", "index"}`` and the finish to ``finish_reason`` + ``completion_usage``.
When Dynamo stops the request (the HTTP client left) or closes the generator early, the
call is cancelled and an ``Abort`` sent (in the background, bounded). It maps only what a
lean worker maps (token ids, max/min tokens, ignore_eos, stop token ids, basic sampling);
no admission, metrics, logprobs, media or disaggregation — the floor the sidecar's Dynamo
plane is measured against (``bench --scenarios dynamo``, docs/PERFORMANCE.md).

Benchmark-only; the only module outside ``sidecar/dynamo`` that imports Dynamo (a worker of
its own, in its own process). Prints ``anchor: serving NAME on PATH`` once registered.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

ABORT_TIMEOUT = 2.0
_FINISH = {1: "stop", 2: "length", 3: "cancelled"}


class Anchor:
    """The handler's state: the grpcio stub and the generated message classes."""

    def __init__(self, stubs: Any, gen: Any, life: Any, engine_model: str) -> None:
        self.inference, self.control = stubs
        self.gen, self.life = gen, life
        self.engine_model = engine_model
        self._aborts: set[asyncio.Task[None]] = set()

    def request(self, req: dict[str, Any], request_id: str) -> Any:
        gen = self.gen
        stop = req.get("stop_conditions") or {}
        sampling = req.get("sampling_options") or {}
        eos = set(req.get("eos_token_ids") or ())
        stopping = gen.StoppingOptions()
        if stop.get("max_tokens") is not None:
            stopping.max_tokens = stop["max_tokens"]
        if stop.get("min_tokens"):
            stopping.min_tokens = stop["min_tokens"]
        if stop.get("ignore_eos") is not None:
            stopping.ignore_eos = bool(stop["ignore_eos"])
        for tid in stop.get("stop_token_ids_hidden") or ():
            if tid not in eos:
                stopping.conditions.add(stop_token_id=tid)
        params = gen.SamplingParams()
        for name in ("temperature", "top_p"):
            if sampling.get(name) is not None:
                setattr(params, name, float(sampling[name]))
        if sampling.get("top_k") is not None and sampling["top_k"] > 0:
            params.top_k = int(sampling["top_k"])
        if sampling.get("seed") is not None:
            params.seed = int(sampling["seed"]) & (2**64 - 1)
        return gen.GenerateRequest(
            request_id=request_id,
            model=self.engine_model,
            token_ids=gen.TokenIds(ids=req["token_ids"]),
            sampling=params,
            stopping=stopping,
        )

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's endpoint handler."""
        rid = context.id()
        call = self.inference.Generate(self.request(request, rid))
        stopped = context.async_killed_or_stopped()
        stopped.add_done_callback(lambda _: call.cancel())
        finished = False
        try:
            async for resp in call:
                kind = resp.WhichOneof("event")
                if kind == "token":
                    tok = resp.token
                    chunk: dict[str, Any] = {
                        "token_ids": [t.token_id for t in tok.tokens],
                        "index": tok.output_index,
                    }
                    if resp.HasField("usage"):
                        chunk["completion_usage"] = _usage(resp.usage)
                    yield chunk
                elif kind == "finished":
                    fin = resp.finished
                    finished = True
                    chunk = {
                        "token_ids": [],
                        "index": fin.output_index,
                        "finish_reason": _FINISH.get(fin.reason, "stop"),
                    }
                    if resp.HasField("usage"):
                        chunk["completion_usage"] = _usage(resp.usage)
                    yield chunk
                elif kind == "error":
                    finished = True
                    raise RuntimeError(f"engine error: {resp.error.message}")
        except asyncio.CancelledError:
            if not stopped.done():
                raise
            # Dynamo stopped the request (its client left): the call is cancelled, end quietly
        finally:
            if not stopped.done():
                stopped.cancel()
            if not finished:
                call.cancel()
                task = asyncio.ensure_future(self._abort(rid))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def _abort(self, rid: str) -> None:
        try:
            async with asyncio.timeout(ABORT_TIMEOUT):
                await self.control.Abort(self.life.AbortRequest(request_id=rid))
        except Exception as err:  # NOT_FOUND (it had finished), timeout: nothing more to do
            print(f"anchor: abort {rid}: {type(err).__name__}", file=sys.stderr)


def _usage(u: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


async def serve(args: argparse.Namespace) -> None:
    import grpc
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    from sidecar.bench.pb2 import import_pb2

    gen, svc = import_pb2(args.pb2_dir)
    life = importlib.import_module("openengine.v1.lifecycle_pb2")
    target = args.engine
    if target.startswith("unix://"):
        target = "unix:" + target[len("unix://") :]
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop,
        os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"),
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with grpc.aio.insecure_channel(target) as channel:
        anchor = Anchor((svc.InferenceStub(channel), svc.ControlStub(channel)), gen, life, args.engine_model)
        path = f"{args.namespace}.backend.generate"
        endpoint = runtime.endpoint(path)
        rc = ModelRuntimeConfig()
        rc.enable_local_indexer = False
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            args.model_path,
            args.model_name,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=args.block_size,
            runtime_config=rc,
        )
        served = asyncio.ensure_future(endpoint.serve_endpoint(anchor.generate, graceful_shutdown=False))
        print(f"anchor: serving {args.model_name} on {path}", file=sys.stderr, flush=True)
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait([served, waiter], return_when=asyncio.FIRST_COMPLETED)
        runtime.shutdown()
        for fut in (served, waiter):
            fut.cancel()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m sidecar.bench.dynamo_anchor")
    p.add_argument("--engine", required=True)
    p.add_argument("--pb2-dir", required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--model-name", required=True)
    p.add_argument("--engine-model", required=True)
    p.add_argument("--namespace", default="anchor")
    p.add_argument("--block-size", type=int, default=16)
    asyncio.run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
