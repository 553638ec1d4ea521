"""CORRAL_AUDIT into ClickHouse: each fetched batch is decoded (malformed messages, and malformed
events inside an otherwise good batch, are dead-lettered and acked: never fatal), deduplicated and
run through the detection rules, whose alerts are published at once; the commit inserts the events
and stores the alerts. A redelivered message (`num_delivered > 1`) has its ids checked against each
table before inserting, so a row is never stored twice, and alert ids are deterministic, so an alert
is not stored twice and JetStream drops its re-publication."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from corral_common.contract.audit import AuditBatch, AuditEvent

from ..deadletters import DeadLetters
from ..pull import Staged
from ..store import ExecRow, Store
from .common import DUPLICATES, EVENTS, INSERT_SECONDS, LAG, MAX_TS, MIN_TS, ROWS, RecentIds
from .fault import Fault


class _RawBatch(msgspec.Struct):
    events: list[msgspec.Raw]


_batch_decoder = msgspec.json.Decoder(type=_RawBatch)
_typed_decoder = msgspec.json.Decoder(type=AuditBatch)
_event_decoder = msgspec.json.Decoder(type=AuditEvent)


_I32, _I64 = 2**31, 2**63


def _check(ev: AuditEvent) -> str:
    """What the schema cannot say; an event failing this is dead-lettered, not inserted."""
    if not ev.id or len(ev.id) > 128:
        return "id must be a non-empty string of at most 128 characters"
    if not (MIN_TS <= ev.ts <= MAX_TS):
        return f"ts {ev.ts!r} is not a plausible unix time"
    if not ev.sandbox or not ev.node:
        return "node and sandbox must be set"
    if ev.exit_code is not None and not (-_I32 <= ev.exit_code < _I32):
        return f"exit_code {ev.exit_code} out of range"
    if not (0 <= ev.stdout_bytes < _I64 and 0 <= ev.stderr_bytes < _I64 and -_I64 <= ev.pid < _I64):
        return "stdout_bytes, stderr_bytes or pid out of range"
    if not math.isfinite(ev.duration_ms):
        return "duration_ms must be finite"
    return ""


def exec_row(ev: AuditEvent) -> ExecRow:
    return ExecRow(id=ev.id, ts=ev.ts, node=ev.node, sandbox=ev.sandbox, job=ev.job, cmd=ev.cmd, cwd=ev.cwd,
                   session=ev.session, exit_code=ev.exit_code if ev.exit_code is not None else -1,
                   duration_ms=ev.duration_ms, stdout_bytes=ev.stdout_bytes, stderr_bytes=ev.stderr_bytes,
                   timed_out=ev.timed_out, oom_killed=ev.detail.get("oom_killed") == "1", labels=ev.labels)


OnEvents = Callable[[list[AuditEvent], bool], Awaitable[list[Any]]]


class _AuditPending:
    __slots__ = ("audit", "exec_repair", "alerts", "ids", "max_ts")

    def __init__(self) -> None:
        self.audit: list[AuditEvent] = []
        self.exec_repair: list[AuditEvent] = []
        self.alerts: list[Any] = []
        self.ids: list[str] = []
        self.max_ts = 0.0


class AuditIngest(Staged):
    """Handler for CORRAL_AUDIT: `stage` decodes, dedups and runs `on_events(events, maybe_seen)`
    (the rules; publishes alerts, returns them) per fetch; `commit` inserts the events and
    `store_alerts(alerts)`; the messages are acked after the commit."""

    stream = "CORRAL_AUDIT"

    def __init__(self, store: Store, dead: DeadLetters, on_events: OnEvents | None = None, fault: Fault | None = None,
                 store_alerts: Callable[[list[Any]], Awaitable[None]] | None = None):
        self.store = store
        self.dead = dead
        self.on_events = on_events
        self.store_alerts = store_alerts
        self.recent = RecentIds()
        self.inflight: set[str] = set()  # staged, not committed yet (by any worker)
        self.fault = fault or Fault()

    def new_pending(self) -> _AuditPending:
        return _AuditPending()

    async def decode(self, msg: Msg) -> list[AuditEvent]:
        try:  # fast path: the whole batch at once
            events = _typed_decoder.decode(msg.data).events
            if not any(_check(ev) for ev in events):
                return events
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        try:
            raw = _batch_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.dead.put(self.stream, msg, msg.data, "batch", str(e))
            return []
        good: list[AuditEvent] = []
        for r in raw.events:  # one by one: keep the good events, dead-letter the bad ones
            try:
                ev = _event_decoder.decode(r)
                err = _check(ev)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                err = str(e)
            if err:
                await self.dead.put(self.stream, msg, bytes(r), "event", err)
            else:
                good.append(ev)
        return good

    async def stage(self, msgs: list[Msg], pending: _AuditPending) -> None:
        events: list[AuditEvent] = []
        maybe_seen: set[str] = set()
        for m in msgs:
            evs = await self.decode(m)
            if m.metadata.num_delivered and m.metadata.num_delivered > 1:
                maybe_seen.update(e.id for e in evs)
            events.extend(evs)
        # drop repeats within the batch, ones staged and not committed yet, and ones stored lately
        uniq: dict[str, AuditEvent] = {}
        recent, inflight = self.recent, self.inflight
        for e in events:
            if e.id not in uniq and e.id not in recent and e.id not in inflight:
                uniq[e.id] = e
        dups = len(events) - len(uniq)
        events = list(uniq.values()) if dups else events
        if not events:
            if dups:
                DUPLICATES.labels(self.stream).inc(dups)
            return
        audit_new = events
        exec_repair: list[AuditEvent] = []
        if maybe_seen:
            # delivered before: some may be stored already (a crash or an ack timeout before the ack)
            ids = [e.id for e in events if e.id in maybe_seen]
            in_audit = await asyncio.to_thread(self.store.existing_ids, "audit_events", ids)
            audit_new = [e for e in events if e.id not in in_audit]
            dups += len(events) - len(audit_new)
            # exec_log is filled by a view on audit_events inserts; rows whose audit row made it
            # but whose exec_log row did not (a crash inside that insert) are repaired directly
            stored_execs = [e.id for e in events if e.id in in_audit and e.kind == "exec"]
            if stored_execs:
                in_exec = await asyncio.to_thread(self.store.existing_ids, "exec_log", stored_execs)
                exec_repair = [e for e in events if e.id in in_audit and e.kind == "exec" and e.id not in in_exec]
        # rules now: alerts go out without waiting for the commit (they are stored with it)
        alerts = await self.on_events(events, bool(maybe_seen)) if self.on_events is not None else []
        if dups:
            DUPLICATES.labels(self.stream).inc(dups)
        ids = [e.id for e in events]
        pending.audit.extend(audit_new)
        pending.exec_repair.extend(exec_repair)
        if alerts:
            pending.alerts.extend(alerts)
        pending.ids.extend(ids)
        pending.max_ts = max(pending.max_ts, max(e.ts for e in events))
        inflight.update(ids)

    async def commit(self, pending: _AuditPending) -> None:
        if pending.exec_repair:
            await self._insert("exec_log", [exec_row(e) for e in pending.exec_repair])
        if pending.audit:
            await self._insert("audit_events", pending.audit)
            ROWS.labels("exec_log").inc(sum(1 for e in pending.audit if e.kind == "exec"))
            self.fault.hit("crash-after-insert")
        if pending.alerts and self.store_alerts is not None:
            await self.store_alerts(pending.alerts)
        self.recent.add_all(pending.ids)
        self.inflight.difference_update(pending.ids)
        EVENTS.labels(self.stream).inc(len(pending.audit))
        if pending.ids:
            LAG.labels(self.stream).set(max(0.0, time.time() - pending.max_ts))

    def abandon(self, pending: _AuditPending) -> None:
        self.inflight.difference_update(pending.ids)

    async def _insert(self, table: str, rows: list) -> None:
        t0 = time.perf_counter()
        await asyncio.to_thread(self.store.insert, table, rows)
        INSERT_SECONDS.labels(table).observe(time.perf_counter() - t0)
        ROWS.labels(table).inc(len(rows))
