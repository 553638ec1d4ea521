"""Batches the node's audit events and publishes them to JetStream (`corral.audit.<node>.<sandbox>`).

Sources call `emit()` (cheap, never blocks the exec path); a background task flushes every
`interval_s` or when a batch is full, waiting for JetStream's ack so that events survive a NATS
restart; failed batches are retried as they were, under the same `Nats-Msg-Id` (derived from their
event ids), so a publish that was stored but whose ack got lost is dropped by JetStream's duplicate
window instead of stored twice. Only past `max_buffer` are the oldest dropped (counted)."""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from nats.js import JetStreamContext

from corral_common import metrics, subjects
from corral_common.audit import AuditBatch, AuditEvent
from corral_common.messages import encoder

log = logging.getLogger("corral.node.audit")

AUDIT_EVENTS = metrics.counter("corral_audit_events_total", "Audit events published", ("node", "kind"))
AUDIT_DROPPED = metrics.counter("corral_audit_events_dropped_total", "Audit events dropped (buffer full)", ("node",))


class AuditLog:
    def __init__(self, js: JetStreamContext, node: str, interval_s: float = 0.05, batch: int = 256, max_buffer: int = 200_000):
        self.js = js
        self.node = node
        self.interval_s = interval_s
        self.batch = batch
        self.max_buffer = max_buffer
        self.pending: list[AuditEvent] = []
        self.retry: list[tuple[str, list[AuditEvent]]] = []  # (sandbox, batch) that failed to publish
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.enabled = True

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    def emit(self, ev: AuditEvent) -> None:
        if not self.enabled:
            return
        self.pending.append(ev)
        if len(self.pending) > self.max_buffer:
            drop = len(self.pending) - self.max_buffer
            del self.pending[:drop]
            AUDIT_DROPPED.labels(self.node).inc(drop)
        if len(self.pending) >= self.batch:
            self.wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            self.wake.clear()
            await self.flush()

    async def flush(self) -> None:
        if not self.pending and not self.retry:
            return
        events, self.pending = self.pending, []
        batches, self.retry = self.retry, []
        by_sandbox: dict[str, list[AuditEvent]] = defaultdict(list)
        for ev in events:
            by_sandbox[ev.sandbox].append(ev)
        for sandbox, evs in by_sandbox.items():
            batches.extend((sandbox, evs[i : i + self.batch]) for i in range(0, len(evs), self.batch))
        for sandbox, chunk in batches:
            try:
                await self.js.publish(subjects.audit(self.node, sandbox), encoder.encode(AuditBatch(events=chunk)), timeout=5,
                                      headers={"Nats-Msg-Id": batch_id(chunk)})
                for ev in chunk:
                    AUDIT_EVENTS.labels(self.node, ev.kind).inc()
            except Exception as e:
                log.warning("audit publish failed; will retry", extra={"fields": {"error": str(e), "events": len(chunk)}})
                self.retry.append((sandbox, chunk))
        if sum(len(c) for _, c in self.retry) > self.max_buffer:  # an outage: drop the oldest batches
            while self.retry and sum(len(c) for _, c in self.retry) > self.max_buffer:
                AUDIT_DROPPED.labels(self.node).inc(len(self.retry.pop(0)[1]))
        if self.retry:
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        try:
            await asyncio.wait_for(self.flush(), 5)
        except Exception:
            pass


def batch_id(chunk: list[AuditEvent]) -> str:
    """The JetStream message id of a batch: the same events, the same id (retries deduplicate)."""
    return f"{chunk[0].id}-{chunk[-1].id}-{len(chunk)}"
