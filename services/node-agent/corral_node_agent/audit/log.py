"""Batches the node's audit events and publishes them to JetStream (`corral.audit.<node>.<sandbox>`).

Sources call `emit()` (cheap, never blocks the exec path): the first event into an empty buffer
arms a timer, and a background task flushes `interval_s` later (or at once when a batch is full),
so a stream of execs is one publish per sandbox per `interval_s`, not one per event, and an idle
node does not wake up at all. A flush waits for JetStream's ack so that events survive a NATS
restart; failed batches are retried as they were, under the same `Nats-Msg-Id` (derived from their
event ids), so a publish that was stored but whose ack got lost is dropped by JetStream's duplicate
window instead of stored twice. Only past `max_buffer` are events dropped, and then fairly: the
oldest of whichever sandbox holds the most (in the buffer and in failed batches alike), so a
sandbox that floods its own audit can only lose its own events, never a quieter neighbour's.

Loss is accounted per sandbox (`SandboxAudit`): events dropped here (buffer full, publishing given
up) and what the sources report they could not deliver (`loss()`: fanotify queue overflow, rate
limiting, a node-agent restart) count in its `lost`, with the reason, and become one AuditEvent of
kind "loss" per (sandbox, reason) and flush, so the monitor can alert. Loss events are kept apart
from the capped buffer and never dropped: the record of an incomplete record must not be lost
itself. `sync()` is the grader's consistent point (`corral.v1.sandbox.<id>.audit`): it publishes
everything emitted for a sandbox so far and answers its stream position and losses."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from corral_common import metrics
from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
from corral_common.contract.errors import Unavailable
from corral_common.contract.messages import AuditState, encoder

log = logging.getLogger("corral.node.audit")

AUDIT_EVENTS = metrics.counter("corral_audit_events_total", "Audit events published", ("node", "kind"))
AUDIT_DROPPED = metrics.counter("corral_audit_events_dropped_total", "Audit events dropped (buffer full)", ("node",))
AUDIT_LOST = metrics.counter("corral_audit_events_lost_total", "Audit events lost, by reason", ("node", "reason"))

BUFFER_FULL = "audit buffer full"
PUBLISH_GAVE_UP = "audit publish gave up"
MAX_REASONS = 16


@dataclass
class SandboxAudit:
    """One sandbox's audit so far, as this agent saw it (since it started)."""

    emitted: int = 0  # events accepted into the buffer (loss events not counted)
    settled: int = 0  # of those, published or dropped
    published: int = 0  # events on the stream, loss events included
    last_seq: int = 0  # stream sequence of the last batch acked
    lost: int = 0
    reasons: list[str] = field(default_factory=list)

    def note(self, reason: str) -> None:
        if reason not in self.reasons and len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)



class AuditLog:
    def __init__(self, js: JetStreamContext, node: str, interval_s: float = 0.2, batch: int = 256, max_buffer: int = 200_000):
        self.js = js
        self.node = node
        self.interval_s = interval_s
        self.batch = batch
        self.max_buffer = max_buffer
        self.pending: dict[str, list[AuditEvent]] = {}  # sandbox -> events not yet published, oldest first
        self.npending = 0
        self.retry: list[tuple[str, list[AuditEvent]]] = []  # (sandbox, batch) that failed to publish
        self.losses: dict[tuple[str, str], int] = {}  # (sandbox, reason) -> events lost, not yet told as a loss event
        self.stats: dict[str, SandboxAudit] = {}
        self.lock = asyncio.Lock()  # one flush at a time (the background task and sync())
        self.wake = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.enabled = True
        #: job and labels of a sandbox, for the loss events this log makes itself (set by the agent)
        self.context: Callable[[str], dict] = lambda sid: {}

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.create_task(self._run())

    def _stat(self, sid: str) -> SandboxAudit:
        st = self.stats.get(sid)
        if st is None:
            st = self.stats[sid] = SandboxAudit()
        return st

    def emit(self, ev: AuditEvent) -> None:
        if not self.enabled:
            return
        self.pending.setdefault(ev.sandbox, []).append(ev)
        self.npending += 1
        self._stat(ev.sandbox).emitted += 1
        if self.npending > self.max_buffer:
            self._evict()
        self._poke()

    def _evict(self) -> None:
        """Make room by dropping the oldest events of the sandbox with the most pending (a 64th of
        them at once, so a flood that keeps the buffer full costs one scan per 64 events)."""
        sid = max(self.pending, key=lambda s: len(self.pending[s]))
        queue = self.pending[sid]
        drop = max(1, len(queue) // 64)
        del queue[:drop]
        if not queue:
            del self.pending[sid]
        self.npending -= drop
        AUDIT_DROPPED.labels(self.node).inc(drop)
        self._settle(sid, drop)
        self._lose(sid, BUFFER_FULL, drop)

    def loss(self, sid: str, reason: str, count: int) -> None:
        """A source could not deliver `count` events of this sandbox (or, count 0 meaning an
        unknown number, its record has a gap): counted, and told as a loss event."""
        if not self.enabled:
            return
        self._lose(sid, reason, max(count, 1))
        self._poke()

    def _lose(self, sid: str, reason: str, count: int) -> None:
        st = self._stat(sid)
        st.lost += count
        st.note(reason)
        self.losses[(sid, reason)] = self.losses.get((sid, reason), 0) + count
        AUDIT_LOST.labels(self.node, reason).inc(count)

    def _settle(self, sid: str, n: int) -> None:
        st = self.stats.get(sid)
        if st is not None:
            st.settled += n

    def _poke(self) -> None:
        if self.timer is None or self.npending >= self.batch:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # not on the loop's thread
                if self.task is not None:
                    self.loop.call_soon_threadsafe(self._arm)
                return
            self._arm()

    def _arm(self) -> None:
        if self.npending >= self.batch:
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
            if self.retry:
                await asyncio.sleep(0.5)  # a failed publish: not again at once
            if (self.retry or self.pending or self.losses) and self.timer is None:  # what came meanwhile
                self.timer = asyncio.get_running_loop().call_later(self.interval_s, self.wake.set)

    async def flush(self) -> None:
        async with self.lock:
            await self._flush()

    async def _flush(self) -> None:
        if not self.pending and not self.retry and not self.losses:
            return
        events, self.pending, self.npending = self.pending, {}, 0
        batches, self.retry = self.retry, []
        losses, self.losses = self.losses, {}
        by_sandbox: dict[str, list[AuditEvent]] = defaultdict(list)
        for (sid, reason), n in losses.items():  # in a batch of their own: never dropped below
            by_sandbox[sid].append(self._loss_event(sid, reason, n))
        for sandbox, evs in by_sandbox.items():
            batches.append((sandbox, evs))
        for sandbox, evs in events.items():
            batches.extend((sandbox, evs[i : i + self.batch]) for i in range(0, len(evs), self.batch))
        for sandbox, chunk in batches:
            try:
                ack = await self.js.publish(subjects.audit(self.node, sandbox), encoder.encode(AuditBatch(events=chunk)), timeout=5,
                                            headers={"Nats-Msg-Id": batch_id(chunk)})
            except Exception as e:
                log.warning("audit publish failed; will retry", extra={"fields": {"error": str(e), "events": len(chunk)}})
                self.retry.append((sandbox, chunk))
                continue
            for ev in chunk:
                AUDIT_EVENTS.labels(self.node, ev.kind).inc()
            st = self.stats.get(sandbox)
            if st is not None:
                st.published += len(chunk)
                st.settled += sum(1 for ev in chunk if ev.kind != "loss")
                st.last_seq = max(st.last_seq, ack.seq)
        while sum(len(c) for _, c in self.retry) > self.max_buffer:  # an outage: drop batches, fairly
            held: dict[str, int] = defaultdict(int)
            for s, c in self.retry:
                if not _is_loss(c):
                    held[s] += len(c)
            if not held:
                break  # only loss events left: those are kept whatever it takes
            top = max(held, key=held.__getitem__)  # the oldest batch of the sandbox holding the most
            i = next(i for i, (s, c) in enumerate(self.retry) if s == top and not _is_loss(c))
            sandbox, chunk = self.retry.pop(i)
            AUDIT_DROPPED.labels(self.node).inc(len(chunk))
            self._settle(sandbox, len(chunk))
            self._lose(sandbox, PUBLISH_GAVE_UP, len(chunk))

    def _loss_event(self, sid: str, reason: str, n: int) -> AuditEvent:
        ctx = self.context(sid) or {}
        return AuditEvent(id=event_id(), ts=time.time(), node=self.node, sandbox=sid, kind="loss", op="lost",
                          job=ctx.get("job", ""), labels=ctx.get("labels", {}), detail={"reason": reason, "count": str(n)})

    def _outstanding(self, sid: str, upto: int) -> bool:
        st = self.stats.get(sid)
        return ((st is not None and st.settled < upto) or any(s == sid for s, _ in self.losses)
                or any(s == sid for s, _ in self.retry))

    async def sync(self, sid: str, timeout_s: float = 10.0) -> AuditState:
        """Publish every event emitted for `sid` until now (and its loss events), waiting for the
        acks, then answer how far its record goes. Events emitted meanwhile are not waited for.
        Unavailable if JetStream does not take them within `timeout_s` (the caller may retry)."""
        if not self.enabled:
            return AuditState(lost=1, reasons=["auditing is off on this node"])
        st = self.stats.get(sid)
        upto = st.emitted if st is not None else 0
        deadline = time.monotonic() + timeout_s
        while True:
            await self.flush()
            if not self._outstanding(sid, upto):
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"audit events of sandbox {sid} are not all published yet (JetStream did not ack them "
                                  f"within {timeout_s:g}s)", retry_after_s=1)
            await asyncio.sleep(0.2)
        st = self.stats.get(sid) or SandboxAudit()
        return AuditState(last_seq=st.last_seq, published=st.published, lost=st.lost, reasons=list(st.reasons))

    def forget(self, sid: str) -> None:
        """The sandbox is gone: its counters go (its events still pending are still published)."""
        self.stats.pop(sid, None)

    async def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()
        try:
            await asyncio.wait_for(self.flush(), 5)
        except Exception as e:
            log.warning("audit events not flushed at close: %r", e)


def _is_loss(chunk: list[AuditEvent]) -> bool:
    return bool(chunk) and chunk[0].kind == "loss"


def batch_id(chunk: list[AuditEvent]) -> str:
    """The JetStream message id of a batch: the same events, the same id (retries deduplicate)."""
    return f"{chunk[0].id}-{chunk[-1].id}-{len(chunk)}"
