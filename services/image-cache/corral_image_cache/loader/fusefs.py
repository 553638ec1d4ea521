"""The FUSE filesystem: a flat, read-only directory with one regular file per prepared layer,
`<mount>/<layer digest>`, whose bytes are the layer's EROFS image.

Callbacks run in libfuse's worker threads; they read cached chunks straight from the cache files
and hand misses to the node cache (`read_range`), which bridges to the asyncio loop."""
from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from typing import TYPE_CHECKING

import mfusepy as fuse

if TYPE_CHECKING:
    from .node_cache import NodeCache

log = logging.getLogger("corral.loader.fuse")


class LayerFS(fuse.Operations):
    use_ns = True

    def __init__(self, cache: NodeCache):
        self.cache = cache
        self.handles: dict[int, object] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.started = time.time_ns()

    def init_with_config(self, conn, config) -> None:
        # more concurrent background (readahead) requests than the kernel's default 12: cold
        # reads of many sandboxes wait on the network in parallel
        n = self.cache.cfg.fuse_threads
        if conn is not None:
            conn.max_background = n
            conn.congestion_threshold = max(1, n * 3 // 4)

    def _layer(self, path: str):
        name = path.lstrip("/")
        if not name or "/" in name:
            return None
        layer = self.cache.layers.get(name)
        if layer is None or not layer.visible:
            return None
        return layer

    def getattr(self, path: str, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_uid": 0, "st_gid": 0,
                    "st_mtime": self.started, "st_ctime": self.started, "st_atime": self.started}
        layer = self.handles.get(fh) if fh else None
        if layer is None:
            layer = self._layer(path)
        if layer is None:
            raise fuse.FuseOSError(errno.ENOENT)
        t = layer.mtime_ns
        return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": layer.size, "st_uid": 0, "st_gid": 0,
                "st_blocks": (layer.size + 511) // 512, "st_blksize": 4096,
                "st_mtime": t, "st_ctime": t, "st_atime": t}

    def readdir(self, path: str, fh):
        if path != "/":
            raise fuse.FuseOSError(errno.ENOTDIR)
        return [".", "..", *(d for d, layer in list(self.cache.layers.items()) if layer.visible)]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise fuse.FuseOSError(errno.EROFS)
        layer = self._layer(path)
        if layer is None:
            raise fuse.FuseOSError(errno.ENOENT)
        with self.lock:
            fh = next(self.ids)
            self.handles[fh] = layer
        return fh

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        layer = self.handles.get(fh)
        if layer is None:
            raise fuse.FuseOSError(errno.EBADF)
        return self.cache.read_range(layer, offset, size)

    def release(self, path: str, fh: int) -> int:
        with self.lock:
            self.handles.pop(fh, None)
        return 0

    def statfs(self, path: str):
        total = sum(layer.size for layer in list(self.cache.layers.values()) if layer.visible)
        blocks = (total + 4095) // 4096
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": 0, "f_bavail": 0,
                "f_files": len(self.cache.layers) + 1, "f_ffree": 0, "f_namemax": 255}

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise fuse.FuseOSError(errno.EROFS)
        if path != "/" and self._layer(path) is None:
            raise fuse.FuseOSError(errno.ENOENT)
        return 0

    def destroy(self, path: str) -> None:
        pass  # the mount's end is seen by FuseMount, when libfuse's loop returns
