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
import logging
import os

from nats.aio.msg import Msg

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.errors import CorralError, Internal, InvalidRequest
from corral_common.contract.images import (
    EvictReply,
    FetchLatency,
    LayerManifest,
    LoaderEvict,
    LoaderLayerStats,
    LoaderPrepare,
    LoaderRelease,
    LoaderStats,
    PrepareReply,
    ReleaseReply,
)
from corral_common.contract.messages import Empty
from corral_common.layers import DIGEST, Catalog, backend_from_url, check_image_name

from .cache import check_manifest
from .config import LoaderConfig
from .fetcher import FetchPool
from .fusefs import LayerFS
from .fusemount import FuseMount
from .meters import CACHE_MAX_BYTES
from .node_cache import NodeCache
from .traces import Traces

log = logging.getLogger("corral.loader")

__all__ = ["Loader", "LoaderConfig"]


class Loader:
    """Wires the node cache, the start traces and the FUSE mount to the bus, and owns their life."""

    def __init__(self, cfg: LoaderConfig):
        self.cfg = cfg
        self.node = cfg.node
        self.mount = os.path.realpath(cfg.mount)
        self.tasks: set[asyncio.Task] = set()
        self.cache = NodeCache(cfg, os.path.join(os.path.realpath(cfg.cache_dir), "layers"), self.mount, self._spawn)
        self.fuse = FuseMount(cfg, self.mount)

    # ================================================================ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        cache = self.cache
        CACHE_MAX_BYTES.labels(self.node).set(cache.cap)
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        await cache.load()
        self.nc = await bus.connect(self.cfg.nats_url, name=f"corral-loader-{self.node}")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.catalog = await Catalog(self.js).open()
        self.traces = Traces(self.catalog, self.node, self.cfg.trace_window_s, lambda: getattr(self.nc, "max_payload", 0),
                             cache.replay, self._spawn)
        self.backend = backend_from_url(self.cfg.chunk_backend, self.js)
        self.pool = FetchPool(self.backend, self.cfg.fetch_parallel, self.cfg.fetch_timeout_s, self.cfg.fetch_retries,
                              observe=cache.observe_fetch)
        cache.pool, cache.js, cache.traces = self.pool, self.js, self.traces
        self.pool.start()
        await self.fuse.start(LayerFS(cache))
        self.responder = bus.Responder(self.nc, "loader", package="corral_image_cache", metadata={"node": self.node})
        for op, handler in (("prepare", self._on_prepare), ("release", self._on_release), ("stats", self._on_stats),
                            ("evict", self._on_evict)):
            await self.responder.serve(subjects.node_loader(self.node, op), handler, f"loader.{op}")
        if self.cfg.background_fill_after_s > 0:
            self._spawn(cache.fill_loop())
        metrics.UP.labels("loader").set(1)
        await bus.ready(self.nc, log, "loader ready", node=self.node, mount=self.mount, cache=cache.root,
                cached_layers=len(cache.layers), cache_bytes=cache.cache_bytes(), metrics=self.metrics_url)
        stop_wait = asyncio.create_task(stop.wait())
        fuse_wait = asyncio.create_task(self.fuse.done.wait())
        await asyncio.wait([stop_wait, fuse_wait], return_when=asyncio.FIRST_COMPLETED)
        if fuse_wait.done() and not stop_wait.done():
            logs.kv(log, logging.ERROR, "the FUSE mount went away; stopping", error=str(self.fuse.error or ""))
        stop_wait.cancel()
        fuse_wait.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        cache = self.cache
        cache.closing = True
        metrics.UP.labels("loader").set(0)
        await self.responder.drain(timeout=5)
        await self.traces.finish_all()
        await self.fuse.stop()
        if cache.audit_tasks:  # error events already raised should still reach the stream
            await asyncio.wait(list(cache.audit_tasks), timeout=3)
        for t in list(self.tasks):
            t.cancel()
        await cache.finish_loads()
        await self.pool.stop()
        try:
            await self.nc.drain()
        except Exception:  # shutting down: a connection already closed has nothing to drain
            pass
        cache.close()
        logs.kv(log, logging.INFO, "loader stopped", node=self.node, cache_bytes=cache.cache_bytes(),
                cached_chunks={d: x.present for d, x in sorted(cache.layers.items()) if x.present}, **cache.counters())

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    # ================================================================ bus handlers

    async def _manifest(self, digest: str) -> LayerManifest:
        try:
            m = await self.catalog.layer(digest)
        except CorralError:
            raise
        except Exception as e:  # NATS trouble: a layer cached here can still be served
            known = self.cache.layers.get(digest)
            if known is None:
                raise
            logs.kv(log, logging.WARNING, "catalog unreachable; using the cached manifest", layer=digest, error=str(e))
            return known.m
        try:
            check_manifest(m, digest)
        except (ValueError, CorralError) as e:
            raise Internal(f"manifest of layer {digest} is inconsistent: {getattr(e, 'message', e)}") from None
        return m

    async def _on_prepare(self, msg: Msg) -> PrepareReply:
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
        await self.cache.use(found, req.layers)
        prefetch, recording = 0, False
        if req.image:
            prefetch, recording = await self.traces.start(req.image, uniq)
        logs.kv(log, logging.DEBUG, "prepared", image=req.image, layers=uniq, prefetch_chunks=prefetch, recording=recording)
        return PrepareReply(paths={d: os.path.join(self.mount, d) for d in uniq}, prefetch_chunks=prefetch, recording=recording)

    async def _on_release(self, msg: Msg) -> ReleaseReply:
        req = bus.decode(msg.data, LoaderRelease)
        for d in req.layers:
            if not DIGEST.match(d):
                raise InvalidRequest(f"invalid layer digest {d!r}: want sha256-<64 hex digits>")
        released, not_prepared = self.cache.release(req.layers)
        return ReleaseReply(released=released, not_prepared=not_prepared)

    async def _on_evict(self, msg: Msg) -> EvictReply:
        req = bus.decode(msg.data, LoaderEvict)
        if req.layer is not None and not DIGEST.match(req.layer):
            raise InvalidRequest(f"invalid layer digest {req.layer!r}: want sha256-<64 hex digits>")
        evicted = await self.cache.evict_unused(req.layer)
        return EvictReply(evicted=evicted, cache_bytes=self.cache.cache_bytes())

    async def _on_stats(self, msg: Msg) -> LoaderStats:
        bus.decode(msg.data, Empty)
        return self.stats()

    def stats(self) -> LoaderStats:
        cache = self.cache
        lat = sorted(cache.latencies)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else 0.0

        return LoaderStats(
            node=self.node,
            mount=self.mount,
            **cache.counters(),
            cache_bytes=cache.cache_bytes(),
            cache_max_bytes=cache.cap,
            fetch_ms=FetchLatency(p50=pct(0.5), p90=pct(0.9), p99=pct(0.99), max=pct(1.0), n=len(lat)),
            queued=self.pool.queued(),
            inflight=len(self.pool.inflight),
            pending=len(cache.pending),
            recording=sorted(self.traces.recordings),
            layers={d: LoaderLayerStats(size=x.size, chunk_size=x.cs, chunks=x.n, cached_chunks=x.present,
                                        cached_bytes=x.cached_bytes, fetched_chunks=x.fetched, refs=x.refs,
                                        visible=x.visible, last_used=round(x.last_used, 3))
                    for d, x in sorted(cache.layers.items())},
        )
