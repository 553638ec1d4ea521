"""What a function call runs in when no warm sandbox is ready: a *slot*, a prepared, never used
sandbox root (the `container` substrate's overlay on a size-capped tmpfs) and a network namespace
holding only `lo`, already up, which runc joins instead of creating one (which is also what makes
runc fastest). Slots of one image share one hold on the node's layer mounts."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from corral_common import linux

from .container_sandbox import mount_root

CLONE_NEWNET = 0x40000000


@dataclass
class Hold:
    """The node's layer mounts of one image, taken once and shared by all its slots (so a call
    costs the loader no prepare/release round trip); given back once dropped and unused."""

    image: str
    lowers: list[str]
    layers: list[str]
    users: int = 0
    dropped: bool = False


@dataclass
class Slot:
    """A prepared, never used sandbox root: `sdir/rootfs` (overlay), `sdir/rw` (tmpfs upper),
    `sdir/netns` (a bind-mounted network namespace with lo up)."""

    sid: str
    sdir: str
    hold: Hold
    disk_mb: int
    made_at: float = field(default_factory=time.monotonic)

    @property
    def rootfs(self) -> str:
        return f"{self.sdir}/rootfs"


def prepare_slot(slot: Slot, lower: str) -> None:
    """Make the slot's root on the image's layers `lower` (':'-separated) and its network namespace."""
    sdir = slot.sdir
    os.makedirs(sdir, mode=0o700)
    os.makedirs(f"{sdir}/rw")
    os.makedirs(f"{sdir}/rootfs")
    mount_root(sdir, lower, slot.disk_mb)  # (with decodable handles: file activity with paths)
    make_netns(f"{sdir}/netns")


def make_netns(path: str) -> None:
    """A fresh network namespace with only `lo`, up, kept alive by a bind mount at `path`.

    unshare(CLONE_NEWNET) moves only the calling thread, so a throwaway thread makes it; the
    agent's own threads stay in the host namespace."""
    import ctypes
    import fcntl

    libc = ctypes.CDLL(None, use_errno=True)
    err: list[BaseException] = []

    def run() -> None:
        try:
            if libc.unshare(CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), linux.SIOCGIFFLAGS, req))[1]
                fcntl.ioctl(s.fileno(), linux.SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | linux.IFF_UP))
            with open(path, "w"):
                pass
            linux.mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, "", linux.MS_BIND)
        except BaseException as e:  # reported to the caller
            err.append(e)

    t = threading.Thread(target=run, name="netns")
    t.start()
    t.join()
    if err:
        raise err[0]
