"""Lifecycle events of the node's sandboxes (`corral.v1.events.<id>.<kind>`): fire and forget,
published on the bus, never awaited by a caller beyond the publish."""
from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS

from corral_common import metrics
from corral_common.contract import subjects
from corral_common.contract.messages import Event, SandboxInfo, encoder

from .substrates.base import Sandbox

log = logging.getLogger("corral.node")

EVENTS = metrics.counter("corral_node_events_total", "Lifecycle events published", ("node", "kind"))


class Events:
    def __init__(self, nc: NATS, node: str):
        self.nc = nc
        self.node = node

    async def of(self, sb: Sandbox, kind: str, reason: str = "") -> None:
        """An event of a sandbox of this node, carrying its current info."""
        await self.publish(Event(kind=kind, ts=time.time(), sandbox_id=sb.id, node=self.node, job=sb.info.job,
                                 reason=reason, info=sb.info))

    async def failed(self, sid: str, reason: str, job: str = "", info: SandboxInfo | None = None) -> None:
        await self.publish(Event(kind="failed", ts=time.time(), sandbox_id=sid, node=self.node, job=job, reason=reason, info=info))

    async def publish(self, ev: Event) -> None:
        EVENTS.labels(self.node, ev.kind).inc()
        try:
            await self.nc.publish(subjects.event(ev.sandbox_id, ev.kind), encoder.encode(ev))
        except Exception:
            log.warning("could not publish event", extra={"fields": {"kind": ev.kind, "sandbox": ev.sandbox_id}})
