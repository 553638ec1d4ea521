"""Durable JetStream pull consumers that stage each fetched batch at once and commit what was
staged once per `commit_s`, acking the messages only after the commit.

One insert per table per commit, however many fetches it holds: every ClickHouse insert costs
15-30 ms of CPU whatever its size, and on a small node that CPU is taken from the sandboxes'
execs. A crash anywhere before the ack means JetStream redelivers the messages (the handlers make
that harmless: see `corral_monitor.ingest`). The consumer's ack wait must be well above
`commit_s` (the service enforces it).

A message that keeps failing for a reason other than an outage is retried alone and, after
`poison_after` deliveries, handed to `on_poison` (the service dead-letters it, reason
"unprocessable") so it cannot block the stream."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, FetchTimeoutError

from corral_common import metrics

from .watermark import Watermark

log = logging.getLogger("corral.monitor.consumer")

BATCH_FAILURES = metrics.counter("corral_monitor_batch_failures_total", "Batches that failed and will be redelivered", ("stream",))
BATCH_SECONDS = metrics.histogram("corral_monitor_batch_seconds", "Time to stage one fetched batch (decode, dedup, rules)", ("stream",),
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
COMMIT_SECONDS = metrics.histogram("corral_monitor_commit_seconds", "Time to store what was staged since the last commit", ("stream",),
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
PENDING = metrics.gauge("corral_monitor_pending_messages", "Messages in the stream not yet delivered to the monitor", ("stream",))


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
