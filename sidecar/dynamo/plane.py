"""The Dynamo worker plane: this sidecar as a worker of a Dynamo deployment.

Started by ``run --dynamo`` in the root nursery, beside the WebSocket plane:

    Dynamo plane
    ├─ DistributedRuntime (Dynamo's Rust runtime, driven through the trio-asyncio loop)
    ├─ stream bridge: one trio task per Dynamo request (the same lifecycle as WebSocket)
    ├─ endpoint ``namespace.component.endpoint`` served with the bridge's handler
    ├─ model registration from the worker card (``registration.py``)
    ├─ KV relay: one Dynamo ``KvEventPublisher`` per DP rank, in ZMQ relay mode, subscribed
    │  to this sidecar's own vLLM-format publisher of that rank
    └─ routability watch: leaves Dynamo's discovery while the engine is not ready, rejoins
       when it is back; follows loaded/unloaded LoRA adapters (woken by the sidecar's
       change event, ``Sidecar.changes``; a failed update is retried after ``RETRY_DELAY``)

Before the runtime is built, etcd (and NATS, when a plane uses it) must accept connections
(``reachability.py``: an asynchronous wait with progress lines, bounded by
``--startup-deadline``; Dynamo's own constructor would block the event loop retrying).

**Lost runtime.** Dynamo's runtime shuts itself down when it loses its etcd lease for good —
e.g. etcd came back empty after a failover — and its endpoint leaves discovery. The sidecar
notices (the endpoint's ``serve_endpoint`` returns without being asked to), turns ``/ready``
503 ("Dynamo runtime lost …"), counts it (``openengine_sidecar_dynamo_runtime_restarts``),
builds a new runtime once the planes answer, and registers everything again (new lease, new
instance id): the worker recovers in place. Streams in flight are unaffected on the sidecar's
side (the WebSocket plane never stops; Dynamo streams end with their request stream). If the
planes stay unreachable for ``--startup-deadline``, the plane raises ``StartupError`` and the
process exits 1 for its supervisor — never a live worker nobody can discover.

:meth:`DynamoPlane.leave` (the first step of ``run``'s stop, before the drain; a second
signal cancels it) removes the endpoint instance and the model registrations, so Dynamo
routes no new work here, then waits ``unregister_grace`` for routers to notice: at most
:attr:`DynamoPlane.leave_budget` seconds. Resources: the runtime is shut down when the
plane's task is cancelled. Errors at startup raise ``StartupError`` (one line).
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

import trio
import trio_asyncio

from sidecar.core.card import WorkerCard
from sidecar.core.sidecar import Sidecar, StartupError
from sidecar.dynamo import metrics
from sidecar.dynamo.config import DynamoConfig
from sidecar.dynamo.handler import StreamBridge
from sidecar.dynamo.reachability import PlanesUnreachable, plane_servers, wait_for_planes
from sidecar.dynamo.registration import (
    LoraRegistration,
    ModelRegistration,
    RegistrationError,
    media_routing_note,
    plan_registrations,
)

log = logging.getLogger(__name__)

#: Bound of one call into Dynamo's runtime (registration, unregistration).
CALL_TIMEOUT = 30.0
#: Bound of all the unregistration calls when leaving (stopping).
LEAVE_TIMEOUT = 10.0
#: Seconds before a failed discovery update (leave / rejoin / LoRA) is tried again.
RETRY_DELAY = 1.0
#: Pause between two attempts to rebuild a lost runtime (doubling up to ``REBUILD_MAX``).
REBUILD_PAUSE = 0.5
REBUILD_MAX = 5.0
PLANE = "dynamo"


def dynamo_event_loop() -> AbstractAsyncContextManager[object]:
    """The asyncio event loop Dynamo's runtime runs on (trio-asyncio, inside the sidecar's trio
    run): ``run --dynamo`` opens it around its services; nothing else in the sidecar needs one."""
    loop: AbstractAsyncContextManager[object] = trio_asyncio.open_loop()
    return loop


def import_dynamo() -> Any:
    """The ``dynamo`` modules (``llm``, ``runtime``); ``StartupError`` when the extra is missing."""
    try:
        import dynamo.llm as llm
        import dynamo.runtime as runtime
    except ImportError as err:
        raise StartupError(
            f"--dynamo needs Dynamo's runtime ({err}); install it with scripts/install-dynamo"
        ) from None
    return llm, runtime


def _relay_endpoint(endpoint: str) -> str:
    """A connectable form of a publisher's bound endpoint (wildcards → loopback)."""
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"//{wildcard}:", "//127.0.0.1:")
    return endpoint.replace("//[::]:", "//[::1]:")


class DynamoPlane:
    """See the module doc. Create, then ``await nursery.start(plane.run)``."""

    def __init__(self, sidecar: Sidecar, config: DynamoConfig, *, kv_topic: str = "") -> None:
        self.sidecar = sidecar
        self.config = config
        #: Topic of this sidecar's KV publisher (``--kv-topic``).
        self.kv_topic = kv_topic
        self.llm, self.rt = import_dynamo()
        self.loop: Any = None
        self.runtime: Any = None
        self.endpoint: Any = None
        self.bridge: StreamBridge | None = None
        self.plans: list[ModelRegistration] = []
        self.publishers: list[Any] = []
        self.routable = False
        self.left = False
        self._loras: set[str] = set()
        self._lock = trio.Lock()

    @property
    def path(self) -> str:
        card = self.sidecar.card
        return self.config.endpoint_path(card.role if card else "")

    async def _aio(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Await an asyncio-flavoured Dynamo call, bounded by ``CALL_TIMEOUT``."""
        with trio.fail_after(CALL_TIMEOUT):
            return await trio_asyncio.aio_as_trio(partial(fn, *args, **kwargs), loop=self.loop)()

    # -- the service -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Register and serve until cancelled; ``task_status.started(endpoint path)``."""
        card = self.sidecar.card
        if card is None:
            raise StartupError("Dynamo plane: the engine is not discovered")
        try:
            self.plans = plan_registrations(card, self.config)
        except RegistrationError as err:
            raise StartupError(f"Dynamo registration: {err}") from None
        self.loop = trio_asyncio.current_loop.get()
        if self.loop is None:
            raise StartupError("Dynamo plane: no trio-asyncio loop")
        try:
            self.bridge = StreamBridge(self.sidecar, self.loop)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.bridge.run)
                try:
                    await self._connect(card, "startup")
                except PlanesUnreachable as err:
                    raise StartupError(f"Dynamo: {err}") from None
                await self._note_media()
                nursery.start_soon(self._serve_and_rebuild)
                log.info(
                    "Dynamo: serving %s as %s (%s) in namespace %s",
                    ", ".join(p.name for p in self.plans),
                    self.path,
                    card.role,
                    self.config.namespace,
                )
                task_status.started(self.path)
                await self._watch()
        finally:
            metrics.ROUTABLE.set(0)
            self._teardown()

    async def _connect(self, card: WorkerCard, why: str) -> None:
        """Wait for the planes, build the runtime, register ``card``, start the KV relay.
        Raises ``PlanesUnreachable`` after ``--startup-deadline``, ``StartupError`` (one line)
        when the runtime or the registration fails."""
        cfg = self.config

        def waiting(problem: str) -> None:
            self.sidecar.set_plane_problem(PLANE, f"Dynamo: {problem}")

        await wait_for_planes(
            plane_servers(cfg), self.sidecar.config.startup_deadline, what=why, waiting=waiting
        )
        try:
            runtime = self.rt.DistributedRuntime(
                self.loop, cfg.discovery_backend, cfg.request_plane, event_plane=cfg.event_plane
            )
        except Exception as err:
            raise StartupError(
                f"Dynamo runtime ({cfg.discovery_backend}/{cfg.request_plane}): {err}"
            ) from None
        self.runtime = runtime
        try:
            self.endpoint = runtime.endpoint(self.path)
            self._loras = set()
            await self._register(card)
        except Exception as err:
            raise StartupError(f"Dynamo registration of {self.path}: {err}") from None
        self._start_kv_relay(card)
        self.routable = True
        metrics.ROUTABLE.set(1)
        self.sidecar.set_plane_problem(PLANE, None)

    def _teardown(self) -> None:
        """Stop the KV relay and shut the runtime down (idempotent)."""
        publishers, self.publishers = self.publishers, []
        for publisher in publishers:
            try:
                publisher.shutdown()
            except Exception as err:  # pragma: no cover - best effort
                log.debug("KV publisher shutdown: %s", err)
        runtime, self.runtime, self.endpoint = self.runtime, None, None
        if runtime is not None:
            try:
                runtime.shutdown()
            except Exception as err:  # pragma: no cover - best effort
                log.debug("Dynamo runtime shutdown: %s", err)

    async def _serve_and_rebuild(self) -> None:
        """Serve the endpoint; when Dynamo's runtime shuts down on its own, rebuild it (module doc)."""
        while True:
            try:
                await self._serve_endpoint()
                why = "its endpoint stopped serving"
            except Exception as err:
                why = f"its endpoint failed: {err}"
            if self.left:
                return
            metrics.RUNTIME_RESTARTS.inc()
            problem = f"Dynamo runtime lost ({why}; e.g. its etcd lease expired): re-registering"
            log.error("Dynamo: the runtime shut down on its own (%s); building a new one", why)
            async with self._lock:
                self.routable = False
                metrics.ROUTABLE.set(0)
                self._teardown()
            self.sidecar.set_plane_problem(PLANE, problem)
            await self._rebuild()
            if self.left:
                return
            log.info("Dynamo: registered again as %s", self.path)

    async def _rebuild(self) -> None:
        """Build and register a new runtime, retrying until it works or the planes have been
        unreachable for ``--startup-deadline`` (then ``StartupError``: the process exits 1)."""
        pause = REBUILD_PAUSE
        while not self.left:
            card = self.sidecar.card
            assert card is not None
            try:
                self.plans = plan_registrations(card, self.config)
                async with self._lock:
                    if self.left:
                        return
                    await self._connect(card, "re-registering")
                return
            except PlanesUnreachable as err:
                raise StartupError(f"Dynamo: {err} while re-registering") from None
            except StartupError as err:
                log.warning("Dynamo: rebuilding the runtime failed (%s); retrying in %.1fs", err, pause)
            except RegistrationError as err:
                log.warning("Dynamo: cannot register the engine's card (%s); retrying in %.1fs", err, pause)
            self._teardown()
            await trio.sleep(pause)
            pause = min(pause * 2, REBUILD_MAX)

    async def _serve_endpoint(self) -> None:
        assert self.bridge is not None and self.endpoint is not None
        await trio_asyncio.aio_as_trio(self.endpoint.serve_endpoint, loop=self.loop)(
            self.bridge.handler, graceful_shutdown=False
        )

    # -- registration ------------------------------------------------------------------------

    def _runtime_config(self, plan: ModelRegistration) -> Any:
        rc = self.llm.ModelRuntimeConfig()
        for name in ("context_length", "total_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(plan, name)
            if value is not None:
                setattr(rc, name, value)
        rc.data_parallel_start_rank = plan.dp_start_rank
        rc.data_parallel_size = plan.dp_size
        if plan.tool_call_parser:
            rc.tool_call_parser = plan.tool_call_parser
        if plan.reasoning_parser:
            rc.reasoning_parser = plan.reasoning_parser
        rc.kv_event_publishing_enabled = bool(self._kv_endpoints(self.sidecar.card))
        rc.enable_local_indexer = bool(self._kv_endpoints(self.sidecar.card)) and self.config.kv_events
        if plan.bootstrap is not None:
            rc.set_disaggregated_endpoint(plan.bootstrap[0], plan.bootstrap[1])
        return rc

    def _model_type(self, plan: ModelRegistration) -> Any:
        types = self.llm.ModelType
        out = None
        for name in plan.model_types:
            t = {"chat": types.Chat, "completions": types.Completions, "prefill": types.Prefill}[name]
            out = t if out is None else out | t
        return out

    def _worker_type(self, role: str) -> Any:
        wt = self.llm.WorkerType
        return {"aggregated": wt.Aggregated, "prefill": wt.Prefill, "decode": wt.Decode}[role]

    async def _register(self, card: WorkerCard) -> None:
        llm = self.llm
        for plan in self.plans:
            await self._aio(
                llm.register_model,
                llm.ModelInput.Tokens,
                self._model_type(plan),
                self.endpoint,
                plan.model_path,
                plan.name,
                worker_type=self._worker_type(plan.worker_type),
                kv_cache_block_size=plan.kv_block_size,
                runtime_config=self._runtime_config(plan),
                needs=[[self._worker_type(r) for r in group] for group in plan.needs] or None,
                model_aliases=plan.aliases or None,
            )
            for lora in plan.loras:
                await self._register_lora(plan, lora)

    async def _note_media(self) -> None:
        """Log each model's media and whether Dynamo's media-aware KV routing matches the engine."""
        try:
            from dynamo import _core

            resolve = getattr(_core, "resolve_routing_image_token_id", None)
        except ImportError:  # pragma: no cover - Dynamo's bindings always have _core
            resolve = None
        for plan in self.plans:
            log.info("Dynamo: %s media: %s", plan.name, plan.media.describe())
            frontend_token = None
            if resolve is not None and "image" in plan.media.modalities:
                try:  # reads the model directory's configs and tokenizer: off the event loop
                    frontend_token = await trio.to_thread.run_sync(resolve, plan.model_path, plan.model_path)
                except Exception as err:
                    log.debug("Dynamo: resolving the routing image token of %s: %s", plan.name, err)
            note = media_routing_note(plan, frontend_token)
            if note is not None:
                log.log(note[0], "Dynamo: %s: %s", plan.name, note[1])

    async def _register_lora(self, plan: ModelRegistration, lora: LoraRegistration) -> None:
        llm = self.llm
        await self._aio(
            llm.register_model,
            llm.ModelInput.Tokens,
            self._model_type(plan),
            self.endpoint,
            lora.base_model_path,
            kv_cache_block_size=plan.kv_block_size,
            runtime_config=self._runtime_config(plan),
            user_data={"lora_adapter": True, "lora_id": lora.lora_id},
            lora_name=lora.lora_name,
            base_model_path=lora.base_model_path,
            worker_type=self._worker_type(plan.worker_type),
            needs=[[self._worker_type(r) for r in group] for group in plan.needs] or None,
        )
        self._loras.add(lora.lora_name)

    # -- KV relay ----------------------------------------------------------------------------

    @staticmethod
    def _kv_endpoints(card: WorkerCard | None) -> list[str]:
        return list(card.kv_publish_endpoints) if card is not None else []

    def _start_kv_relay(self, card: WorkerCard) -> None:
        endpoints = self._kv_endpoints(card)
        if not self.config.kv_events:
            log.info("Dynamo: KV event relay disabled (--no-dynamo-kv-events)")
            return
        if not endpoints:
            log.info("Dynamo: no KV event publisher on this sidecar; Dynamo's KV router gets no events")
            return
        block_size = card.capacity.kv_block_size if card.capacity else None
        if not block_size:
            log.warning("Dynamo: the engine reports no KV block size; KV events are not relayed")
            return
        image_token_id = next(
            (
                m.multimodal.routing_image_token_id
                for m in card.models
                if m.multimodal is not None and m.multimodal.routing_image_token_id is not None
            ),
            None,
        )
        for rank, endpoint in zip(card.dp_ranks, endpoints, strict=False):
            zmq_endpoint = _relay_endpoint(endpoint)
            self.publishers.append(
                self.llm.KvEventPublisher(
                    endpoint=self.endpoint,
                    kv_block_size=block_size,
                    dp_rank=rank,
                    enable_local_indexer=True,
                    zmq_endpoint=zmq_endpoint,
                    zmq_topic=self.kv_topic,
                    image_token_id=image_token_id,
                )
            )
            log.info("Dynamo: relaying KV events of DP rank %d from %s", rank, zmq_endpoint)

    # -- routability -------------------------------------------------------------------------

    async def _set_routable(self, routable: bool) -> None:
        async with self._lock:
            if routable == self.routable or (routable and self.left) or self.endpoint is None:
                return
            if routable:
                await self._aio(self.endpoint.register_endpoint_instance)
            else:
                await self._aio(self.endpoint.unregister_endpoint_instance)
            self.routable = routable
            metrics.ROUTABLE.set(1 if routable else 0)
            log.info("Dynamo: %s %s", "rejoined" if routable else "left", self.path)

    async def _watch(self) -> None:
        """Follow engine readiness (leave / rejoin discovery) and loaded LoRA adapters: on
        every change the sidecar reports (readiness, card, a plane problem set or cleared — a
        rebuilt runtime clears its own), and again after ``RETRY_DELAY`` when an update failed."""
        while not self.left:
            changed = self.sidecar.changes()  # before reading the state it guards
            retry = False
            try:
                await self._set_routable(self.sidecar.engine_not_ready_reason() is None)
                await self._sync_loras()
            except (Exception, trio.TooSlowError) as err:
                log.warning("Dynamo: discovery update failed: %s", err)
                retry = True
            with trio.move_on_after(RETRY_DELAY if retry else math.inf):
                await changed.wait()
        await trio.sleep_forever()  # left: the plane's task ends when it is cancelled

    async def _sync_loras(self) -> None:
        card = self.sidecar.card
        if card is None or card.lora_adapters is None or len(self.plans) != 1 or self.endpoint is None:
            return
        plan = self.plans[0]
        current = {a.lora_name: a for a in card.lora_adapters if a.base_model == plan.name}
        for name in sorted(set(current) - self._loras):
            a = current[name]
            await self._register_lora(
                plan, LoraRegistration(a.lora_name, a.lora_id, plan.model_path, plan.name)
            )
            log.info("Dynamo: registered LoRA %s", name)
        for name in sorted(self._loras - set(current)):
            await self._aio(self.llm.unregister_model, self.endpoint, lora_name=name)
            self._loras.discard(name)
            log.info("Dynamo: unregistered LoRA %s", name)

    @property
    def leave_budget(self) -> float:
        """Most seconds :meth:`leave` takes (part of ``run``'s stop deadline)."""
        return LEAVE_TIMEOUT + self.config.unregister_grace

    async def leave(self) -> None:
        """Stop being routable in Dynamo (endpoint instance and model cards), then wait the grace.

        Bounded by :attr:`leave_budget`; failures are logged (the drain goes on regardless).
        """
        if self.left:
            return
        self.left = True
        if self.endpoint is None:
            log.info("Dynamo: leaving while not registered (runtime being rebuilt)")
            return
        with trio.move_on_after(LEAVE_TIMEOUT):
            try:
                async with self._lock:
                    if self.routable:
                        await self._aio(self.endpoint.unregister_endpoint_instance)
                    for name in sorted(self._loras):
                        await self._aio(self.llm.unregister_model, self.endpoint, lora_name=name)
                    await self._aio(self.llm.unregister_model, self.endpoint)
                    self.routable = False
                    metrics.ROUTABLE.set(0)
            except Exception as err:
                log.warning("Dynamo: leaving discovery failed: %s", err)
        log.info("Dynamo: left %s; draining in %.1fs", self.path, self.config.unregister_grace)
        await trio.sleep(self.config.unregister_grace)


async def start_dynamo_plane(
    root: trio.Nursery, sidecar: Sidecar, config: DynamoConfig | None, *, kv_topic: str = ""
) -> DynamoPlane | None:
    """Start the plane in ``root`` when configured; ``StartupError`` when it cannot serve."""
    if config is None:
        return None
    plane = DynamoPlane(sidecar, config, kv_topic=kv_topic)
    await root.start(plane.run)
    return plane
