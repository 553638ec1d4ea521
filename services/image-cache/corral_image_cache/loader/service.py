"""The node-local lazy loader: one process per node, shared by every sandbox on it.

It presents each prepared layer as `<mount>/<digest>` on a FUSE mount; the node-agent mounts that
file as EROFS. Reads of chunks not yet on the node fetch them from the chunk store (verified
against the manifest's sha256) into the node cache. The asyncio loop (main thread) owns NATS,
the fetch pool and the bus handlers; libfuse's threads serve reads and wait on the loop through
`asyncio.run_coroutine_threadsafe(...).result(timeout)` only for chunks not cached yet.

Bus (request/reply, `corral.node.<node>.loader.<op>`): prepare, release, stats, evict; see
`corral_common.contract.images.LoaderPrepare` and friends."""
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
import msgspec
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
from corral_common.contract.errors import Conflict, CorralError, Internal, InvalidRequest, NotFound
from corral_common.contract.images import LayerManifest, LoaderEvict, LoaderPrepare, LoaderRelease, Trace, TraceRead
from corral_common.contract.messages import encoder, ok
from corral_common.layers import DIGEST, Catalog, backend_from_url, check_image_name

from . import mounts
from .cache import Layer, check_manifest, scan
from .fetcher import DEMAND, FILL, PREFETCH, PRIO_NAMES, ChunkError, FetchPool, verify
from .fusefs import LayerFS

log = logging.getLogger("corral.loader")

BYTES_FETCHED = metrics.counter("corral_loader_bytes_fetched_total", "Chunk bytes fetched from the chunk store", ("node", "priority"))
CHUNKS_FETCHED = metrics.counter("corral_loader_chunks_fetched_total", "Chunks fetched from the chunk store", ("node", "priority"))
CHUNK_HITS = metrics.counter("corral_loader_chunk_hits_total", "Chunk reads served from the node cache", ("node",))
CHUNK_MISSES = metrics.counter("corral_loader_chunk_misses_total",
                               "Chunk reads that had to wait: fetch (started a fetch) or inflight (joined one)", ("node", "wait"))
FETCH_SECONDS = metrics.histogram("corral_loader_fetch_seconds", "Time to fetch and verify one chunk (with retries)",
                                  ("node", "priority"),
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
FETCH_ERRORS = metrics.counter("corral_loader_fetch_errors_total", "Chunks that could not be fetched or verified", ("node", "reason"))
CACHE_BYTES = metrics.gauge("corral_loader_cache_bytes", "Bytes of chunks in the node cache", ("node",))
CACHE_MAX_BYTES = metrics.gauge("corral_loader_cache_max_bytes", "Node cache size cap (0: none)", ("node",))
PREFETCH_CHUNKS = metrics.counter("corral_loader_prefetch_chunks_total", "Chunks queued by trace replay or background fill", ("node", "kind"))
EVICTIONS = metrics.counter("corral_loader_evictions_total", "Layers evicted from the node cache", ("node",))
LAYERS_IN_USE = metrics.gauge("corral_loader_layers_in_use", "Layers prepared and not released", ("node",))
READ_ERRORS = metrics.counter("corral_loader_read_errors_total", "FUSE reads answered with EIO", ("node",))


class LoaderConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    node: str
    mount: str
    cache_dir: str
    cache_max_mb: int = 0  # 0: no cap
    fetch_parallel: int = 8
    chunk_backend: str = "nats"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    trace_window_s: float = 10.0
    fetch_timeout_s: float = 10.0
    fetch_retries: int = 2
    read_timeout_s: float = 60.0
    background_fill_after_s: float = 0.0  # 0: off
    shutdown_grace_s: float = 5.0
    auto_unmount: bool = True
    entry_timeout_s: float = 1.0
    attr_timeout_s: float = 3600.0
    fuse_threads: int = 64  # libfuse worker threads (libfuse's default: 10) and kernel max_background
    readahead_chunks: int = 2  # chunks fetched ahead of a reader crossing into the next chunk (0: off)


class _Empty(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Recording:
    """First-access chunk order of an image's first start, for `trace_window_s`."""

    def __init__(self, image: str, layers: set[str], deadline: float):
        self.image = image
        self.layers = layers
        self.deadline = deadline
        self.seen: set[tuple[str, int]] = set()
        self.reads: list[TraceRead] = []


class Loader:
    def __init__(self, cfg: LoaderConfig):
        self.cfg = cfg
        self.node = cfg.node
        self.mount = os.path.realpath(cfg.mount)
        self.root = os.path.join(os.path.realpath(cfg.cache_dir), "layers")
        self.cap = cfg.cache_max_mb * 1024 * 1024
        self.layers: dict[str, Layer] = {}
        self.pending: dict[tuple[str, int], asyncio.Task] = {}
        self.pending_prio: dict[tuple[str, int], int] = {}
        self.by_hash: dict[str, tuple[Layer, int]] = {}
        self.recordings: dict[str, Recording] = {}
        self.rec_by_layer: dict[str, list[Recording]] = {}
        self.rec_lock = threading.Lock()
        self.count_lock = threading.Lock()
        self.st = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self.tasks: set[asyncio.Task] = set()
        self.audit_tasks: set[asyncio.Task] = set()
        self.audit_last: dict[tuple[str, int], float] = {}
        self.last_demand = time.monotonic()
        self.over_cap_warned = False
        self.evicting = False
        self.fuse_thread: threading.Thread | None = None
        self.fuse_error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fuse_done: asyncio.Event | None = None
        self.closing = False
        self.m_hits = CHUNK_HITS.labels(cfg.node)

    # ================================================================ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.fuse_done = asyncio.Event()
        CACHE_MAX_BYTES.labels(self.node).set(self.cap)
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        for layer in await asyncio.to_thread(scan, self.root):
            self.layers[layer.digest] = layer
            for i in range(layer.n):
                if layer.bitmap[i]:
                    self.by_hash.setdefault(layer.m.chunks[i], (layer, i))
        self._cache_changed()
        self.nc = await bus.connect(self.cfg.nats_url, name=f"corral-loader-{self.node}")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.catalog = await Catalog(self.js).open()
        self.backend = backend_from_url(self.cfg.chunk_backend, self.js)
        self.pool = FetchPool(self.backend, self.cfg.fetch_parallel, self.cfg.fetch_timeout_s, self.cfg.fetch_retries,
                              observe=self._observe_fetch)
        self.pool.start()
        await self._mount()
        self.responder = bus.Responder(self.nc, "loader", package="corral_image_cache", metadata={"node": self.node})
        for op, handler in (("prepare", self._on_prepare), ("release", self._on_release), ("stats", self._on_stats),
                            ("evict", self._on_evict)):
            await self.responder.serve(subjects.node_loader(self.node, op), handler, f"loader.{op}")
        if self.cfg.background_fill_after_s > 0:
            self._spawn(self._fill_loop())
        metrics.UP.labels("loader").set(1)
        logs.kv(log, logging.INFO, "loader ready", node=self.node, mount=self.mount, cache=self.root,
                cached_layers=len(self.layers), cache_bytes=self.cache_bytes(), metrics=self.metrics_url)
        stop_wait = asyncio.create_task(stop.wait())
        fuse_wait = asyncio.create_task(self.fuse_done.wait())
        await asyncio.wait([stop_wait, fuse_wait], return_when=asyncio.FIRST_COMPLETED)
        if fuse_wait.done() and not stop_wait.done():
            logs.kv(log, logging.ERROR, "the FUSE mount went away; stopping", error=str(self.fuse_error or ""))
        stop_wait.cancel()
        fuse_wait.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        self.closing = True
        metrics.UP.labels("loader").set(0)
        await self.responder.drain(timeout=5)
        for rec in list(self.recordings.values()):
            await self._finish_recording(rec)
        await self._unmount()
        if self.audit_tasks:  # error events already raised should still reach the stream
            await asyncio.wait(list(self.audit_tasks), timeout=3)
        for t in list(self.tasks):
            t.cancel()
        await self._finish_loads()
        await self.pool.stop()
        try:
            await self.nc.drain()
        except Exception:  # shutting down: a connection already closed has nothing to drain
            pass
        for layer in self.layers.values():
            layer.close()
        logs.kv(log, logging.INFO, "loader stopped", node=self.node, cache_bytes=self.cache_bytes(),
                cached_chunks={d: x.present for d, x in sorted(self.layers.items()) if x.present}, **self._counters())

    async def _finish_loads(self) -> None:
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

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    # ---------------------------------------------------------------- FUSE mount

    async def _mount(self) -> None:
        os.makedirs(self.mount, exist_ok=True)
        if mounts.is_mounted(self.mount):
            # left behind by a loader that was killed: its connection is dead
            logs.kv(log, logging.WARNING, "stale mount at the mount point; detaching it", mount=self.mount,
                    users=mounts.users(self.mount))
            try:
                mounts.umount(self.mount, detach=True)
            except OSError as e:
                raise Internal(f"cannot clear the stale mount at {self.mount}: {e}") from None
        self.fs = LayerFS(self)
        opts = dict(foreground=True, ro=True, default_permissions=True, fsname=f"corral-loader-{self.node}",
                    subtype="corral", kernel_cache=True, entry_timeout=self.cfg.entry_timeout_s,
                    attr_timeout=self.cfg.attr_timeout_s, negative_timeout=0.0, max_threads=self.cfg.fuse_threads,
                    max_idle_threads=min(16, self.cfg.fuse_threads))
        if self.cfg.auto_unmount:
            opts["auto_unmount"] = True  # fusermount3 unmounts (lazily) if this process dies

        def main() -> None:
            try:
                fuse.FUSE(self.fs, self.mount, **opts)
            except BaseException as e:  # noqa: BLE001 - reported to the loop
                self.fuse_error = e
            finally:
                if self.loop and not self.loop.is_closed():
                    self.loop.call_soon_threadsafe(self.fuse_done.set)

        self.fuse_thread = threading.Thread(target=main, name="fuse", daemon=True)
        self.fuse_thread.start()
        deadline = time.monotonic() + 15
        while not mounts.is_mounted(self.mount):
            if self.fuse_done.is_set() or time.monotonic() > deadline:
                raise Internal(f"FUSE mount at {self.mount} failed: {self.fuse_error or 'timed out'}")
            await asyncio.sleep(0.02)

    def fuse_destroyed(self) -> None:
        pass

    async def _unmount(self) -> None:
        if self.fuse_thread is None or not self.fuse_thread.is_alive():
            return
        users = await asyncio.to_thread(mounts.users, self.mount)
        detach = bool(users)
        if not detach:
            try:
                await asyncio.to_thread(mounts.umount, self.mount)
            except OSError as e:
                if e.errno == errno.EBUSY:
                    detach = True
                elif e.errno not in (errno.EINVAL, errno.ENOENT):
                    logs.kv(log, logging.WARNING, "unmount failed", mount=self.mount, error=str(e))
        if detach:
            logs.kv(log, logging.WARNING, "the FUSE mount is still in use; detaching it lazily (those mounts fail once the loader exits)",
                    mount=self.mount, users=users, grace_s=self.cfg.shutdown_grace_s)
            try:
                await asyncio.to_thread(mounts.umount, self.mount, True)
            except OSError as e:
                logs.kv(log, logging.WARNING, "lazy unmount failed", mount=self.mount, error=str(e))
        # the FUSE loop ends when the kernel closes the connection (at once, or after a lazy
        # unmount when the last user goes); keep serving reads until then or the grace ends
        try:
            await asyncio.wait_for(self.fuse_done.wait(), self.cfg.shutdown_grace_s if detach else 10)
        except (TimeoutError, asyncio.TimeoutError):
            logs.kv(log, logging.WARNING, "FUSE loop still running at exit", mount=self.mount)
        else:
            logs.kv(log, logging.INFO, "FUSE mount removed", mount=self.mount, lazy=detach)

    # ================================================================ reads (FUSE threads)

    def read_range(self, layer: Layer, offset: int, size: int) -> bytes:
        if offset >= layer.size or size <= 0:
            return b""
        end = min(layer.size, offset + size)
        first, last = offset // layer.cs, (end - 1) // layer.cs
        layer.last_used = time.time()
        if self.rec_by_layer:
            self._record(layer, first, last)
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

    def _record(self, layer: Layer, first: int, last: int) -> None:
        with self.rec_lock:
            recs = self.rec_by_layer.get(layer.digest)
            if not recs:
                return
            now = time.monotonic()
            for rec in recs:
                if now > rec.deadline:
                    continue
                for i in range(first, last + 1):
                    k = (layer.digest, i)
                    if k not in rec.seen:
                        rec.seen.add(k)
                        rec.reads.append(TraceRead(layer.digest, i))

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
                self._spawn(self.pool.promote(layer.m.chunks[i], prio))
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
        self._cache_changed()

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

    def _observe_fetch(self, prio: int, seconds: float, nbytes: int, success: bool) -> None:
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
        t = self._spawn(self._publish_audit(ev))
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

    def _cache_changed(self) -> None:
        size = self.cache_bytes()
        CACHE_BYTES.labels(self.node).set(size)
        if self.cap and size > self.cap and not self.evicting and self.loop is not None:
            self.evicting = True
            self._spawn(self._evict_to_cap())

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
                await self._evict(min(cands, key=lambda layer: layer.last_used), "cap")
            self.over_cap_warned = False
        finally:
            self.evicting = False

    def _evictable(self, layer: Layer) -> bool:
        return layer.refs == 0 and layer.pending == 0 and layer.cached_bytes > 0

    async def _evict(self, layer: Layer, why: str) -> None:
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

    # ================================================================ bus handlers

    async def _manifest(self, digest: str) -> LayerManifest:
        try:
            m = await self.catalog.layer(digest)
        except CorralError:
            raise
        except Exception as e:  # NATS trouble: a layer cached here can still be served
            known = self.layers.get(digest)
            if known is None:
                raise
            logs.kv(log, logging.WARNING, "catalog unreachable; using the cached manifest", layer=digest, error=str(e))
            return known.m
        try:
            check_manifest(m, digest)
        except (ValueError, CorralError) as e:
            raise Internal(f"manifest of layer {digest} is inconsistent: {getattr(e, 'message', e)}") from None
        return m

    async def _on_prepare(self, msg: Msg) -> bytes:
        req = bus.decode(msg.data, LoaderPrepare)
        if not req.layers:
            raise InvalidRequest("layers must list at least one layer digest")
        if len(req.layers) > 512:
            raise InvalidRequest(f"too many layers ({len(req.layers)}); at most 512")
        for d in req.layers:
            if not DIGEST.match(d):
                raise InvalidRequest(f"invalid layer digest {d!r}: want sha256-<64 hex digits>")
        if req.image:
            check_image_name(req.image)
        uniq = list(dict.fromkeys(req.layers))
        found = await asyncio.gather(*(self._manifest(d) for d in uniq), return_exceptions=True)
        for d, r in zip(uniq, found):
            if isinstance(r, BaseException):
                raise r
        # no await from here on (but dropping replaced layers' files): the prepare applies at once
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
        for d in req.layers:
            layer = self.layers[d]
            layer.refs += 1
            layer.visible = True
            layer.last_used = now
        LAYERS_IN_USE.labels(self.node).set(sum(1 for x in self.layers.values() if x.refs))
        prefetch, recording = 0, False
        if req.image:
            prefetch, recording = await self._trace_start(req.image, uniq)
        logs.kv(log, logging.DEBUG, "prepared", image=req.image, layers=uniq, prefetch_chunks=prefetch, recording=recording)
        return ok(paths={d: os.path.join(self.mount, d) for d in uniq}, prefetch_chunks=prefetch, recording=recording)

    async def _on_release(self, msg: Msg) -> bytes:
        req = bus.decode(msg.data, LoaderRelease)
        for d in req.layers:
            if not DIGEST.match(d):
                raise InvalidRequest(f"invalid layer digest {d!r}: want sha256-<64 hex digits>")
        released, not_prepared = [], []
        now = time.time()
        for d in req.layers:
            layer = self.layers.get(d)
            if layer is None or layer.refs <= 0:
                not_prepared.append(d)
                continue
            layer.refs -= 1
            layer.last_used = now
            released.append(d)
        LAYERS_IN_USE.labels(self.node).set(sum(1 for x in self.layers.values() if x.refs))
        self._cache_changed()
        return ok(released=released, not_prepared=not_prepared)

    async def _on_evict(self, msg: Msg) -> bytes:
        req = bus.decode(msg.data, LoaderEvict)
        if req.layer is not None:
            if not DIGEST.match(req.layer):
                raise InvalidRequest(f"invalid layer digest {req.layer!r}: want sha256-<64 hex digits>")
            layer = self.layers.get(req.layer)
            if layer is None:
                raise NotFound(f"layer {req.layer} is not on node {self.node}")
            if layer.refs > 0:
                raise Conflict(f"layer {req.layer} is in use ({layer.refs} prepares not released)")
            targets = [layer]
        else:
            targets = [layer for layer in self.layers.values() if layer.refs == 0]
        evicted = []
        for layer in sorted(targets, key=lambda x: x.last_used):
            if layer.refs == 0 and layer.pending == 0 and (layer.cached_bytes > 0 or layer.visible):
                await self._evict(layer, "request")
                evicted.append(layer.digest)
        return ok(evicted=evicted, cache_bytes=self.cache_bytes())

    async def _on_stats(self, msg: Msg) -> bytes:
        bus.decode(msg.data, _Empty)
        return ok(**self.stats())

    def _counters(self) -> dict[str, int]:
        with self.count_lock:
            c = dict(self.st)
        keys = ("bytes_fetched", "fetches", "fetches_demand", "fetches_prefetch", "fetches_fill", "fetch_errors",
                "chunk_hits", "chunk_misses", "chunk_joins", "prefetched_chunks", "readahead_chunks", "filled_chunks", "local_copies",
                "evictions", "read_errors")
        return {k: int(c.get(k, 0)) for k in keys}

    def stats(self) -> dict:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else 0.0

        return {
            "node": self.node,
            "mount": self.mount,
            **self._counters(),
            "cache_bytes": self.cache_bytes(),
            "cache_max_bytes": self.cap,
            "fetch_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0), "n": len(lat)},
            "queued": self.pool.queued(),
            "inflight": len(self.pool.inflight),
            "pending": len(self.pending),  # chunk loads not finished (fetching, verifying or writing)
            "recording": sorted(self.recordings),
            "layers": {
                d: {"size": x.size, "chunk_size": x.cs, "chunks": x.n, "cached_chunks": x.present,
                    "cached_bytes": x.cached_bytes, "fetched_chunks": x.fetched, "refs": x.refs,
                    "visible": x.visible, "last_used": round(x.last_used, 3)}
                for d, x in sorted(self.layers.items())
            },
        }

    # ================================================================ traces: record and replay

    async def _trace_start(self, image: str, layers: list[str]) -> tuple[int, bool]:
        try:
            trace = await self.catalog.trace(image)
        except Exception:
            trace = None
        wanted = set(layers)
        if trace is not None and any(r.layer in wanted for r in trace.reads):
            return self._replay(image, trace, wanted), False
        if image in self.recordings:
            return 0, True
        rec = Recording(image, wanted, time.monotonic() + self.cfg.trace_window_s)
        with self.rec_lock:
            self.recordings[image] = rec
            for d in wanted:
                self.rec_by_layer.setdefault(d, []).append(rec)
        self._spawn(self._record_window(rec))
        return 0, True

    async def _record_window(self, rec: Recording) -> None:
        await asyncio.sleep(max(0.0, rec.deadline - time.monotonic()))
        await self._finish_recording(rec)

    async def _finish_recording(self, rec: Recording) -> None:
        with self.rec_lock:
            if self.recordings.get(rec.image) is not rec:
                return
            del self.recordings[rec.image]
            for d in rec.layers:
                lst = self.rec_by_layer.get(d, [])
                if rec in lst:
                    lst.remove(rec)
                if not lst:
                    self.rec_by_layer.pop(d, None)
            reads = list(rec.reads)
        if not reads:
            logs.kv(log, logging.INFO, "no reads during the trace window; nothing recorded", image=rec.image)
            return
        trace = Trace(image=rec.image, reads=reads, recorded_at=time.time(), node=self.node)
        size = len(msgspec.json.encode(trace))
        limit = max(64 * 1024, (getattr(self.nc, "max_payload", 0) or 1 << 20) - 8192)
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

    def _replay(self, image: str, trace: Trace, wanted: set[str]) -> int:
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

        self._spawn(wait())
        return len(waits)

    # ================================================================ background fill

    async def _fill_loop(self) -> None:
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
