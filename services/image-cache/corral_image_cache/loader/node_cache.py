"""The node cache: every layer on this node, the single-flight chunk loads into it, and its size cap.

Reads come from FUSE threads (`read_range`): cached chunks are served straight from the layer's
files; misses wait on the asyncio loop, which owns the loads (`asyncio.run_coroutine_threadsafe`
with `read_timeout_s`). A chunk is loaded once however many readers want it, from another cached
layer holding the same bytes if there is one, else from the chunk store through the fetch pool,
at the priority of its most urgent reader (demand, then prefetch: readahead and trace replay, then
background fill). A chunk that cannot be fetched or verified gives its readers EIO and is audited.
Over its cap, the cache evicts the least recently used layers no sandbox holds."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import logging
import os
import threading
import time

import mfusepy as fuse
from nats.js import JetStreamContext

from corral_common import logs
from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
from corral_common.contract.errors import Conflict, NotFound
from corral_common.contract.images import LayerManifest, Trace
from corral_common.contract.messages import encoder

from .cache import Layer, scan
from .config import LoaderConfig
from .fetcher import DEMAND, FILL, PREFETCH, PRIO_NAMES, ChunkError, FetchPool, verify
from .meters import (
    BYTES_FETCHED,
    CACHE_BYTES,
    CHUNK_HITS,
    CHUNK_MISSES,
    CHUNKS_FETCHED,
    EVICTIONS,
    FETCH_ERRORS,
    FETCH_SECONDS,
    LAYERS_IN_USE,
    PREFETCH_CHUNKS,
    READ_ERRORS,
)
from .traces import Spawn, Traces

log = logging.getLogger("corral.loader")

COUNTERS = ("bytes_fetched", "fetches", "fetches_demand", "fetches_prefetch", "fetches_fill", "fetch_errors",
            "chunk_hits", "chunk_misses", "chunk_joins", "prefetched_chunks", "readahead_chunks", "filled_chunks", "local_copies",
            "evictions", "read_errors")


class NodeCache:
    def __init__(self, cfg: LoaderConfig, root: str, mount: str, spawn: Spawn):
        self.cfg = cfg
        self.node = cfg.node
        self.root = root
        self.mount = mount
        self.spawn = spawn
        self.cap = cfg.cache_max_mb * 1024 * 1024
        self.layers: dict[str, Layer] = {}
        self.pending: dict[tuple[str, int], asyncio.Task] = {}
        self.pending_prio: dict[tuple[str, int], int] = {}
        self.by_hash: dict[str, tuple[Layer, int]] = {}
        self.count_lock = threading.Lock()
        self.st: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self.audit_tasks: set[asyncio.Task] = set()
        self.audit_last: dict[tuple[str, int], float] = {}
        self.last_demand = time.monotonic()
        self.over_cap_warned = False
        self.evicting = False
        self.closing = False
        self.m_hits = CHUNK_HITS.labels(cfg.node)
        # set by the loader as it starts: before the mount, so before any read
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: FetchPool | None = None
        self.js: JetStreamContext | None = None
        self.traces: Traces | None = None

    async def load(self) -> None:
        """The layers a previous run left in the cache directory."""
        self.loop = asyncio.get_running_loop()
        for layer in await asyncio.to_thread(scan, self.root):
            self.layers[layer.digest] = layer
            for i in range(layer.n):
                if layer.bitmap[i]:
                    self.by_hash.setdefault(layer.m.chunks[i], (layer, i))
        self.changed()

    def close(self) -> None:
        for layer in self.layers.values():
            layer.close()

    # ================================================================ use by sandboxes

    async def use(self, found: list[LayerManifest], layers: list[str]) -> None:
        """Count one use of each of `layers` (per occurrence) and make their files visible; a
        layer whose manifest changed its chunking is dropped and started afresh unless in use
        (conflict: nothing changes). No await but for dropping replaced layers' files."""
        replaced: list[Layer] = []
        for m in found:
            layer = self.layers.get(m.digest)
            if layer is not None and (layer.m.chunk_size != m.chunk_size or layer.m.chunks != m.chunks or layer.size != m.size):
                if layer.refs > 0 or layer.pending > 0:
                    raise Conflict(f"layer {m.digest} is in use with a different chunking than its manifest now lists")
                replaced.append(layer)
                layer = None
        for old in replaced:
            old.visible = False
            for h in old.m.chunks:
                if self.by_hash.get(h, (None,))[0] is old:
                    del self.by_hash[h]
            await asyncio.to_thread(old.drop_data)
            if self.layers.get(old.digest) is old:
                del self.layers[old.digest]
        for m in found:
            if m.digest not in self.layers:
                self.layers[m.digest] = Layer(self.root, m)
        now = time.time()
        for d in layers:
            layer = self.layers[d]
            layer.refs += 1
            layer.visible = True
            layer.last_used = now
        LAYERS_IN_USE.labels(self.node).set(sum(1 for x in self.layers.values() if x.refs))

    def release(self, layers: list[str]) -> tuple[list[str], list[str]]:
        """One use less of each of `layers`: (released, not prepared)."""
        released, not_prepared = [], []
        now = time.time()
        for d in layers:
            layer = self.layers.get(d)
            if layer is None or layer.refs <= 0:
                not_prepared.append(d)
                continue
            layer.refs -= 1
            layer.last_used = now
            released.append(d)
        LAYERS_IN_USE.labels(self.node).set(sum(1 for x in self.layers.values() if x.refs))
        self.changed()
        return released, not_prepared

    async def evict_unused(self, digest: str | None) -> list[str]:
        """Evict layer `digest` (not in use), or every layer not in use: the evicted digests."""
        if digest is not None:
            layer = self.layers.get(digest)
            if layer is None:
                raise NotFound(f"layer {digest} is not on node {self.node}")
            if layer.refs > 0:
                raise Conflict(f"layer {digest} is in use ({layer.refs} prepares not released)")
            targets = [layer]
        else:
            targets = [layer for layer in self.layers.values() if layer.refs == 0]
        evicted = []
        for layer in sorted(targets, key=lambda x: x.last_used):
            if layer.refs == 0 and layer.pending == 0 and (layer.cached_bytes > 0 or layer.visible):
                await self.evict(layer, "request")
                evicted.append(layer.digest)
        return evicted

    # ================================================================ reads (FUSE threads)

    def read_range(self, layer: Layer, offset: int, size: int) -> bytes:
        if offset >= layer.size or size <= 0:
            return b""
        end = min(layer.size, offset + size)
        first, last = offset // layer.cs, (end - 1) // layer.cs
        layer.last_used = time.time()
        if self.traces is not None and self.traces.by_layer:
            self.traces.note(layer.digest, first, last)
        # a reader crossing from one chunk into the next reads sequentially: fetch ahead of it
        sequential = layer.last_chunk + 1 == first or (first < last and layer.last_chunk == first)
        layer.last_chunk = last
        if sequential and self.cfg.readahead_chunks and last + 1 < layer.n and not layer.bitmap[last + 1]:
            try:
                self.loop.call_soon_threadsafe(self._readahead, layer, last)
            except RuntimeError:
                pass
        data = layer.pread(offset, end - offset, first, last)
        if data is not None:
            self.m_hits.inc(last - first + 1)
            with self.count_lock:
                self.st["chunk_hits"] += last - first + 1
            return data
        self.last_demand = time.monotonic()
        missing = [i for i in range(first, last + 1) if not layer.bitmap[i]]
        hits = last - first + 1 - len(missing)
        if hits:
            self.m_hits.inc(hits)
            with self.count_lock:
                self.st["chunk_hits"] += hits
        for _ in range(3):
            if self.closing and self.loop.is_closed():
                break
            try:
                fut = asyncio.run_coroutine_threadsafe(self._ensure(layer, missing, DEMAND, True), self.loop)
            except RuntimeError:  # the loop is gone
                break
            try:
                fut.result(self.cfg.read_timeout_s)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                logs.kv(log, logging.ERROR, "read timed out waiting for chunks", layer=layer.digest, offset=offset,
                        size=size, chunks=missing, timeout_s=self.cfg.read_timeout_s)
                break
            except ChunkError:
                break  # already logged and audited once per failed fetch
            except BaseException as e:  # noqa: BLE001 - the reader must get an answer
                logs.kv(log, logging.ERROR, "read failed", layer=layer.digest, offset=offset, error=f"{type(e).__name__}: {e}")
                break
            data = layer.pread(offset, end - offset, first, last)
            if data is not None:
                return data
            missing = [i for i in range(first, last + 1) if not layer.bitmap[i]]  # evicted meanwhile
        READ_ERRORS.labels(self.node).inc()
        with self.count_lock:
            self.st["read_errors"] += 1
        raise fuse.FuseOSError(errno.EIO)

    # ================================================================ chunk loading (loop)

    async def _ensure(self, layer: Layer, idxs: list[int], prio: int, demand_count: bool = False) -> None:
        waits = [self._load(layer, i, prio, demand_count) for i in idxs]
        res = await asyncio.gather(*waits, return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException):
                raise r

    def _readahead(self, layer: Layer, last: int) -> None:
        n = 0
        for j in range(last + 1, min(layer.n, last + 1 + self.cfg.readahead_chunks)):
            if not layer.bitmap[j] and (layer.digest, j) not in self.pending:
                self._load(layer, j, PREFETCH, wait=False)
                n += 1
        if n:
            PREFETCH_CHUNKS.labels(self.node, "readahead").inc(n)
            self.st["readahead_chunks"] += n

    def _load(self, layer: Layer, i: int, prio: int, demand_count: bool = False, wait: bool = True) -> asyncio.Future | None:
        """A shielded future for chunk `i` of `layer` being in the cache (single-flight)."""
        key = (layer.digest, i)
        t = self.pending.get(key)
        if t is None:
            if layer.bitmap[i]:
                f = self.loop.create_future()
                f.set_result(None)
                return f
            if demand_count:
                CHUNK_MISSES.labels(self.node, "fetch").inc()
                self.st["chunk_misses"] += 1
            t = self.loop.create_task(self._fetch_into(layer, i, prio))
            self.pending[key] = t
            self.pending_prio[key] = prio
            layer.pending += 1

            def done(t: asyncio.Task, key=key, layer=layer) -> None:
                self.pending.pop(key, None)
                self.pending_prio.pop(key, None)
                layer.pending -= 1
                if not t.cancelled():
                    t.exception()

            t.add_done_callback(done)
            if not wait:
                return None
        else:
            if demand_count:
                CHUNK_MISSES.labels(self.node, "inflight").inc()
                self.st["chunk_joins"] += 1
            if prio < self.pending_prio.get(key, prio):
                self.pending_prio[key] = prio
                self.spawn(self.pool.promote(layer.m.chunks[i], prio))
        return asyncio.shield(t) if wait else None

    async def _fetch_into(self, layer: Layer, i: int, prio: int) -> None:
        h = layer.m.chunks[i]
        n = layer.m.chunk_len(i)
        data = None
        src = self.by_hash.get(h)
        if src is not None and src != (layer, i):
            data = await asyncio.to_thread(self._local_copy, src[0], src[1], h, n)
        if data is None:
            try:
                data = await self.pool.get(h, n, prio)
            except ChunkError as e:
                self._chunk_failed(layer, i, e, prio)
                raise
            layer.fetched += 1
        else:
            self.st["local_copies"] += 1
        await asyncio.to_thread(layer.write_chunk, i, data)
        self.by_hash[h] = (layer, i)
        self.changed()

    def _local_copy(self, src: Layer, j: int, h: str, n: int) -> bytes | None:
        """The chunk from another cached layer holding the same bytes (cross-layer dedup)."""
        data = src.read_chunk(j)
        if data is None:
            return None
        bad = verify(data, h, n)
        if bad:
            logs.kv(log, logging.WARNING, "cached chunk does not match its hash; fetching it again", layer=src.digest, chunk=j, error=bad)
            return None
        return data

    def observe_fetch(self, prio: int, seconds: float, nbytes: int, success: bool) -> None:
        p = PRIO_NAMES[prio]
        FETCH_SECONDS.labels(self.node, p).observe(seconds)
        if success:
            BYTES_FETCHED.labels(self.node, p).inc(nbytes)
            CHUNKS_FETCHED.labels(self.node, p).inc()
            self.st["bytes_fetched"] += nbytes
            self.st["fetches"] += 1
            self.st[f"fetches_{p}"] += 1
            self.latencies.append(seconds)

    def _chunk_failed(self, layer: Layer, i: int, e: ChunkError, prio: int) -> None:
        FETCH_ERRORS.labels(self.node, e.reason).inc()
        self.st["fetch_errors"] += 1
        logs.kv(log, logging.ERROR, "chunk fetch failed", layer=layer.digest, chunk=i, hash=e.h, reason=e.reason,
                error=e.message, priority=PRIO_NAMES[prio])
        key = (layer.digest, i)
        now = time.monotonic()
        if now - self.audit_last.get(key, -1e9) < 10:
            return
        self.audit_last[key] = now
        ev = AuditEvent(id=event_id(), ts=time.time(), node=self.node, sandbox="loader", kind="error", op="chunk_fetch",
                        path=os.path.join(self.mount, layer.digest),
                        detail={"layer": layer.digest, "chunk": str(i), "hash": e.h, "reason": e.reason, "error": e.message,
                                "priority": PRIO_NAMES[prio]})
        t = self.spawn(self._publish_audit(ev))
        self.audit_tasks.add(t)
        t.add_done_callback(self.audit_tasks.discard)

    async def _publish_audit(self, ev: AuditEvent) -> None:
        try:
            await self.js.publish(subjects.audit(self.node, "loader"), encoder.encode(AuditBatch(events=[ev])), timeout=5)
        except Exception as e:
            logs.kv(log, logging.WARNING, "could not publish audit event", error=str(e))

    # ================================================================ cache size

    def cache_bytes(self) -> int:
        return sum(layer.cached_bytes for layer in list(self.layers.values()))

    def changed(self) -> None:
        size = self.cache_bytes()
        CACHE_BYTES.labels(self.node).set(size)
        if self.cap and size > self.cap and not self.evicting and self.loop is not None:
            self.evicting = True
            self.spawn(self._evict_to_cap())

    async def _evict_to_cap(self) -> None:
        try:
            while self.cap and self.cache_bytes() > self.cap:
                cands = [layer for layer in self.layers.values() if self._evictable(layer)]
                if not cands:
                    if not self.over_cap_warned:
                        logs.kv(log, logging.WARNING, "node cache over its cap, but every cached layer is in use",
                                cache_bytes=self.cache_bytes(), cap=self.cap)
                        self.over_cap_warned = True
                    return
                await self.evict(min(cands, key=lambda layer: layer.last_used), "cap")
            self.over_cap_warned = False
        finally:
            self.evicting = False

    def _evictable(self, layer: Layer) -> bool:
        return layer.refs == 0 and layer.pending == 0 and layer.cached_bytes > 0

    async def evict(self, layer: Layer, why: str) -> None:
        freed = layer.cached_bytes
        for h in layer.m.chunks:
            src = self.by_hash.get(h)
            if src is not None and src[0] is layer:
                del self.by_hash[h]
        layer.visible = False
        await asyncio.to_thread(layer.drop_data)
        EVICTIONS.labels(self.node).inc()
        self.st["evictions"] += 1
        CACHE_BYTES.labels(self.node).set(self.cache_bytes())
        logs.kv(log, logging.INFO, "layer evicted", layer=layer.digest, freed_bytes=freed, why=why,
                cache_bytes=self.cache_bytes(), cap=self.cap)

    # ================================================================ prefetch: trace replay, background fill, exit

    def replay(self, image: str, trace: Trace, wanted: set[str]) -> int:
        """Queue the trace's chunks not cached here, in trace order, as one batch at prefetch
        priority: the pool fetches up to `fetch_parallel - reserve` of them at a time."""
        seen: set[tuple[str, int]] = set()
        waits = []
        for r in trace.reads:
            layer = self.layers.get(r.layer)
            k = (r.layer, r.chunk)
            if layer is None or r.layer not in wanted or not 0 <= r.chunk < layer.n or k in seen:
                continue
            seen.add(k)
            if layer.bitmap[r.chunk] or k in self.pending:
                continue
            waits.append(self._load(layer, r.chunk, PREFETCH))
        if not waits:
            return 0
        PREFETCH_CHUNKS.labels(self.node, "trace").inc(len(waits))
        self.st["prefetched_chunks"] += len(waits)

        async def wait() -> None:
            t0 = time.perf_counter()
            res = await asyncio.gather(*waits, return_exceptions=True)
            failed = sum(1 for r in res if isinstance(r, BaseException))
            logs.kv(log, logging.INFO, "prefetch done", image=image, chunks=len(waits), failed=failed,
                    seconds=round(time.perf_counter() - t0, 3))

        self.spawn(wait())
        return len(waits)

    async def fill_loop(self) -> None:
        quiet = self.cfg.background_fill_after_s
        while True:
            await asyncio.sleep(min(1.0, quiet))
            if time.monotonic() - self.last_demand < quiet:
                continue
            q = self.pool.queued()
            if q["demand"] or q["prefetch"]:
                continue
            batch: list[asyncio.Future] = []
            room = self.cap - self.cache_bytes() if self.cap else None
            for layer in sorted(self.layers.values(), key=lambda x: -x.last_used):
                if layer.refs == 0:
                    continue
                for i in range(layer.n):
                    if layer.bitmap[i] or (layer.digest, i) in self.pending:
                        continue
                    if room is not None:
                        room -= layer.m.chunk_len(i)
                        if room < 0:
                            break
                    batch.append(self._load(layer, i, FILL))
                    if len(batch) >= 4 * self.pool.workers:
                        break
                if len(batch) >= 4 * self.pool.workers or (room is not None and room < 0):
                    break
            if not batch:
                continue
            PREFETCH_CHUNKS.labels(self.node, "fill").inc(len(batch))
            self.st["filled_chunks"] += len(batch)
            await asyncio.gather(*batch, return_exceptions=True)

    async def finish_loads(self) -> None:
        """Chunk loads a reader asked for finish and are written to the cache before the exit.

        A read can reach the loader just before it stops (the kernel's readahead of a file-backed
        EROFS mount is asynchronous and may still be on its way after that mount is gone); were
        its fetch cancelled here, the chunk would be fetched again after a restart, although the
        loader was asked for it and had it on the way. Now no new load can start (the FUSE mount
        is gone or past its grace, background tasks are cancelled), so the wait is bounded by one
        fetch with its retries. Background fetches still queued (trace prefetch, fill) are
        dropped: no reader waits for them."""
        self.pool.drop_queued((PREFETCH, FILL))
        loads = [t for t in self.pending.values() if not t.done()]
        if not loads:
            return
        bound = self.cfg.fetch_timeout_s * (self.cfg.fetch_retries + 1) + self.pool.backoff_s * (2 ** self.cfg.fetch_retries)
        logs.kv(log, logging.INFO, "finishing chunk loads before exit", chunks=len(loads), bound_s=round(bound, 1))
        _, left = await asyncio.wait(loads, timeout=bound)
        if left:
            logs.kv(log, logging.WARNING, "chunk loads unfinished at exit; fetched again when read", chunks=len(left))

    def counters(self) -> dict[str, int]:
        with self.count_lock:
            c = dict(self.st)
        return {k: int(c.get(k, 0)) for k in COUNTERS}
