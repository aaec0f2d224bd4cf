"""Run the selected checks against live engines and collect a :class:`Report`.

Resources: one :class:`~sidecar.openengine.client.EngineClient` per given address, opened
before the first check and closed after the last. Checks run one at a time, in group
order (``discovery``, ``generate``, ``errors``, ``cancel``, ``lora``, ``kv``, ``pd``, and
``drain`` last because it is destructive), each bounded by its own timeout; cancelling
:func:`run_suite` cancels the running check and closes every connection.

Engine lost: after a check that did not pass or saw a connection end, every engine is asked
``GetServerInfo`` (bounded by ``connect_timeout``). One that is unreachable stops the run:
that check fails with "engine lost during <check>" (its own finding kept as detail) and
every later check is reported skipped ("not run"), instead of failing for a cause that is
not theirs. An engine that answers slowly is not "lost"; each check judges that itself.

KV sequence monitor: when a ``kv`` check is selected, one subscription to the engine's KV
events is opened before the first check and held to the end (``kv_watch.open_monitor``), so
``kv.sequence`` judges every batch from the first the engine published during the run.
"""

from __future__ import annotations

import datetime
import importlib
import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import trio

from sidecar import __version__
from sidecar.conformance.context import Context, SuiteOptions
from sidecar.conformance.kv_watch import open_monitor
from sidecar.conformance.model import CHECKS, Check, CheckResult, Fail, Skip, Status, select_checks
from sidecar.nursery import lone_exception
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineClientError, EngineConfigError, EngineUnavailable
from sidecar.openengine.releases import CLIENT_REVISION, SCHEMA_RELEASE, find_known, parse_release

__all__ = ["GROUP_ORDER", "Progress", "Report", "SuiteError", "all_checks", "run_check", "run_suite"]

log = logging.getLogger(__name__)

_MODULES = (
    "checks_discovery",
    "checks_generate",
    "checks_errors",
    "checks_cancel",
    "checks_lora",
    "checks_kv",
    "checks_pd",
    "checks_drain",
)
GROUP_ORDER = ("discovery", "generate", "errors", "cancel", "lora", "kv", "pd", "drain")


class SuiteError(Exception):
    """The suite could not run at all (bad address, engine unreachable)."""


class Progress(Protocol):
    def started(self, index: int, total: int, check: Check) -> None: ...

    def finished(self, index: int, total: int, result: CheckResult) -> None: ...


def all_checks() -> list[Check]:
    """Every check, in run order."""
    for name in _MODULES:
        importlib.import_module(f"sidecar.conformance.{name}")
    return sorted(
        CHECKS, key=lambda c: GROUP_ORDER.index(c.group) if c.group in GROUP_ORDER else len(GROUP_ORDER)
    )


@dataclass
class Report:
    """The outcome of one run (``to_json`` is the ``--json`` report)."""

    options: SuiteOptions
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[CheckResult] = field(default_factory=list)
    deselected: list[str] = field(default_factory=list)
    started_at: str = ""
    duration: float = 0.0
    #: ``"<check id>: <why>"`` when an engine became unreachable and the run stopped.
    engine_lost: str | None = None

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def failed(self) -> bool:
        return self.count(Status.FAIL) > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "openengine-sidecar conformance",
            "version": __version__,
            "client_revision": CLIENT_REVISION,
            "schema_release": SCHEMA_RELEASE,
            "started_at": self.started_at,
            "duration_s": round(self.duration, 3),
            "options": asdict(self.options),
            "engines": self.engines,
            "summary": {
                "total": len(self.results),
                "pass": self.count(Status.PASS),
                "fail": self.count(Status.FAIL),
                "skip": self.count(Status.SKIP),
                "ok": not self.failed,
                "engine_lost": self.engine_lost,
            },
            "checks": [r.to_json() for r in self.results],
            "deselected": list(self.deselected),
        }


def _engine_json(address: str, info: pb.ServerInfo) -> dict[str, Any]:
    release = parse_release(info.schema_release)
    known = find_known(release) if release is not None else None
    return {
        "address": address,
        "engine_name": info.engine_name,
        "engine_version": info.engine_version,
        "role": pb.EngineRole(info.engine_role).name.lower() or str(info.engine_role),
        "instance_id": info.instance_id,
        "schema_revision": info.schema_revision,
        "minimum_client_revision": info.minimum_client_revision,
        "schema_release": info.schema_release,
        "known_release": known.name if known is not None else None,
        "supported_models": list(info.supported_models),
    }


async def run_check(ctx: Context, check: Check) -> CheckResult:
    """Run one check to a :class:`CheckResult` (never raises, except cancellation of the caller)."""
    timeout = ctx.options.check_timeout or check.timeout
    start = trio.current_time()
    try:
        try:
            with trio.fail_after(timeout):
                note = await check.func(ctx)
        except BaseExceptionGroup as group:
            raise lone_exception(group) from None
    except Skip as skip:
        return CheckResult(check, Status.SKIP, skip.reason, duration=trio.current_time() - start)
    except Fail as fail:
        return CheckResult(check, Status.FAIL, fail.reason, fail.details, trio.current_time() - start)
    except trio.TooSlowError:
        reason = f"did not finish within {timeout:g} s"
        return CheckResult(check, Status.FAIL, reason, duration=trio.current_time() - start)
    except EngineClientError as err:
        reason = f"{type(err).__name__}: {err}"
        return CheckResult(check, Status.FAIL, reason, duration=trio.current_time() - start)
    except Exception as err:
        log.debug("check %s raised", check.id, exc_info=True)
        reason = f"unexpected error: {type(err).__name__}: {err}"
        return CheckResult(check, Status.FAIL, reason, duration=trio.current_time() - start)
    return CheckResult(check, Status.PASS, note or "", duration=trio.current_time() - start)


async def _unreachable(clients: dict[str, Any], timeout: float) -> str | None:
    """``"--<which> <address>: <error>"`` of the first engine that cannot be reached now."""
    for which, client in clients.items():
        try:
            with trio.move_on_after(timeout):
                await client.get_server_info()
        except EngineUnavailable as err:
            return f"--{which} {client.address}: {err}"
        except EngineClientError:
            continue  # it answered (a status): alive
    return None


def _lost(result: CheckResult, where: str) -> CheckResult:
    details = ([result.reason] if result.reason else []) + [d for d in result.details if d != result.reason]
    reason = f"engine lost during {result.check.id}: {where}"
    return CheckResult(result.check, Status.FAIL, reason, details, result.duration)


async def run_suite(
    options: SuiteOptions, *, progress: Progress | None = None, checks: Sequence[Check] | None = None
) -> Report:
    """Run the checks ``options`` selects (or ``checks``) and return the report.

    Raises ``ValueError`` for a selection that matches nothing and :class:`SuiteError`
    when an engine cannot be reached at all.
    """
    everything = all_checks() if checks is None else list(checks)
    selected = select_checks(everything, options.only, options.skip)
    report = Report(
        options,
        deselected=[c.id for c in everything if c not in selected],
        started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    addresses = {"engine": options.engine, "prefill": options.prefill, "decode": options.decode}
    began = trio.current_time()
    async with AsyncExitStack() as stack:
        clients: dict[str, Any] = {}
        for which, address in addresses.items():
            if not address:
                continue
            try:
                client = await stack.enter_async_context(open_engine_client(address))
            except EngineConfigError as err:
                raise SuiteError(f"--{which} {address!r}: {err}") from None
            try:
                with trio.fail_after(options.connect_timeout):
                    info = await client.get_server_info()
            except trio.TooSlowError:
                raise SuiteError(
                    f"--{which} {address}: no answer to GetServerInfo within {options.connect_timeout:g} s"
                ) from None
            except EngineClientError as err:
                raise SuiteError(f"--{which} {address}: {err}") from None
            clients[which] = client
            report.engines[which] = _engine_json(address, info)
        ctx = Context(options, **clients)
        if clients.get("engine") is not None and any(c.group == "kv" for c in selected):
            await stack.enter_async_context(open_monitor(ctx))
        total = len(selected)
        for i, check in enumerate(selected):
            if progress is not None:
                progress.started(i, total, check)
            transport_before = ctx.transport_errors
            result = await run_check(ctx, check)
            if result.status != Status.PASS or ctx.transport_errors != transport_before:
                where = await _unreachable(clients, options.connect_timeout)
                if where is not None:
                    result = _lost(result, where)
                    report.engine_lost = f"{check.id}: {where}"
            report.results.append(result)
            if progress is not None:
                progress.finished(i, total, result)
            if report.engine_lost is not None:
                for j, rest in enumerate(selected[i + 1 :], i + 1):
                    skipped = CheckResult(rest, Status.SKIP, f"not run: engine lost during {check.id}")
                    report.results.append(skipped)
                    if progress is not None:
                        progress.finished(j, total, skipped)
                break
    report.duration = trio.current_time() - began
    return report
