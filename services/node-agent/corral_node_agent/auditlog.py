"""Batches the node's audit events and publishes them to JetStream (`corral.audit.<node>.<sandbox>`).

Sources call `emit()` (cheap, never blocks the exec path): the first event into an empty buffer
arms a timer, and a background task flushes `interval_s` later (or at once when a batch is full),
so a stream of execs is one publish per sandbox per `interval_s`, not one per event, and an idle
node does not wake up at all. A flush waits for JetStream's ack so that events survive a NATS
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
    def __init__(self, js: JetStreamContext, node: str, interval_s: float = 0.2, batch: int = 256, max_buffer: int = 200_000):
        self.js = js
        self.node = node
        self.interval_s = interval_s
        self.batch = batch
        self.max_buffer = max_buffer
        self.pending: list[AuditEvent] = []
        self.retry: list[tuple[str, list[AuditEvent]]] = []  # (sandbox, batch) that failed to publish
        self.wake = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.enabled = True

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.create_task(self._run())

    def emit(self, ev: AuditEvent) -> None:
        if not self.enabled:
            return
        self.pending.append(ev)
        if len(self.pending) > self.max_buffer:
            drop = len(self.pending) - self.max_buffer
            del self.pending[:drop]
            AUDIT_DROPPED.labels(self.node).inc(drop)
        if self.timer is None or len(self.pending) >= self.batch:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # not on the loop's thread
                if self.task is not None:
                    self.loop.call_soon_threadsafe(self._arm)
                return
            self._arm()

    def _arm(self) -> None:
        if len(self.pending) >= self.batch:
            self.wake.set()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.interval_s, self.wake.set)

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            await self.flush()
            if (self.retry or self.pending) and self.timer is None:  # a failed publish, or what came meanwhile
                self.timer = asyncio.get_running_loop().call_later(self.interval_s, self.wake.set)

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
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()
        try:
            await asyncio.wait_for(self.flush(), 5)
        except Exception:
            pass


def batch_id(chunk: list[AuditEvent]) -> str:
    """The JetStream message id of a batch: the same events, the same id (retries deduplicate)."""
    return f"{chunk[0].id}-{chunk[-1].id}-{len(chunk)}"
