"""The FUSE mount's life: libfuse's loop in its own thread from mount to unmount.

It is apart from the filesystem callbacks (`fusefs`) because its state is the thread, its error
and the event the asyncio loop waits on, and because ending it well is delicate: a mount still
used by sandboxes is detached lazily and served until the kernel closes the connection or the
grace ends."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time

import mfusepy as fuse

from corral_common import logs
from corral_common.contract.errors import Internal

from . import mounts
from .config import LoaderConfig

log = logging.getLogger("corral.loader")


class FuseMount:
    def __init__(self, cfg: LoaderConfig, mount: str):
        self.cfg = cfg
        self.mount = mount
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Event | None = None  # set when libfuse's loop has returned

    async def start(self, fs: fuse.Operations) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        os.makedirs(self.mount, exist_ok=True)
        if mounts.is_mounted(self.mount):
            # left behind by a loader that was killed: its connection is dead
            logs.kv(log, logging.WARNING, "stale mount at the mount point; detaching it", mount=self.mount,
                    users=mounts.users(self.mount))
            try:
                mounts.umount(self.mount, detach=True)
            except OSError as e:
                raise Internal(f"cannot clear the stale mount at {self.mount}: {e}") from None
        opts = dict(foreground=True, ro=True, default_permissions=True, fsname=f"corral-loader-{self.cfg.node}",
                    subtype="corral", kernel_cache=True, entry_timeout=self.cfg.entry_timeout_s,
                    attr_timeout=self.cfg.attr_timeout_s, negative_timeout=0.0, max_threads=self.cfg.fuse_threads,
                    max_idle_threads=min(16, self.cfg.fuse_threads))
        if self.cfg.auto_unmount:
            opts["auto_unmount"] = True  # fusermount3 unmounts (lazily) if this process dies

        def main() -> None:
            try:
                fuse.FUSE(fs, self.mount, **opts)
            except BaseException as e:  # noqa: BLE001 - reported to the loop
                self.error = e
            finally:
                if self.loop and not self.loop.is_closed():
                    self.loop.call_soon_threadsafe(self.done.set)

        self.thread = threading.Thread(target=main, name="fuse", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not mounts.is_mounted(self.mount):
            if self.done.is_set() or time.monotonic() > deadline:
                raise Internal(f"FUSE mount at {self.mount} failed: {self.error or 'timed out'}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self.thread is None or not self.thread.is_alive():
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
            await asyncio.wait_for(self.done.wait(), self.cfg.shutdown_grace_s if detach else 10)
        except (TimeoutError, asyncio.TimeoutError):
            logs.kv(log, logging.WARNING, "FUSE loop still running at exit", mount=self.mount)
        else:
            logs.kv(log, logging.INFO, "FUSE mount removed", mount=self.mount, lazy=detach)
