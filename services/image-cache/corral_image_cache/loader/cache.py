"""The node-local chunk cache: per layer a sparse data file of the layer's size and a bitmap with
one byte per chunk, both under `<cache-dir>/layers/<digest>/` next to a copy of the manifest.

A chunk's bitmap byte is written only after its data, so a loader that dies between the two
re-fetches that chunk instead of serving a hole. (The order holds against a crash of the loader,
which leaves both writes in the page cache; it is not fsynced against power loss.)

Files are read from FUSE threads and written from worker threads; a layer's descriptors are
guarded by a small reader/writer lock so eviction never closes a descriptor a read is using."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time

import msgspec

from corral_common import logs
from corral_common.contract.images import MEDIA_TYPES, LayerManifest
from corral_common.layers import DIGEST, check_chunk_size

log = logging.getLogger("corral.loader.cache")


class RWLock:
    """Many readers or one writer; readers never wait on the event loop while holding it."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def check_manifest(m: LayerManifest, digest: str) -> None:
    """A manifest the loader can serve: raises ValueError naming what is inconsistent."""
    if m.digest != digest:
        raise ValueError(f"manifest is stored under {digest} but names {m.digest}")
    if m.media_type not in MEDIA_TYPES:  # served as bytes either way: EROFS, or a guest's memory stream
        raise ValueError(f"media_type {m.media_type!r} is not one of {', '.join(MEDIA_TYPES)}")
    check_chunk_size(m.chunk_size)
    if m.size < 0:
        raise ValueError(f"negative size {m.size}")
    want = (m.size + m.chunk_size - 1) // m.chunk_size
    if len(m.chunks) != want:
        raise ValueError(f"{len(m.chunks)} chunk hashes for {m.size} bytes in {m.chunk_size}-byte chunks (want {want})")
    for h in m.chunks:
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ValueError(f"chunk hash {h!r} is not sha256 hex")


class Layer:
    """One layer on this node: its manifest, what is cached, and who uses it."""

    def __init__(self, root: str, m: LayerManifest):
        self.m = m
        self.digest = m.digest
        self.size = m.size
        self.cs = m.chunk_size
        self.n = len(m.chunks)
        self.dir = os.path.join(root, m.digest)
        self.data_path = os.path.join(self.dir, "data")
        self.bitmap_path = os.path.join(self.dir, "bitmap")
        self.bitmap = bytearray(self.n)
        self.present = 0
        self.cached_bytes = 0
        self.refs = 0
        self.visible = True
        self.last_used = time.time()
        self.last_chunk = -2  # the last chunk a read touched (sequential-read detection)
        self.pending = 0  # chunk loads in flight (the loop's single-flight tasks)
        self.fetched = 0  # chunks fetched from the store into this layer since the loader started
        self.fd: int | None = None
        self.bfd: int | None = None
        self.rw = RWLock()
        self.open_lock = threading.Lock()
        self.mtime_ns = int(m.created_at * 1e9)

    # ---------------------------------------------------------------- files

    def _open(self) -> None:
        """Open (creating) the data file and bitmap; caller holds rw (read or write)."""
        with self.open_lock:
            if self.fd is not None:
                return
            os.makedirs(self.dir, exist_ok=True)
            mpath = os.path.join(self.dir, "manifest.json")
            if not os.path.exists(mpath):
                tmp = mpath + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(msgspec.json.encode(self.m))
                os.replace(tmp, mpath)
            fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)
            bfd = os.open(self.bitmap_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(bfd).st_size != self.n:
                os.ftruncate(bfd, self.n)
            self.bfd = bfd
            self.fd = fd

    def load(self) -> None:
        """Read the persisted bitmap (after a restart)."""
        with self.rw.write():
            self._open()
            raw = os.pread(self.bfd, self.n, 0)
            bm = bytearray(self.n)
            bm[: len(raw)] = raw
            self.bitmap = bytearray(1 if b else 0 for b in bm)
            self.present = sum(self.bitmap)
            self.cached_bytes = sum(self.m.chunk_len(i) for i in range(self.n) if self.bitmap[i])
            try:
                self.last_used = os.stat(self.bitmap_path).st_mtime
            except OSError:
                pass

    def has_range(self, first: int, last: int) -> bool:
        bm = self.bitmap
        return all(bm[i] for i in range(first, last + 1))

    def pread(self, offset: int, size: int, first: int, last: int) -> bytes | None:
        """The bytes if every chunk of [first, last] is cached, else None (evicted meanwhile)."""
        with self.rw.read():
            if self.fd is None or not self.has_range(first, last):
                return None
            return os.pread(self.fd, size, offset)

    def read_chunk(self, i: int) -> bytes | None:
        with self.rw.read():
            if self.fd is None or not self.bitmap[i]:
                return None
            return os.pread(self.fd, self.m.chunk_len(i), i * self.cs)

    def write_chunk(self, i: int, data: bytes) -> bool:
        """Store a verified chunk: data first, then its bitmap byte. False if already present."""
        with self.rw.read():
            self._open()
            if self.bitmap[i]:
                return False
            off = i * self.cs
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, off)
                view = view[n:]
                off += n
            os.pwrite(self.bfd, b"\x01", i)
            with self.open_lock:
                if not self.bitmap[i]:
                    self.bitmap[i] = 1
                    self.present += 1
                    self.cached_bytes += len(data)
            return True

    def drop_data(self) -> None:
        """Forget every cached chunk and delete the files (eviction)."""
        with self.rw.write():
            for fd in (self.fd, self.bfd):
                if fd is not None:
                    os.close(fd)
            self.fd = self.bfd = None
            shutil.rmtree(self.dir, ignore_errors=True)
            self.bitmap = bytearray(self.n)
            self.present = 0
            self.cached_bytes = 0

    def close(self) -> None:
        with self.rw.write():
            for fd in (self.fd, self.bfd):
                if fd is not None:
                    os.close(fd)
            self.fd = self.bfd = None


def scan(root: str) -> list[Layer]:
    """Layers cached by an earlier run; broken entries are removed."""
    os.makedirs(root, exist_ok=True)
    # root's only: the node's state dir is searchable by sandbox uids (the node-agent's user
    # namespaces), and cached layers include every tenant's snapshots
    os.chmod(root, 0o700)
    out = []
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        try:
            if not DIGEST.match(name):
                raise ValueError("not a layer digest")
            with open(os.path.join(d, "manifest.json"), "rb") as f:
                m = msgspec.json.decode(f.read(), type=LayerManifest)
            check_manifest(m, name)
            layer = Layer(root, m)
            layer.load()
            out.append(layer)
        except Exception as e:
            logs.kv(log, logging.WARNING, "removing unreadable cache entry", path=d, error=str(e))
            shutil.rmtree(d, ignore_errors=True)
    return out
