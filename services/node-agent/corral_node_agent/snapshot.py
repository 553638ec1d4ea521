"""Snapshots: a sandbox's writable layer made into an image on top of its image's layers, or
(memory snapshots of guests) the running guest saved whole, on top of the same.

The node does the data plane (freeze, build the EROFS layer, upload its chunks to the shared
chunk store, thaw); the image is registered by the image-cache, the only writer of the catalog,
through `corral.v1.image.import` with source "snapshot". The new image can start on any node."""
from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from corral_common import logs, metrics
from corral_common.contract import subjects
from corral_common.contract.envelope import decode_reply
from corral_common.contract.errors import Unavailable
from corral_common.contract.images import MEDIA_GUEST_MEMORY, ImageManifest, ImportReply, ImportRequest, LayerManifest
from corral_common.contract.messages import encoder
from corral_common.layers import ObjectStoreBackend, build_layer, check_image_name, chunk_stream

from .substrates import Substrate
from .substrates.base import Sandbox

log = logging.getLogger("corral.node")

SNAPSHOT_SECONDS = metrics.histogram("corral_snapshot_seconds", "Time to snapshot a sandbox", ("node",),
                                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
IMPORT_TIMEOUT_S = 300.0  # behind an import in progress (the image-cache imports one at a time)


class Snapshots:
    def __init__(self, nc: NATS, js: JetStreamContext, node: str, work_dir: str):
        self.nc = nc
        self.js = js
        self.node = node
        self.work_dir = work_dir

    async def take(self, sb: Sandbox, sub: Substrate, name: str, labels: dict[str, str],
                   memory: bool = False) -> tuple[ImageManifest, LayerManifest, int]:
        """Turn the sandbox's writable layer into an image layer on top of its image's layers;
        with `memory`, the whole running guest (its files are in its RAM) instead.

        The sandbox is frozen while the layer is built so the snapshot is consistent, then thawed."""
        name = name or f"snap-{sb.id}-{int(time.time() * 1000)}"
        check_image_name(name)
        # one freeze-and-read of a sandbox at a time (snapshots, `changes`): two would share the
        # snapshot dir, and one's thaw could land in the middle of the other's read
        async with sb.changes_lock:
            if memory:
                return await self._take_memory(sb, sub, name, labels)
            return await self._take(sb, sub, name, labels)

    async def _take_memory(self, sb: Sandbox, sub: Substrate, name: str, labels: dict[str, str]) -> tuple[ImageManifest, LayerManifest, int]:
        """The substrate writes the guest's state into a pipe while its chunks are uploaded from
        the other end: nothing of it is staged on the node's disk (or charged to its cgroup)."""
        t0 = time.perf_counter()
        r, w = os.pipe()
        stream = os.fdopen(r, "rb")
        upload = asyncio.create_task(chunk_stream(stream, ObjectStoreBackend(self.js), source=f"snapshot:{sb.id}", media_type=MEDIA_GUEST_MEMORY))
        save = asyncio.create_task(sub.save_memory(sb, w))
        try:
            # the upload ends only at the pipe's end (after the save): done before it, it failed
            await asyncio.wait({upload, save}, return_when=asyncio.FIRST_COMPLETED)
            if not save.done():  # QEMU's next write fails too, ending the save
                stream.close()
            try:
                saved, layers = await save
            finally:
                os.close(w)  # QEMU's copy is closed when its save ends: the upload then reads the end
                w = -1
            layer, uploaded = await upload
        finally:
            if w >= 0:
                os.close(w)
            if not save.done():
                save.cancel()
            await asyncio.gather(save, upload, return_exceptions=True)  # the reader ends at the pipe's end
            stream.close()
        image = await self._register(ImportRequest(name=name, source="snapshot", layers=layers, layer=layer,
                                                   memory=msgspec.structs.replace(saved, layer=layer.digest),
                                                   labels={**labels, "snapshot_of": sb.id}, parent=sb.info.image))
        SNAPSHOT_SECONDS.labels(self.node).observe(time.perf_counter() - t0)
        logs.kv(log, logging.INFO, "memory snapshot", sandbox=sb.id, image=name, size=layer.size, uploaded=uploaded,
                seconds=round(time.perf_counter() - t0, 3))
        return image, layer, uploaded

    async def _take(self, sb: Sandbox, sub: Substrate, name: str, labels: dict[str, str]) -> tuple[ImageManifest, LayerManifest, int]:
        if sub.snapshots_itself:  # substrates that make images their own way (docker: commit, save, import)
            return await sub.snapshot_image(sb, name, labels)
        was_paused = sb.info.state == "paused"
        t0 = time.perf_counter()
        async with sub.snapshot_dir(sb) as (upper, layers):
            if not was_paused:
                await sub.pause(sb)
            try:
                layer, uploaded = await build_layer(upper, ObjectStoreBackend(self.js), source=f"snapshot:{sb.id}",
                                                    work_dir=self.work_dir, exclude=[".corral"])
            finally:
                if not was_paused:
                    await sub.resume(sb)
        image = await self._register(ImportRequest(name=name, source="snapshot", layers=list(layers), layer=layer,
                                                   labels={**labels, "snapshot_of": sb.id}, parent=sb.info.image))
        SNAPSHOT_SECONDS.labels(self.node).observe(time.perf_counter() - t0)
        logs.kv(log, logging.INFO, "snapshot", sandbox=sb.id, image=name, size=layer.size, uploaded=uploaded,
                seconds=round(time.perf_counter() - t0, 3))
        return image, layer, uploaded

    async def _register(self, req: ImportRequest) -> ImageManifest:
        try:
            msg = await self.nc.request(subjects.IMAGE_IMPORT, encoder.encode(req), timeout=IMPORT_TIMEOUT_S)
        except Exception as e:
            raise Unavailable(f"snapshot layer built, but the image-cache did not register image {req.name!r}: {e}",
                              retry_after_s=1) from None
        return decode_reply(msg.data, ImportReply).image
