"""The image-cache registry service: imports images as EROFS layers cut into content-addressed
chunks, keeps manifests in NATS KV, serves `corral.v1.image.import|list|inspect|delete`, and
makes the built-in images (busybox, and debian once built) ordinary layered images."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import time

import msgspec
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics, tenancy
from corral_common.contract import subjects
from corral_common.contract.errors import InvalidRequest, NotFound
from corral_common.contract.images import (
    MEDIA_EROFS,
    MEDIA_GUEST_MEMORY,
    GuestMemory,
    ImageDeleteReply,
    ImageListReply,
    ImageManifest,
    ImportReply,
    ImportRequest,
    InspectReply,
    LayerManifest,
    LayerSummary,
    NameRequest,
)
from corral_common.contract.messages import Empty
from corral_common.layers import Catalog, ChunkBackend, backend_from_url, build_layer, check_chunk_size, check_image_name, chunk_layer_file

from . import builtin, importers

log = logging.getLogger("corral.image")

IMPORTS = metrics.counter("corral_image_imports_total", "Images imported", ("source",))
UPLOADED = metrics.counter("corral_image_uploaded_bytes_total", "Chunk bytes uploaded (after dedup)")
IMAGES = metrics.gauge("corral_images", "Images in the catalog")



class ImageCacheConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    image_dir: str
    chunk_backend: str = "nats"
    builtins: list[str] = msgspec.field(default_factory=lambda: ["busybox", "debian"])
    work_dir: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    snapshot_grace_s: float = 120.0
    gc_every_s: float = 60.0


class ImageCache:
    def __init__(self, cfg: ImageCacheConfig):
        self.cfg = cfg
        self.builtins = builtin.ImageStore(cfg.image_dir)
        self.lock = asyncio.Lock()  # imports and deletes change shared manifests: one at a time

    async def run(self, stop: asyncio.Event) -> None:
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.nc = await bus.connect(self.cfg.nats_url, name="corral-image-cache")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.catalog = await Catalog(self.js).open()
        self.backend: ChunkBackend = backend_from_url(self.cfg.chunk_backend, self.js)
        for name in self.cfg.builtins:
            await self._ensure_builtin(name, build=(name == "busybox"))
        self.responder = bus.Responder(self.nc, "image-cache", package="corral_image_cache")
        q = "corral-image-cache"
        # importing reads paths of this host, deleting affects everyone: the operator's
        await self.responder.serve(subjects.IMAGE_IMPORT, tenancy.for_operator(self._on_import, "importing images"), "import", queue=q)
        await self.responder.serve(subjects.IMAGE_LIST, self._on_list, "list", queue=q)
        await self.responder.serve(subjects.IMAGE_INSPECT, self._on_inspect, "inspect", queue=q)
        await self.responder.serve(subjects.IMAGE_DELETE, tenancy.for_operator(self._on_delete, "deleting images"), "delete", queue=q)
        metrics.UP.labels("image-cache").set(1)
        IMAGES.set(len(await self.catalog.image_names()))
        await bus.ready(self.nc, log, "image-cache ready", metrics=self.metrics_url, images=await self.catalog.image_names())
        gc = asyncio.create_task(self._gc_loop(stop))
        await stop.wait()
        gc.cancel()
        await self.responder.drain(timeout=30)
        await self.nc.drain()

    # ------------------------------------------------------------------ built-ins

    async def _ensure_builtin(self, name: str, build: bool) -> ImageManifest | None:
        """Import a built-in image's rootfs as a one-layer image unless the catalog has it.

        The EROFS file is kept beside the rootfs, so a fresh NATS only re-chunks it."""
        try:
            return await self.catalog.image(name)
        except NotFound:
            pass
        if build:
            await asyncio.to_thread(self.builtins.ensure, name)
        elif name not in self.builtins.list():
            return None
        rootfs = self.builtins.path(name)
        erofs = os.path.join(os.path.dirname(rootfs), "layer.erofs")
        t0 = time.perf_counter()
        if not (os.path.exists(erofs) and os.path.getmtime(erofs) >= os.path.getmtime(os.path.join(os.path.dirname(rootfs), "image.json"))):
            tmp = f"{erofs}.{os.getpid()}.tmp"
            from corral_common.layers import mkfs_erofs

            await asyncio.to_thread(mkfs_erofs, rootfs, tmp)
            os.replace(tmp, erofs)
        layer, uploaded = await chunk_layer_file(erofs, self.backend, source=f"builtin:{name}")
        await self.catalog.put_layer(layer)
        m = ImageManifest(name=name, layers=[layer.digest], created_at=time.time(), size=layer.size, labels={"builtin": "1"})
        await self.catalog.put_image(m)
        UPLOADED.inc(uploaded)
        IMPORTS.labels("builtin").inc()
        logs.kv(log, logging.INFO, "built-in image imported", image=name, size=layer.size, chunks=len(layer.chunks),
                uploaded=uploaded, seconds=round(time.perf_counter() - t0, 2))
        return m

    # ------------------------------------------------------------------ handlers

    async def _on_import(self, msg: Msg) -> ImportReply:
        req = bus.decode(msg.data, ImportRequest)
        check_image_name(req.name)
        check_chunk_size(req.chunk_size)
        async with self.lock:
            image, new_layers, uploaded = await self.import_image(req)
        IMAGES.set(len(await self.catalog.image_names()))
        return ImportReply(image=image, layers=[self._summary(m) for m in new_layers], uploaded_bytes=uploaded)

    async def import_image(self, req: ImportRequest) -> tuple[ImageManifest, list[LayerManifest], int]:
        base_layers: list[str] = []
        if req.base:
            base_layers = list((await self.catalog.image(req.base)).layers)
        new: list[LayerManifest] = []
        uploaded = 0
        src = req.source
        if src == "builtin":
            if req.name not in builtin.BUILDERS:
                raise InvalidRequest(f"no built-in image {req.name!r}; built-ins: {', '.join(builtin.BUILDERS)}")
            try:
                await self.catalog.delete_image(req.name)
            except NotFound:
                pass
            m = await self._ensure_builtin(req.name, build=True)
            assert m is not None
            return m, [await self.catalog.layer(d) for d in m.layers], 0
        memory: GuestMemory | None = None
        if src == "snapshot":  # a node-agent built the layer and uploaded its chunks: register it
            top = _snapshot_layer(req)
            for d in req.layers:
                await self.catalog.layer(d)
            new.append(top)
            layers = base_layers + list(req.layers)
            if req.memory is None:
                layers.append(top.digest)
            else:  # a guest's memory: named by the image's `memory`, not a layer of its files
                memory = req.memory
        elif src == "layers":
            if not req.layers:
                raise InvalidRequest("source 'layers' needs a non-empty `layers` list of digests")
            for d in req.layers:
                await self.catalog.layer(d)
            layers = base_layers + list(req.layers)
        elif src in ("dir", "upper"):
            if not req.path or not os.path.isdir(req.path):
                raise InvalidRequest(f"source {src!r} needs `path`, an existing directory on the image-cache host; got {req.path!r}")
            m, up = await build_layer(req.path, self.backend, req.chunk_size, source=f"{src}:{req.path}", work_dir=self.cfg.work_dir)
            new.append(m)
            uploaded += up
            layers = base_layers + [m.digest]
        elif src in ("tar", "docker_archive"):
            if not req.path or not os.path.isfile(req.path):
                raise InvalidRequest(f"source {src!r} needs `path`, an existing file on the image-cache host; got {req.path!r}")
            layers = list(base_layers)
            if src == "tar":
                parts = [(f"tar:{req.path}", lambda d: importers.extract_tarball(req.path, d))]
            else:
                bufs = await asyncio.to_thread(lambda: list(_materialise(req.path)))
                parts = [(f"docker:{name}", lambda d, b=buf: _extract_dir(b, d)) for name, buf in bufs]
            for source, unpack in parts:
                m, up = await self._layer_from(unpack, req, source)
                new.append(m)
                uploaded += up
                layers.append(m.digest)
        else:  # unreachable: msgspec validated the Literal
            raise InvalidRequest(f"unknown source {src!r}")
        for m in new:
            await self.catalog.put_layer(m)
        sizes = {m.digest: m.size for m in new}
        for d in layers:
            if d not in sizes:
                sizes[d] = (await self.catalog.layer(d)).size
        size = sum(sizes[d] for d in layers) + (sizes[memory.layer] if memory else 0)
        image = ImageManifest(name=req.name, layers=layers, created_at=time.time(), size=size,
                              labels=req.labels, parent=req.parent or req.base, memory=memory)
        await self.catalog.put_image(image)
        UPLOADED.inc(uploaded)
        IMPORTS.labels(src).inc()
        logs.kv(log, logging.INFO, "image imported", image=req.name, source=src, layers=len(layers), uploaded=uploaded)
        return image, new, uploaded

    async def _layer_from(self, unpack, req: ImportRequest, source: str) -> tuple[LayerManifest, int]:
        d = tempfile.mkdtemp(prefix="corral-unpack-", dir=self.cfg.work_dir)
        try:
            await asyncio.to_thread(unpack, d)
            return await build_layer(d, self.backend, req.chunk_size, source=source, work_dir=self.cfg.work_dir)
        finally:
            await asyncio.to_thread(shutil.rmtree, d, True)

    async def _on_list(self, msg: Msg) -> ImageListReply:
        bus.decode(msg.data, Empty)
        images = [await self.catalog.image(n) for n in await self.catalog.image_names()]
        return ImageListReply(images=images)

    async def _on_inspect(self, msg: Msg) -> InspectReply:
        req = bus.decode(msg.data, NameRequest)
        image = await self.catalog.image(req.name)
        layers = [self._summary(await self.catalog.layer(d)) for d in image.layers]
        trace = await self.catalog.trace(req.name)
        return InspectReply(image=image, layers=layers, trace_chunks=len(trace.reads) if trace else 0)

    async def _on_delete(self, msg: Msg) -> ImageDeleteReply:
        req = bus.decode(msg.data, NameRequest)
        async with self.lock:
            await self.catalog.delete_image(req.name)
            freed_layers, freed_chunks = await self._gc()
        IMAGES.set(len(await self.catalog.image_names()))
        return ImageDeleteReply(name=req.name, freed_layers=freed_layers, freed_chunks=freed_chunks)

    async def _gc_loop(self, stop: asyncio.Event) -> None:
        """Frees what deletes left for later (young snapshot layers)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.gc_every_s)
                return
            except TimeoutError:
                pass
            try:
                async with self.lock:
                    layers, chunks = await self._gc()
                if layers:
                    logs.kv(log, logging.INFO, "garbage collected", layers=layers, chunks=chunks)
            except Exception:
                log.exception("periodic garbage collection failed")

    async def _gc(self) -> tuple[int, int]:
        """Drop layers no image uses, and the chunks no remaining layer uses.

        A snapshot's chunks are uploaded by its node-agent outside this service's lock
        (deduplicated against what the store holds), and only then registered here (import,
        source "snapshot"). A layer that is unused but young may be the very content a snapshot
        in flight is about to name again (its chunks deduplicated against this layer's), so it is
        kept for `snapshot_grace_s`; the periodic collection frees it later."""
        now = time.time()
        used_layers: set[str] = set()
        for n in await self.catalog.image_names():
            image = await self.catalog.image(n)
            used_layers.update(image.layers)
            if image.memory is not None:
                used_layers.add(image.memory.layer)
        # every layer, or no collection: a layer left out of the list would lose its chunks
        all_layers = await bus.kv_keys(self.catalog.layers)
        keep_chunks: set[str] = set()
        drop: list[LayerManifest] = []
        for d in all_layers:
            try:
                m = await self.catalog.layer(d)
            except Exception:
                continue
            young_snapshot = m.source.startswith("snapshot:") and now - m.created_at < self.cfg.snapshot_grace_s
            if d in used_layers or young_snapshot:
                keep_chunks.update(m.chunks)
            else:
                drop.append(m)
        freed = 0
        for m in drop:
            for h in set(m.chunks) - keep_chunks:
                await self.backend.delete(h)
                freed += 1
            await self.catalog.layers.delete(m.digest)
        return len(drop), freed

    @staticmethod
    def _summary(m: LayerManifest) -> LayerSummary:
        return LayerSummary(digest=m.digest, size=m.size, chunk_size=m.chunk_size, chunks=len(m.chunks),
                            unique_chunks=len(set(m.chunks)), source=m.source, created_at=m.created_at)


def _snapshot_layer(req: ImportRequest) -> LayerManifest:
    """The layer of a snapshot import, checked for the shape build_layer gives (its chunks are in
    the store already: the node uploaded them before asking)."""
    m = req.layer
    if m is None:
        raise InvalidRequest("source 'snapshot' needs `layer`, the manifest of the layer built from the sandbox")
    n = -(-m.size // m.chunk_size) if m.chunk_size > 0 else -1
    if not re.fullmatch(r"sha256-[0-9a-f]{64}", m.digest) or m.size < 0 or len(m.chunks) != n:
        raise InvalidRequest(f"snapshot layer {m.digest!r} is malformed (size {m.size}, chunk_size {m.chunk_size}, {len(m.chunks)} chunks)")
    if not m.source.startswith("snapshot:"):
        raise InvalidRequest(f"snapshot layer source must be 'snapshot:<sandbox>', not {m.source!r}")
    want = MEDIA_EROFS if req.memory is None else MEDIA_GUEST_MEMORY
    if m.media_type != want:
        raise InvalidRequest(f"snapshot layer {m.digest} is {m.media_type!r}; a {'memory' if req.memory else 'file'} snapshot's is {want!r}")
    if req.memory is not None and req.memory.layer != m.digest:
        raise InvalidRequest(f"memory.layer {req.memory.layer!r} is not the snapshot layer {m.digest}")
    return m


def _materialise(path: str):
    """docker_archive_layers yields tar objects tied to an open archive: read each into memory
    so they can be unpacked after the generator moved on (layers are unpacked one at a time)."""
    import io
    import tarfile

    for name, inner in importers.docker_archive_layers(path):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as out:
            for m in inner.getmembers():
                out.addfile(m, inner.extractfile(m) if m.isfile() else None)
        buf.seek(0)
        yield name, buf


def _extract_dir(buf, dest: str) -> None:
    import tarfile

    with tarfile.open(fileobj=buf) as tf:
        importers.extract_layer_tar(tf, dest)
