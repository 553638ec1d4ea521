"""Durable JetStream pull consumers that batch the audit stream (CORRAL_AUDIT) and the lifecycle
stream (CORRAL_EVENTS) into ClickHouse.

Each fetched batch is *staged* at once: decoded (malformed messages, and malformed events inside
an otherwise good batch, are counted and dead-lettered to `corral.monitor.deadletter`, then acked:
never fatal), deduplicated, and run through the detection rules, whose alerts are published right
away. What was staged is *committed* once per `commit_s` (one insert per table, however many
fetches it holds: every ClickHouse insert costs 15-30 ms of CPU whatever its size, and on a small
node that CPU is taken from the sandboxes' execs), then the alerts are stored, and only then are
the messages acked. A crash anywhere before the ack means JetStream redelivers them; a redelivered
message (`num_delivered > 1`) has its ids checked against each table before inserting, so a row is
never stored twice, and alert ids are deterministic, so an alert is not stored twice and JetStream
drops its re-publication. The consumer's ack wait must be well above `commit_s` (the service
enforces it).

A message that keeps failing for a reason other than an outage is retried alone and, after
`poison_after` deliveries, dead-lettered (reason "unprocessable") so it cannot block the stream."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, FetchTimeoutError

from corral_common import metrics
from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent

from .store import ExecRow, SandboxEventRow, Store
from .watermark import Watermark

log = logging.getLogger("corral.monitor.consumer")

DEADLETTER_SUBJECT = subjects.DEADLETTER
DEADLETTER_STREAM = subjects.DEADLETTER_STREAM

ROWS = metrics.counter("corral_monitor_rows_inserted_total", "Rows inserted into ClickHouse", ("table",))
EVENTS = metrics.counter("corral_monitor_events_ingested_total", "Events ingested (new, stored)", ("stream",))
DUPLICATES = metrics.counter("corral_monitor_duplicates_total", "Events dropped as already stored", ("stream",))
MALFORMED = metrics.counter("corral_monitor_malformed_total", "Malformed messages or events (dead-lettered)", ("stream", "reason"))
DEADLETTERED = metrics.counter("corral_monitor_deadlettered_total", "Messages published to the dead-letter stream", ("stream",))
BATCH_FAILURES = metrics.counter("corral_monitor_batch_failures_total", "Batches that failed and will be redelivered", ("stream",))
BATCH_SECONDS = metrics.histogram("corral_monitor_batch_seconds", "Time to stage one fetched batch (decode, dedup, rules)", ("stream",),
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
COMMIT_SECONDS = metrics.histogram("corral_monitor_commit_seconds", "Time to store what was staged since the last commit", ("stream",),
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
INSERT_SECONDS = metrics.histogram("corral_monitor_insert_seconds", "ClickHouse insert time", ("table",),
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
PENDING = metrics.gauge("corral_monitor_pending_messages", "Messages in the stream not yet delivered to the monitor", ("stream",))
LAG = metrics.gauge("corral_monitor_lag_seconds", "Age of the newest event in the last batch when it was stored", ("stream",))

MIN_TS, MAX_TS = 946_684_800.0, 4_102_444_800.0  # 2000-01-01 .. 2100-01-01


class RecentIds:
    """Ids stored by this process lately (two generations, bounded): catches a publisher's duplicate
    (the same event in two messages) without a query."""

    def __init__(self, size: int = 500_000):
        self.size = size
        self.cur: set[str] = set()
        self.old: set[str] = set()

    def __contains__(self, k: str) -> bool:
        return k in self.cur or k in self.old

    def add_all(self, ks: list[str]) -> None:
        self.cur.update(ks)
        if len(self.cur) > self.size:
            self.old, self.cur = self.cur, set()


class Fault:
    """Fault injection for tests: `crash-after-insert:N` exits (like kill -9) right after the N-th
    audit insert, before anything is acked."""

    def __init__(self, spec: str = ""):
        self.kind, _, n = spec.partition(":")
        self.n = int(n) if n else 0
        self.count = 0

    def hit(self, kind: str) -> None:
        if self.kind == kind:
            self.count += 1
            if self.count >= self.n:
                log.warning("fault injection: exiting", extra={"fields": {"fault": kind, "after": self.count}})
                logging.shutdown()
                os._exit(137)


# ----------------------------------------------------------------------------- dead letters


class DeadLetters:
    def __init__(self, js: JetStreamContext):
        self.js = js

    async def ensure(self) -> None:
        cfg = StreamConfig(name=DEADLETTER_STREAM, subjects=[DEADLETTER_SUBJECT], storage=StorageType.FILE, max_age=30 * 86400)
        try:
            await self.js.add_stream(cfg)
        except BadRequestError:
            await self.js.update_stream(cfg)

    async def put(self, stream: str, msg: Msg, data: bytes, reason: str, error: str) -> None:
        md = msg.metadata
        headers = {
            "Corral-Source-Stream": stream,
            "Corral-Source-Subject": msg.subject,
            "Corral-Source-Seq": str(md.sequence.stream),
            "Corral-Reason": reason,
            "Corral-Error": error.replace("\r", " ").replace("\n", " ")[:500],
            # the same bad message redelivered is one dead letter
            "Nats-Msg-Id": f"dl-{stream}-{md.sequence.stream}-{hashlib.blake2b(data, digest_size=8).hexdigest()}",
        }
        await self.js.publish(DEADLETTER_SUBJECT, data, headers=headers, timeout=5)
        MALFORMED.labels(stream, reason).inc()
        DEADLETTERED.labels(stream).inc()
        log.warning("dead-lettered", extra={"fields": {"stream": stream, "subject": msg.subject, "reason": reason, "error": error[:300]}})


# ----------------------------------------------------------------------------- pull loop


def _transient(e: BaseException) -> bool:
    """An outage (ClickHouse or NATS unreachable, a timeout): retry everything later. Anything
    else is a problem with the data, to be isolated."""
    name = type(e).__name__
    return isinstance(e, (OSError, TimeoutError, asyncio.TimeoutError)) or name in ("OperationalError", "NoServersError",
                                                                                     "ConnectionClosedError", "TimeoutError")


Handler = Callable[[list[Msg]], Awaitable[None]]


class Staged:
    """A handler in two steps: `stage(msgs, pending)` does the per-fetch work (decode, dedup,
    rules) and adds what is to be stored to `pending`, changing nothing else if it raises;
    `commit(pending)` stores it; `abandon(pending)` forgets a pending that failed to commit (its
    messages are redelivered)."""

    def new_pending(self) -> Any:
        raise NotImplementedError

    async def stage(self, msgs: list[Msg], pending: Any) -> None:
        raise NotImplementedError

    async def commit(self, pending: Any) -> None:
        raise NotImplementedError

    def abandon(self, pending: Any) -> None:
        pass

    async def __call__(self, msgs: list[Msg]) -> None:
        p = self.new_pending()
        await self.stage(msgs, p)
        try:
            await self.commit(p)
        except Exception:
            self.abandon(p)
            raise


class _Whole(Staged):
    """A plain handler: all its work is done when a batch is staged; the ack waits for the commit."""

    def __init__(self, fn: Handler):
        self.fn = fn

    def new_pending(self) -> None:
        return None

    async def stage(self, msgs: list[Msg], pending: Any) -> None:
        await self.fn(msgs)

    async def commit(self, pending: Any) -> None:
        pass


class PullConsumer:
    """`workers` concurrent fetch loops on one durable pull consumer. Each fetched batch is staged
    by `handler` at once; what was staged is committed once per `commit_s` and its messages are
    acked only after that; if staging or the commit raises, the messages are nak'ed with a delay
    and redelivered (or, for a failure that is not an outage, retried one by one). A plain
    async function as `handler` does all its work when a batch is staged."""

    def __init__(self, js: JetStreamContext, stream: str, durable: str, subject: str, handler: Handler, *,
                 batch: int = 256, workers: int = 1, ack_wait_s: float = 60.0, max_ack_pending: int = 20_000,
                 fetch_timeout_s: float = 1.0, inflight_bytes: int = 24 * 1024 * 1024,
                 on_poison: Callable[[Msg, str], Awaitable[None]] | None = None, poison_after: int = 5,
                 commit_s: float = 0.0, commit_bytes: int = 8 * 1024 * 1024, watermark: Watermark | None = None):
        self.js = js
        self.stream = stream
        self.durable = durable
        self.subject = subject
        self.handler = handler if isinstance(handler, Staged) else _Whole(handler)
        self.batch = batch
        self.workers = workers
        self.ack_wait_s = ack_wait_s
        self.max_ack_pending = max_ack_pending
        self.fetch_timeout_s = fetch_timeout_s
        self.inflight_bytes = inflight_bytes
        self.on_poison = on_poison
        self.poison_after = poison_after
        self.commit_s = commit_s
        self.commit_bytes = commit_bytes
        self.avg_size = 64 * 1024.0  # a node-agent batch of 256 exec events
        self.subs: list[Any] = []
        # how far the stream is stored contiguously (evaluate waits on it); None: not tracked
        self.watermark = watermark

    async def setup(self) -> None:
        cfg = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                             ack_wait=self.ack_wait_s, max_ack_pending=self.max_ack_pending, filter_subject=self.subject,
                             max_deliver=-1)
        try:
            await self.js.add_consumer(self.stream, cfg)  # creates, or updates the existing durable's settings
        except BadRequestError as e:
            log.warning("could not update the durable consumer; keeping its settings",
                        extra={"fields": {"stream": self.stream, "durable": self.durable, "error": str(e)}})
        if self.watermark is not None:
            # everything up to the ack floor was stored before (acks follow commits); before the
            # stream's first message there is nothing left to store
            self.watermark.raise_to(await self.stored_floor())
        for _ in range(self.workers):
            self.subs.append(await self.js.pull_subscribe_bind(self.durable, self.stream))

    async def stored_floor(self) -> int:
        """The durable's ack floor (contiguous over every process bound to it), or the sequence
        before the stream's first message if that is higher (older ones expired)."""
        ci = await self.js.consumer_info(self.stream, self.durable)
        floor = (ci.ack_floor.stream_seq or 0) if ci.ack_floor is not None else 0
        si = await self.js.stream_info(self.stream)
        return max(floor, (si.state.first_seq or 1) - 1)

    def _stored(self, msgs: list[Msg]) -> None:
        if self.watermark is not None and msgs:
            self.watermark.done([m.metadata.sequence.stream for m in msgs])

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._work(sub, stop) for sub in self.subs))

    def _fetch_size(self) -> int:
        """Messages per fetch: `batch`, but keep everything in flight to this connection (all
        workers) under `inflight_bytes`, or NATS cuts it off as a slow consumer (64 MB)."""
        per_worker = self.inflight_bytes / self.workers
        return max(1, min(self.batch, int(per_worker / max(1.0, self.avg_size))))

    async def _work(self, sub: Any, stop: asyncio.Event) -> None:
        """Fetch and stage batches; commit what is staged once per `commit_s` (or when it holds
        `commit_bytes`), then ack it. With `commit_s` 0 every fetch is committed on its own. A
        commit runs beside the fetching and staging of the next batches (at most one per
        worker at a time, in order)."""
        loop = asyncio.get_running_loop()
        h = self.handler
        self.backoff = 0.1
        pending = h.new_pending()
        held: list[Msg] = []
        held_bytes = 0
        due = 0.0
        committing: asyncio.Task | None = None
        while not stop.is_set():
            timeout = self.fetch_timeout_s
            if held:
                timeout = min(timeout, max(0.001, due - loop.time()))
            msgs: list[Msg] = []
            try:
                msgs = await sub.fetch(self._fetch_size(), timeout=timeout)
            except (TimeoutError, asyncio.TimeoutError, NatsTimeout, FetchTimeoutError):
                pass
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("fetch failed", extra={"fields": {"stream": self.stream, "error": repr(e)}})
                await asyncio.sleep(0.5)
            if msgs:
                nbytes = sum(len(m.data) for m in msgs)
                size = nbytes / len(msgs)
                self.avg_size = max(size, 0.8 * self.avg_size + 0.2 * size)
                try:
                    PENDING.labels(self.stream).set(msgs[-1].metadata.num_pending)
                except Exception:  # a gauge only: a message without JetStream metadata must not stop ingestion
                    pass
                t0 = time.perf_counter()
                try:
                    await h.stage(msgs, pending)
                except Exception as e:
                    await self._failed(msgs, e)
                else:
                    BATCH_SECONDS.labels(self.stream).observe(time.perf_counter() - t0)
                    if not held:
                        due = loop.time() + self.commit_s
                    held.extend(msgs)
                    held_bytes += nbytes
            if held and (loop.time() >= due or held_bytes >= self.commit_bytes):
                if committing is not None:
                    await committing
                committing = asyncio.create_task(self._commit(pending, held))
                pending, held, held_bytes = h.new_pending(), [], 0
        if committing is not None:
            await committing
        if held:  # stopping: store and ack what was staged
            await self._commit(pending, held)

    async def _commit(self, pending: Any, held: list[Msg]) -> None:
        t0 = time.perf_counter()
        try:
            await self.handler.commit(pending)
        except Exception as e:
            self.handler.abandon(pending)
            await self._failed(held, e)
            return
        COMMIT_SECONDS.labels(self.stream).observe(time.perf_counter() - t0)
        self.backoff = 0.1
        self._stored(held)
        await self._ack_all(held)

    async def _failed(self, msgs: list[Msg], e: Exception) -> None:
        BATCH_FAILURES.labels(self.stream).inc()
        log.exception("batch failed", extra={"fields": {"stream": self.stream, "messages": len(msgs), "error": repr(e)}})
        if _transient(e):
            await self._nak_all(msgs, self.backoff)
            await asyncio.sleep(self.backoff)
            self.backoff = min(self.backoff * 2, 5.0)
        else:
            await self._one_by_one(msgs, self.backoff)

    async def _whole(self, msgs: list[Msg]) -> None:
        """Stage and commit `msgs` on their own."""
        p = self.handler.new_pending()
        await self.handler.stage(msgs, p)
        try:
            await self.handler.commit(p)
        except Exception:
            self.handler.abandon(p)
            raise

    async def _ack_all(self, msgs: list[Msg]) -> None:
        for m in msgs:
            try:
                await m.ack()
            except Exception:
                pass  # the batch comes back; its ids are found and skipped

    async def _nak_all(self, msgs: list[Msg], backoff: float) -> None:
        for m in msgs:
            try:
                await m.nak(delay=min(backoff * 4, 5.0))
            except Exception:  # an un-nakked message is redelivered after ack_wait anyway
                pass

    async def _one_by_one(self, msgs: list[Msg], backoff: float) -> None:
        """A batch failed for a reason that is not an outage: isolate the message that cannot be
        processed; after `poison_after` deliveries it is dead-lettered instead of blocking the stream."""
        for m in msgs:
            try:
                await self._whole([m])
            except Exception as e:
                delivered = m.metadata.num_delivered or 1
                if self.on_poison is not None and delivered >= self.poison_after and not _transient(e):
                    try:
                        await self.on_poison(m, repr(e))
                    except Exception:
                        await self._nak_all([m], backoff)
                    else:
                        self._stored([m])  # dead-lettered: as far as it will ever get
                        await self._ack_all([m])
                else:
                    await self._nak_all([m], backoff)
                continue
            self._stored([m])
            await self._ack_all([m])

    async def close(self) -> None:
        for s in self.subs:
            try:
                await s.unsubscribe()
            except Exception:  # closing: a subscription whose connection already closed is gone anyway
                pass


# ----------------------------------------------------------------------------- audit ingestion


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


# ----------------------------------------------------------------------------- lifecycle events


class _Info(msgspec.Struct, kw_only=True):
    id: str = ""
    node: str = ""
    state: str = ""
    substrate: str = ""
    image: str = ""
    job: str = ""
    labels: dict[str, str] = {}
    cpu: float = 0.0
    memory_mb: int = 0


class _Event(msgspec.Struct, kw_only=True):
    kind: str = ""
    ts: float = 0.0
    sandbox_id: str = ""
    node: str = ""
    job: str = ""
    reason: str = ""
    info: _Info | None = None
    detail: dict[str, Any] = {}


_lifecycle_decoder = msgspec.json.Decoder(type=_Event)
_json = msgspec.json.Encoder()

OnLifecycle = Callable[[list[SandboxEventRow], list[_Event]], None]


class _EventPending:
    __slots__ = ("rows", "ids")

    def __init__(self) -> None:
        self.rows: list[SandboxEventRow] = []
        self.ids: list[str] = []


class EventIngest(Staged):
    """Handler for CORRAL_EVENTS: sandbox lifecycle (`corral.events.sandbox.<id>.<kind>`) and node
    events (`corral.events.node.<node>.<kind>`). Ids are a hash of subject and payload.
    `on_lifecycle` sees each fetch when it is staged; the rows are inserted at the commit."""

    stream = "CORRAL_EVENTS"

    def __init__(self, store: Store, dead: DeadLetters, on_lifecycle: OnLifecycle | None = None):
        self.store = store
        self.dead = dead
        self.on_lifecycle = on_lifecycle
        self.recent = RecentIds(100_000)
        self.inflight: set[str] = set()

    def new_pending(self) -> _EventPending:
        return _EventPending()

    async def stage(self, msgs: list[Msg], pending: _EventPending) -> None:
        rows: list[SandboxEventRow] = []
        evs: list[_Event] = []
        maybe_seen: set[str] = set()
        for m in msgs:
            parts = m.subject.split(".")
            if len(parts) < 5 or parts[2] not in ("sandbox", "node"):
                await self.dead.put(self.stream, m, m.data, "subject", f"unexpected subject {m.subject}")
                continue
            try:
                ev = _lifecycle_decoder.decode(m.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self.dead.put(self.stream, m, m.data, "event", str(e))
                continue
            rid = "ev-" + hashlib.blake2b(m.subject.encode() + b"\0" + m.data, digest_size=12).hexdigest()
            ts = ev.ts if MIN_TS <= ev.ts <= MAX_TS else m.metadata.timestamp
            info = ev.info or _Info()
            if parts[2] == "sandbox":
                sandbox, node, kind = parts[3], ev.node or info.node, ev.kind or parts[4]
            else:
                sandbox, node, kind = "", parts[3], ev.kind or parts[4]
            detail = {k: v for k, v in ev.detail.items()} if ev.detail else {}
            if parts[2] == "node" and not ev.detail:
                try:
                    detail = msgspec.json.decode(m.data)
                except Exception:
                    detail = {}
            rows.append(SandboxEventRow(
                id=rid, ts=ts, kind=kind, sandbox=sandbox, node=node, job=ev.job or info.job, reason=ev.reason,
                image=info.image, substrate=info.substrate, state=info.state, cpu=info.cpu, memory_mb=max(0, info.memory_mb),
                labels=info.labels, subject=m.subject, detail=_json.encode(detail).decode() if detail else "",
            ))
            evs.append(ev)
            if m.metadata.num_delivered and m.metadata.num_delivered > 1:
                maybe_seen.add(rid)
        seen: set[str] = set()
        fresh: list[SandboxEventRow] = []
        for r in rows:
            if r.id not in seen and r.id not in self.recent and r.id not in self.inflight:
                seen.add(r.id)
                fresh.append(r)
        if maybe_seen and fresh:
            have = await asyncio.to_thread(self.store.existing_ids, "sandbox_events", [r.id for r in fresh if r.id in maybe_seen])
            fresh = [r for r in fresh if r.id not in have]
        if self.on_lifecycle is not None and rows:
            self.on_lifecycle(rows, evs)
        if len(fresh) < len(rows):
            DUPLICATES.labels(self.stream).inc(len(rows) - len(fresh))
        ids = list(seen)
        pending.rows.extend(fresh)
        pending.ids.extend(ids)
        self.inflight.update(ids)

    async def commit(self, pending: _EventPending) -> None:
        if pending.rows:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.store.insert, "sandbox_events", pending.rows)
            INSERT_SECONDS.labels("sandbox_events").observe(time.perf_counter() - t0)
            ROWS.labels("sandbox_events").inc(len(pending.rows))
            EVENTS.labels(self.stream).inc(len(pending.rows))
        self.recent.add_all(pending.ids)
        self.inflight.difference_update(pending.ids)

    def abandon(self, pending: _EventPending) -> None:
        self.inflight.difference_update(pending.ids)
