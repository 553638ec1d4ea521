"""Layered images, shared by the image-cache (registry and node loader) and the node-agent.

An image is an ordered list of layers (bottom first). A layer is an EROFS filesystem image cut
into fixed-size chunks named by their sha256, so identical chunks are stored once across layers
and images. Manifests live in NATS KV; chunks behind `ChunkBackend` (JetStream object store by
default, a local directory as an alternative)."""
from __future__ import annotations

import abc
import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

import msgspec
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from . import config
from .contract.errors import Internal, InvalidRequest, NotFound
from .contract.images import CHUNK_BUCKET, DEFAULT_CHUNK, KV_IMAGES, KV_LAYERS, KV_TRACES, MAX_CHUNK, MEDIA_EROFS, MIN_CHUNK, ImageManifest, LayerManifest, Trace

EROFS_UUID = "c0a11a00-0000-4000-8000-000000000001"
IMAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
DIGEST = re.compile(r"^sha256-[0-9a-f]{64}$")


def check_image_name(name: str) -> str:
    if not isinstance(name, str) or not IMAGE_NAME.match(name):
        raise InvalidRequest(f"invalid image name {name!r}: must match [a-z0-9][a-z0-9._-]* (at most 128 characters)")
    return name


def check_chunk_size(n: int) -> int:
    if n < MIN_CHUNK or n > MAX_CHUNK or n & (n - 1):
        raise InvalidRequest(f"chunk_size must be a power of two between {MIN_CHUNK} and {MAX_CHUNK} bytes, got {n}")
    return n


# ---------------------------------------------------------------- chunk backends


class ChunkBackend(abc.ABC):
    """Where chunk bytes live. Keys are sha256 hex strings; values are immutable."""

    @abc.abstractmethod
    async def get(self, h: str) -> bytes: ...

    @abc.abstractmethod
    async def put(self, h: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def has(self, h: str) -> bool: ...

    @abc.abstractmethod
    async def delete(self, h: str) -> None: ...


class ObjectStoreBackend(ChunkBackend):
    def __init__(self, js: JetStreamContext, bucket: str = CHUNK_BUCKET):
        self.js = js
        self.bucket = bucket
        self._os: ObjectStore | None = None

    async def _store(self) -> ObjectStore:
        if self._os is None:
            try:
                self._os = await self.js.object_store(self.bucket)
            except Exception:
                try:
                    self._os = await self.js.create_object_store(self.bucket, ObjectStoreConfig(storage=StorageType.FILE, replicas=config.js_replicas()))
                except Exception:
                    self._os = await self.js.object_store(self.bucket)
        return self._os

    async def get(self, h: str) -> bytes:
        store = await self._store()
        try:
            res = await store.get(h)
        except Exception as e:
            if "not found" in str(e).lower() or type(e).__name__ == "ObjectNotFoundError":
                raise NotFound(f"chunk {h} is not in the chunk store") from None
            raise
        assert res.data is not None  # without `writeinto`, get answers the object's bytes
        return res.data

    async def put(self, h: str, data: bytes) -> None:
        store = await self._store()
        await store.put(h, data)

    async def has(self, h: str) -> bool:
        store = await self._store()
        try:
            info = await store.get_info(h)
            return info is not None and not getattr(info, "deleted", False)
        except Exception:
            return False

    async def delete(self, h: str) -> None:
        store = await self._store()
        try:
            await store.delete(h)
        except Exception:  # best effort: a chunk left behind is unreferenced and costs space only
            pass


class DirBackend(ChunkBackend):
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _path(self, h: str) -> str:
        return os.path.join(self.root, h[:2], h)

    async def get(self, h: str) -> bytes:
        try:
            return await asyncio.to_thread(_read_file, self._path(h))
        except FileNotFoundError:
            raise NotFound(f"chunk {h} is not in the chunk store") from None

    async def put(self, h: str, data: bytes) -> None:
        p = self._path(h)
        if os.path.exists(p):
            return
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{os.getpid()}.tmp"
        await asyncio.to_thread(_write_file, tmp, data)
        os.replace(tmp, p)

    async def has(self, h: str) -> bool:
        return os.path.exists(self._path(h))

    async def delete(self, h: str) -> None:
        try:
            os.unlink(self._path(h))
        except FileNotFoundError:
            pass


def _read_file(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _write_file(p: str, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)


def backend_from_url(url: str, js: JetStreamContext) -> ChunkBackend:
    """`nats` (JetStream object store, default) or `dir:///path`."""
    if url in ("", "nats", "objectstore"):
        return ObjectStoreBackend(js)
    if url.startswith("dir://"):
        return DirBackend(url[len("dir://"):])
    raise InvalidRequest(f"unknown chunk backend {url!r}: use 'nats' or 'dir:///path'")


# ---------------------------------------------------------------- building layers

Progress = Callable[[str, float | None], None]


def mkfs_erofs(src_dir: str, out_file: str, exclude: list[str] | None = None) -> None:
    """Uncompressed EROFS: the loader serves byte ranges, and uncompressed blocks map 1:1 to
    file offsets, so a read of one file fetches only the chunks holding it."""
    if not os.path.isdir(src_dir):
        raise InvalidRequest(f"{src_dir} is not a directory")
    mkfs = shutil.which("mkfs.erofs")
    if not mkfs:
        raise Internal("mkfs.erofs is not installed (apt-get install erofs-utils)")
    excl = [f"--exclude-path={e}" for e in exclude or []]
    # --preserve-mtime: build tools in sandboxes compare mtimes. A fixed UUID leaves only the
    # superblock's build time differing between two builds of the same tree, so every data chunk
    # deduplicates (only the first chunk of a rebuilt layer is new).
    p = subprocess.run([mkfs, "--quiet", "-x2", "--preserve-mtime", f"-U{EROFS_UUID}", *excl, out_file, src_dir],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise Internal(f"mkfs.erofs failed: {(p.stderr or p.stdout).strip()[-2000:]}")


async def chunk_layer_file(img: str, backend: ChunkBackend, chunk_size: int = DEFAULT_CHUNK, source: str = "",
                           progress: Progress | None = None) -> tuple[LayerManifest, int]:
    """Cut an EROFS file into chunks, upload the ones the store lacks, return its manifest."""
    with open(img, "rb") as f:
        return await chunk_stream(f, backend, chunk_size, source, MEDIA_EROFS, progress, os.path.getsize(img))


async def chunk_stream(f: BinaryIO, backend: ChunkBackend, chunk_size: int = DEFAULT_CHUNK, source: str = "",
                       media_type: str = MEDIA_EROFS, progress: Progress | None = None, size_hint: int = 0) -> tuple[LayerManifest, int]:
    """Chunk and upload what `f` gives until its end; it may be a pipe (a guest's memory as QEMU
    writes it), so the size is what was read. Returns the manifest and the bytes uploaded."""
    check_chunk_size(chunk_size)
    size = 0
    whole = hashlib.sha256()
    chunks: list[str] = []
    uploaded = 0
    while True:
        data = await asyncio.to_thread(f.read, chunk_size)
        if not data:
            break
        size += len(data)
        whole.update(data)
        h = hashlib.sha256(data).hexdigest()
        chunks.append(h)
        if not await backend.has(h):
            await backend.put(h, data)
            uploaded += len(data)
        if progress:
            progress("upload", min(1.0, size / max(size_hint, 1)))
    m = LayerManifest(digest=f"sha256-{whole.hexdigest()}", size=size, chunk_size=chunk_size, chunks=chunks,
                      created_at=time.time(), source=source, media_type=media_type)
    return m, uploaded


async def build_layer(src_dir: str, backend: ChunkBackend, chunk_size: int = DEFAULT_CHUNK, source: str = "",
                      work_dir: str | None = None, progress: Progress | None = None, keep_file: str | None = None,
                      exclude: list[str] | None = None) -> tuple[LayerManifest, int]:
    """Make an EROFS layer of `src_dir`, upload its chunks not already stored.

    Returns the manifest and how many bytes were uploaded (the rest deduplicated)."""
    check_chunk_size(chunk_size)
    tmpdir = tempfile.mkdtemp(prefix="corral-layer-", dir=work_dir)
    try:
        img = os.path.join(tmpdir, "layer.erofs")
        if progress:
            progress("mkfs.erofs", None)
        await asyncio.to_thread(mkfs_erofs, src_dir, img, exclude)
        m, uploaded = await chunk_layer_file(img, backend, chunk_size, source, progress)
        if keep_file:
            shutil.move(img, keep_file)
        return m, uploaded
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------- manifests in KV


class Catalog:
    """Reads and writes image and layer manifests in NATS KV."""

    def __init__(self, js: JetStreamContext):
        self.js = js
        self._images: KeyValue | None = None
        self._layers: KeyValue | None = None
        self._traces: KeyValue | None = None

    async def open(self) -> Catalog:
        from .bus import ensure_kv

        self._images = await ensure_kv(self.js, KV_IMAGES, history=5)
        self._layers = await ensure_kv(self.js, KV_LAYERS)
        self._traces = await ensure_kv(self.js, KV_TRACES)
        return self

    @staticmethod
    def _opened(kv: KeyValue | None) -> KeyValue:
        """The buckets exist only after `open()` (it may have to create them)."""
        if kv is None:
            raise Internal("the image catalog is used before open()")
        return kv

    @property
    def images(self) -> KeyValue:
        return self._opened(self._images)

    @property
    def layers(self) -> KeyValue:
        return self._opened(self._layers)

    @property
    def traces(self) -> KeyValue:
        return self._opened(self._traces)

    async def image(self, name: str) -> ImageManifest:
        from .bus import kv_get

        check_image_name(name)
        e = await kv_get(self.images, name, "the image catalog")
        if e is None or not e.value:
            names = await self.image_names()
            raise NotFound(f"unknown image {name!r}; available: {', '.join(names) or 'none'}")
        try:
            return msgspec.json.decode(e.value, type=ImageManifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise Internal(f"manifest of image {name!r} is malformed: {err}") from None

    async def image_names(self) -> list[str]:
        from .bus import kv_keys

        return sorted(await kv_keys(self.images))

    async def put_image(self, m: ImageManifest) -> None:
        await self.images.put(m.name, msgspec.json.encode(m))

    async def delete_image(self, name: str) -> None:
        await self.image(name)
        await self.images.delete(name)

    async def layer(self, digest: str) -> LayerManifest:
        if not DIGEST.match(digest):
            raise InvalidRequest(f"invalid layer digest {digest!r}")
        from .bus import kv_get

        e = await kv_get(self.layers, digest, "the layer catalog")
        if e is None or not e.value:
            raise NotFound(f"unknown layer {digest}")
        try:
            return msgspec.json.decode(e.value, type=LayerManifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise Internal(f"manifest of layer {digest} is malformed: {err}") from None

    async def put_layer(self, m: LayerManifest) -> None:
        await self.layers.put(m.digest, msgspec.json.encode(m))

    async def trace(self, image: str) -> Trace | None:
        try:
            e = await self.traces.get(image)
        except Exception:
            return None
        if e is None or not e.value:
            return None
        try:
            return msgspec.json.decode(e.value, type=Trace)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def put_trace(self, t: Trace) -> None:
        await self.traces.put(t.image, msgspec.json.encode(t))
