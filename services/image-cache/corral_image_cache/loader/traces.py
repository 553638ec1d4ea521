"""Start traces: the order in which an image's first start read its chunks, recorded for
`trace_window_s` and stored in the catalog, then replayed as prefetch on every later start.

Recording runs in FUSE threads (`note`, under a lock) and on the loop (start, finish); replay is
the node cache's business (it queues the loads), handed in as `replay`."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from corral_common import logs
from corral_common.contract.images import Trace, TraceRead
from corral_common.layers import Catalog

log = logging.getLogger("corral.loader")

Replay = Callable[[str, Trace, set[str]], int]
Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task]


class Recording:
    """First-access chunk order of an image's first start, for `trace_window_s`."""

    def __init__(self, image: str, layers: set[str], deadline: float):
        self.image = image
        self.layers = layers
        self.deadline = deadline
        self.seen: set[tuple[str, int]] = set()
        self.reads: list[TraceRead] = []


class Traces:
    def __init__(self, catalog: Catalog, node: str, window_s: float, max_payload: Callable[[], int], replay: Replay,
                 spawn: Spawn):
        self.catalog = catalog
        self.node = node
        self.window_s = window_s
        self.max_payload = max_payload  # the connection's, read when a trace is stored
        self.replay = replay
        self.spawn = spawn
        self.recordings: dict[str, Recording] = {}
        self.by_layer: dict[str, list[Recording]] = {}  # read by FUSE threads without the lock first
        self.lock = threading.Lock()

    async def start(self, image: str, layers: list[str]) -> tuple[int, bool]:
        """Replay the image's stored trace, or record one: (chunks queued, recording)."""
        try:
            trace = await self.catalog.trace(image)
        except Exception:
            trace = None
        wanted = set(layers)
        if trace is not None and any(r.layer in wanted for r in trace.reads):
            return self.replay(image, trace, wanted), False
        if image in self.recordings:
            return 0, True
        rec = Recording(image, wanted, time.monotonic() + self.window_s)
        with self.lock:
            self.recordings[image] = rec
            for d in wanted:
                self.by_layer.setdefault(d, []).append(rec)
        self.spawn(self._record_window(rec))
        return 0, True

    def note(self, digest: str, first: int, last: int) -> None:
        """In a FUSE thread: chunks first..last of layer `digest` were read."""
        with self.lock:
            recs = self.by_layer.get(digest)
            if not recs:
                return
            now = time.monotonic()
            for rec in recs:
                if now > rec.deadline:
                    continue
                for i in range(first, last + 1):
                    k = (digest, i)
                    if k not in rec.seen:
                        rec.seen.add(k)
                        rec.reads.append(TraceRead(digest, i))

    async def _record_window(self, rec: Recording) -> None:
        await asyncio.sleep(max(0.0, rec.deadline - time.monotonic()))
        await self.finish(rec)

    async def finish_all(self) -> None:
        """Stopping: store what the open recordings have so far."""
        for rec in list(self.recordings.values()):
            await self.finish(rec)

    async def finish(self, rec: Recording) -> None:
        with self.lock:
            if self.recordings.get(rec.image) is not rec:
                return
            del self.recordings[rec.image]
            for d in rec.layers:
                lst = self.by_layer.get(d, [])
                if rec in lst:
                    lst.remove(rec)
                if not lst:
                    self.by_layer.pop(d, None)
            reads = list(rec.reads)
        if not reads:
            logs.kv(log, logging.INFO, "no reads during the trace window; nothing recorded", image=rec.image)
            return
        trace = Trace(image=rec.image, reads=reads, recorded_at=time.time(), node=self.node)
        size = len(msgspec.json.encode(trace))
        limit = max(64 * 1024, (self.max_payload() or 1 << 20) - 8192)
        if size > limit:  # a KV value is one NATS message: keep the first reads, they matter most
            keep = int(len(reads) * limit / size * 0.95)
            logs.kv(log, logging.WARNING, "trace too large for one message; keeping its beginning", image=rec.image,
                    chunks=len(reads), kept=keep)
            trace.reads = reads[:keep]
        try:
            await self.catalog.put_trace(trace)
            logs.kv(log, logging.INFO, "trace recorded", image=rec.image, chunks=len(trace.reads))
        except Exception as e:
            logs.kv(log, logging.WARNING, "could not store trace", image=rec.image, error=str(e))
