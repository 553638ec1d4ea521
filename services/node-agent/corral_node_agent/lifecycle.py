"""A sandbox's life on this node once it exists: registered (served on
`corral.v1.sandbox.<id>.>`, placed, watched for its init's exit), adopted from a crashed
predecessor at start, expired by its lease, destroyed."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.messages import Event, NodeReconciled, encoder

from .audit.wiring import AuditWiring
from .events import Events
from .placements import Placements
from .substrates import Substrate
from .substrates.base import Sandbox
from .table import SandboxTable
from .tunnels import Tunnels
from .usage import UsageTracker

log = logging.getLogger("corral.node")

DESTROY_SECONDS = metrics.histogram("corral_sandbox_destroy_seconds", "Time to destroy a sandbox", ("node", "substrate"))


class Lifecycle:
    def __init__(self, nc: NATS, node: str, table: SandboxTable, audit: AuditWiring, placements: Placements, events: Events,
                 responder: bus.Responder, usage: UsageTracker, tunnels: Tunnels):
        self.nc = nc
        self.node = node
        self.table = table
        self.audit = audit
        self.placements = placements
        self.events = events
        self.responder = responder
        self.usage = usage  # the heartbeats' per-sandbox usage (a destroyed sandbox is forgotten)
        self.tunnels = tunnels  # its port forwards end first (their close is audited)
        #: the handler of a sandbox's operations (handlers/ops.py), set by the agent once built
        self.handler_for: Callable[[str], bus.Handler] | None = None
        self.adopted = 0  # sandboxes adopted at start
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    def cancel(self) -> None:
        for t in list(self.tasks):
            t.cancel()

    async def register(self, sb: Sandbox, sub: Substrate, record: bool = True) -> None:
        assert self.handler_for is not None
        self.table.add(sb, sub)
        if record:  # (a single create's claim wrote it already)
            self.placements.record(sb)
        await self.responder.serve(subjects.sandbox_all(sb.id), self.handler_for(sb.id), "sandbox", key=sb.id)
        sub.watch_exit(sb, self._on_sandbox_exit)

    def _on_sandbox_exit(self, sb: Sandbox) -> None:
        """PID 1 of the sandbox died on its own: report `exited`, then clean up everything."""
        if not self.table.is_live(sb.id):
            return

        async def go() -> None:
            await self.events.of(sb, "exited", reason="sandbox init process exited")
            await self.safe_destroy(sb.id, "sandbox exited")

        self.spawn(go())

    async def destroy(self, sid: str, reason: str) -> None:
        sb = self.table.sandboxes.get(sid)
        if sb is None or sid in self.table.destroying:
            return
        self.table.destroying.add(sid)
        sub = self.table.substrate_of[sid]
        t0 = time.perf_counter()
        # the sandbox's subject stays served until its placement is gone: a call during the
        # teardown (a gVisor sandbox's takes seconds) gets `not_found` from here at once, and one
        # after it from the scheduler, which then finds no placement; unserved first, a call
        # in between had no one to answer it
        try:
            try:
                await self.tunnels.close_sandbox(sid, f"sandbox destroyed ({reason})")
                await self.audit.release(sid)
                await sub.destroy(sb)
            finally:
                self.table.remove(sid)
                self.usage.forget(sid)
                self.audit.forget(sid)
            DESTROY_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
            sb.info.state = "destroyed"
            await self.placements.delete(sid)
        finally:
            await self.responder.unserve(sid)
        await self.events.of(sb, "destroyed", reason=reason)

    async def safe_destroy(self, sid: str, reason: str) -> None:
        try:
            await self.destroy(sid, reason)
        except Exception:
            log.exception("destroy failed", extra={"fields": {"sandbox": sid}})

    async def reap(self) -> None:
        """Destroy the sandboxes whose lease ran out."""
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for sb, _ in self.table.live_items():
                if sb.info.expires_at <= now:
                    self.spawn(self.safe_destroy(sb.id, "ttl expired"))

    async def reconcile(self) -> None:
        """At start: adopt the sandboxes a predecessor left running, clean up the rest."""
        for name, sub in self.table.substrates.items():
            adopted, report = await sub.reconcile()
            self.adopted += len(adopted)
            for sb in adopted:
                if sb.info.state == "creating":  # killed after the sandbox was up, before its record said so
                    sb.info.state = "running"
                await self.audit.adopt(sb, sub)
                await self.register(sb, sub)
                await self.events.of(sb, "ready", reason="adopted after node-agent restart")
            for sid in report.cleaned:
                await self.placements.delete(sid)
                await self.events.publish(Event(kind="destroyed", ts=time.time(), sandbox_id=sid, node=self.node,
                                                reason="cleaned up after node-agent restart"))
            if report.adopted or report.cleaned:
                await self.nc.publish(subjects.node_event(self.node, "reconciled"), encoder.encode(NodeReconciled(
                    node=self.node, substrate=name, adopted=report.adopted, cleaned=report.cleaned, notes=report.notes)))
                logs.kv(log, logging.WARNING, "reconciled leftovers", substrate=name,
                        adopted=report.adopted, cleaned=report.cleaned, notes=report.notes)
