"""The SGLang adapter's engine beside SGLang's ``Engine``: admission, Abort in SGLang, Health, GetLoad.

One :class:`SglangEngine` per process (asyncio, one event loop: SGLang's tokenizer manager runs
on it). The request registry, Abort and Drain are the engine-neutral
:class:`~sidecar.engines.common.registry.AdapterEngine`; this class plans requests for SGLang
(``requests.plan_request``), aborts them through SGLang's tokenizer manager
(``abort_request`` per rid: the scheduler frees the request) and reports SGLang's state.

Load counts the registry (what is in flight here: the adapter is SGLang's only submitter),
split by SGLang's own load snapshot (running, waiting, used KV tokens), read on every GetLoad;
SGLang's request table (``rid_to_state``) says what its tokenizer manager still holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sidecar.engines.common.registry import AdapterEngine
from sidecar.engines.sglang.discovery import SglangDiscovery
from sidecar.engines.sglang.requests import SglangPlan, plan_request, sglang_rid
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

log = logging.getLogger(__name__)


class SglangEngine(AdapterEngine):
    """Admission, Abort, Health and GetLoad around one SGLang ``Engine`` (registry and Drain inherited)."""

    def __init__(self, sgl: Any, discovery: SglangDiscovery) -> None:
        super().__init__()
        self.sgl = sgl
        self.discovery = discovery
        self.snapshot: Any = None
        #: SGLang's scheduler and detokenizer processes (``multiprocessing`` children), checked by Health
        self.children: list[Any] = []

    @property
    def tokenizer_manager(self) -> Any:
        return self.sgl.tokenizer_manager

    @property
    def held(self) -> int:
        """Requests SGLang's tokenizer manager still holds (its ``rid_to_state``)."""
        return len(self.tokenizer_manager.rid_to_state)

    @property
    def engine_busy(self) -> int:
        return self.held

    @property
    def instance_id(self) -> str:
        return self.discovery.server.instance_id

    def alive(self) -> str | None:
        """Why SGLang cannot serve (its tokenizer manager unhealthy, a subprocess gone), if it cannot."""
        tm = self.tokenizer_manager
        # SGLang's HTTP server marks the status Up after its warm-up; through the Engine API it
        # stays Starting, so only an exit or an UnHealthy status count here
        if tm.gracefully_exit or tm.server_status.name == "UnHealthy":
            return f"SGLang's tokenizer manager is {'exiting' if tm.gracefully_exit else 'unhealthy'}"
        for proc in self.children:
            if not proc.is_alive():
                return f"SGLang's process {proc.name} exited ({proc.exitcode})"
        return None

    def refusal(self) -> RpcStatusError | None:
        why = self.alive()
        return RpcStatusError("UNAVAILABLE", why) if why else None

    def plan(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> SglangPlan:
        eos = self.discovery.eos_token_id
        return plan_request(
            request, metadata, self.discovery.limits, frozenset(() if eos is None else (eos,))
        )

    async def engine_abort(self, request_ids: list[str]) -> None:
        tm = self.tokenizer_manager
        for rid in request_ids:
            active = self.requests.get(rid)
            if active is not None:
                rids = active.plan.rids
            else:
                base = sglang_rid(rid)
                rids = [r for r in tm.rid_to_state if r == base or r.startswith(base + "_")]
            for sgl_rid in rids:
                if sgl_rid in tm.rid_to_state:
                    tm.abort_request(rid=sgl_rid)

    # -- health and load -----------------------------------------------------------------

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        why = self.alive()
        core = pb.HealthCheck(
            name="engine_core",
            state=pb.HealthState.NOT_READY if why else pb.HealthState.READY,
            message=why or "SGLang scheduler and detokenizer alive",
        )
        snap = await self.refresh()
        running = getattr(snap, "num_running_reqs", 0)
        waiting = getattr(snap, "num_waiting_reqs", 0)
        return self.overall_health(
            core, f"{running} running, {waiting} waiting", message, self.discovery.names
        )

    async def refresh(self) -> Any:
        """SGLang's latest load snapshot (rank 0); the previous one if it has none."""
        try:
            loads = await self.tokenizer_manager.get_loads()
        except Exception as err:  # a reader SGLang has not set up: keep the last one
            log.debug("SGLang load snapshot unavailable: %s", err)
            loads = []
        if loads:
            self.snapshot = loads[0]
        return self.snapshot

    def requests_load(self) -> tuple[int, int]:
        """``(running, queued)``: the requests in flight here, of which as many as SGLang's
        snapshot reports waiting are queued."""
        return self.split_in_flight(int(getattr(self.snapshot, "num_waiting_reqs", 0) or 0))

    def load(self, include_per_rank: bool, *, report_aborts: bool = False) -> pb.LoadInfo:
        """``LoadInfo``: requests from :meth:`requests_load`, KV blocks from SGLang's snapshot
        (used tokens / page size); the adapter's counters in ``attributes``, plus the Aborts per
        request id (up to 4,096) when ``report_aborts``."""
        snap = self.snapshot
        total = self.discovery.total_kv_blocks
        used_tokens = int(getattr(snap, "num_used_tokens", 0) or 0)
        used = min(total, -(-used_tokens // self.discovery.page_size))
        attrs = {
            "sglang_held_requests": self.held,
            "sglang_running": int(getattr(snap, "num_running_reqs", 0) or 0),
            "sglang_waiting": int(getattr(snap, "num_waiting_reqs", 0) or 0),
            "sglang_used_tokens": used_tokens,
        }
        return self.load_info(include_per_rank, report_aborts, self.requests_load(), (used, total), attrs)
