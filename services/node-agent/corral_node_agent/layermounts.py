"""Turns an image name into read-only lower directories for overlayfs.

The image's manifest (NATS KV) lists its layers; the node's image loader (image-cache service)
presents each layer as a lazily fetched file on its FUSE mount; this module mounts each such file
as EROFS once per node and shares the mount between every sandbox that uses the layer
(reference counted; unmounted, and released to the loader, when the last user goes)."""
from __future__ import annotations

import asyncio
import logging
import os

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from corral_common import linux
from corral_common.contract import subjects
from corral_common.contract.envelope import R, decode_reply
from corral_common.contract.errors import InvalidRequest, Unavailable
from corral_common.contract.images import GuestMemory, LoaderPrepare, LoaderRelease, LoaderStats, PrepareReply, ReleaseReply
from corral_common.contract.messages import Empty, encoder
from corral_common.layers import Catalog

log = logging.getLogger("corral.node.layers")


class ImageFiles(msgspec.Struct, kw_only=True):
    paths: list[str]  # the image's layer files, bottom first
    digests: list[str]  # what the loader prepared (the layers, then a saved guest's memory): release these
    memory: GuestMemory | None = None  # a memory snapshot's saved guest, its stream at memory_path
    memory_path: str = ""

    @property
    def layers(self) -> list[str]:
        return self.digests[:len(self.paths)]


class LayerMounts:
    def __init__(self, nc: NATS, catalog: Catalog, node: str, mount_root: str, loader_timeout_s: float = 60.0):
        self.nc = nc
        self.catalog = catalog
        self.node = node
        self.root = mount_root
        self.refs: dict[str, int] = {}
        self.lock = asyncio.Lock()
        self.loader_timeout_s = loader_timeout_s
        os.makedirs(mount_root, exist_ok=True)
        # the state dir above is searchable by sandbox uids (userns.make_traversable); the layers
        # (other tenants' snapshots among them) are reached by sandboxes only through their overlay
        os.chmod(mount_root, 0o700)

    def _dir(self, digest: str) -> str:
        return os.path.join(self.root, digest[len("sha256-"):][:24])

    async def _loader(self, op: str, body: msgspec.Struct, typ: type[R], timeout: float | None = None) -> R:
        subject = subjects.node_loader(self.node, op)
        try:
            msg = await self.nc.request(subject, encoder.encode(body), timeout=timeout or self.loader_timeout_s)
        except NoRespondersError:
            raise Unavailable(f"the image loader of node {self.node} is not running") from None
        except NatsTimeout:
            raise Unavailable(f"the image loader of node {self.node} did not answer {op}") from None
        return decode_reply(msg.data, typ)

    async def ping(self) -> bool:
        """Whether the loader answers; a loader that answers something unreadable is an error
        (raised with what did not match), not a loader that is not there yet."""
        try:
            await self._loader("stats", Empty(), LoaderStats, timeout=2)
            return True
        except Unavailable:
            return False

    async def acquire(self, image: str) -> tuple[list[str], list[str]]:
        """Returns (lower dirs, top layer first as overlayfs wants them; layer digests bottom first)."""
        manifest = await self.catalog.image(image)
        if manifest.memory is not None:
            raise InvalidRequest(f"image {image!r} is a memory snapshot of a {manifest.memory.substrate} guest; "
                                 f"create it with substrate {manifest.memory.substrate!r}")
        layers = list(manifest.layers)
        async with self.lock:
            r = await self._loader("prepare", LoaderPrepare(image=image, layers=layers), PrepareReply)
            mounted: list[str] = []
            try:
                for d in layers:
                    if self.refs.get(d, 0) == 0 and not os.path.ismount(self._dir(d)):
                        path = r.paths.get(d)
                        if not path:
                            raise Unavailable(f"the image loader did not provide layer {d}")
                        os.makedirs(self._dir(d), exist_ok=True)
                        await asyncio.to_thread(linux.mount, path, self._dir(d), "erofs", linux.MS_RDONLY)
                    self.refs[d] = self.refs.get(d, 0) + 1
                    mounted.append(d)
            except BaseException:
                await self._release_locked(mounted)
                # the loader counted every layer of this prepare; give back the ones not taken
                await self._loader_release([d for d in layers if d not in mounted])
                raise
        return [self._dir(d) for d in reversed(layers)], layers

    async def files(self, image: str) -> ImageFiles:
        """The image's layer files as the loader presents them (lazily fetched, bottom first), and
        a memory snapshot's saved guest, for a substrate that hands the files to something that
        mounts them itself (a microvm's block devices); given back with `release_files`."""
        manifest = await self.catalog.image(image)
        layers = list(manifest.layers)
        wanted = layers + ([manifest.memory.layer] if manifest.memory else [])
        r = await self._loader("prepare", LoaderPrepare(image=image, layers=wanted), PrepareReply)
        missing = [d for d in wanted if not r.paths.get(d)]
        if missing:
            await self._loader_release(wanted)
            raise Unavailable(f"the image loader did not provide layer(s) {', '.join(missing)}")
        return ImageFiles(paths=[r.paths[d] for d in layers], digests=wanted, memory=manifest.memory,
                          memory_path=r.paths[manifest.memory.layer] if manifest.memory else "")

    async def release_files(self, layers: list[str]) -> None:
        await self._loader_release(layers)

    async def release(self, layers: list[str]) -> None:
        async with self.lock:
            await self._release_locked(layers)

    async def _release_locked(self, layers: list[str]) -> None:
        gone = []
        for d in layers:
            n = self.refs.get(d, 0) - 1
            if n > 0:
                self.refs[d] = n
                continue
            self.refs.pop(d, None)
            mp = self._dir(d)
            if os.path.ismount(mp):
                try:
                    await asyncio.to_thread(linux.umount, mp)
                except OSError:
                    await asyncio.to_thread(linux.umount, mp, True)
            try:
                os.rmdir(mp)
            except OSError:
                pass
            gone.append(d)
        await self._loader_release(layers)

    async def _loader_release(self, layers: list[str]) -> None:
        if not layers:
            return
        try:
            await self._loader("release", LoaderRelease(layers=layers), ReleaseReply, timeout=5)
        except Exception as e:
            log.warning("loader release failed", extra={"fields": {"error": str(e)}})

    async def adopt(self, in_use: list[list[str]]) -> list[str]:
        """After a restart: count the layers adopted sandboxes use (and tell the loader), unmount
        every other layer mount left behind. Returns what was unmounted."""
        async with self.lock:
            for layers in in_use:
                for d in layers:
                    self.refs[d] = self.refs.get(d, 0) + 1
            for layers in in_use:
                try:
                    await self._loader("prepare", LoaderPrepare(image="", layers=layers), PrepareReply)
                except Exception as e:
                    log.warning("loader prepare for adopted layers failed", extra={"fields": {"error": str(e)}})
            keep = {self._dir(d) for d in self.refs}
            removed = []
            for name in os.listdir(self.root):
                mp = os.path.join(self.root, name)
                if mp in keep:
                    continue
                if os.path.ismount(mp):
                    linux.umount_or_detach(mp)
                try:
                    os.rmdir(mp)
                except OSError:
                    pass
                removed.append(mp)
            return removed

    async def close(self) -> None:
        async with self.lock:
            await self._release_locked([d for d, n in self.refs.items() for _ in range(n)])
            # and whatever a killed predecessor mounted that nobody counted
            for mp in linux.mounted_under(self.root):
                if mp == self.root:
                    continue
                linux.umount_or_detach(mp)
