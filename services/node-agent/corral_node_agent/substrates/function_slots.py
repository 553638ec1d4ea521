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

from .. import userns
from ..userns_helper import Helper
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
    uid_base: int = 0  # host uid of its root (userns.py); 0: host root

    @property
    def rootfs(self) -> str:
        return f"{self.sdir}/rootfs"


def prepare_slot(slot: Slot, lower: str, uids: userns.UidRanges | None, helper: Helper | None) -> None:
    """Make the slot's root on the image's layers `lower` (':'-separated) and its network
    namespace; with `uids`, in a user namespace over a host uid range of its own (userns.py),
    which the network namespace belongs to. Both namespaces are kept by bind mounts in the slot's
    dir (runc joins them by path), removed with it."""
    sdir = slot.sdir
    os.makedirs(sdir, mode=0o711)
    os.chmod(sdir, 0o711)  # runc mounts the root as the sandbox's root: it must pass through
    os.makedirs(f"{sdir}/rw")
    os.makedirs(f"{sdir}/rootfs")
    if uids is None or helper is None:
        mount_root(sdir, lower, slot.disk_mb)  # (with decodable handles: file activity with paths)
        make_netns(f"{sdir}/netns")
        exec_mountpoint(slot)
        return
    slot.uid_base = uids.claim_for(slot.sid, sdir)
    user_fd, net_fd = helper.make(slot.uid_base, netns=True)
    try:
        mount_root(sdir, lower, slot.disk_mb, user_fd, slot.uid_base)
        for name, fd in (("userns", user_fd), ("netns", net_fd)):
            with open(f"{sdir}/{name}", "w"):
                pass
            linux.mount(f"/proc/self/fd/{fd}", f"{sdir}/{name}", "", linux.MS_BIND)
    finally:
        for fd in (user_fd, net_fd):
            if fd is not None:
                os.close(fd)
    exec_mountpoint(slot)


def exec_mountpoint(slot: Slot) -> None:
    """/.corral/exec, where a call's container finds corral-exec (function_filter.py), made now
    rather than by runc during the call: a call's file activity is the command's own."""
    with userns.acting_as(slot.uid_base):
        os.makedirs(f"{slot.rootfs}/.corral", mode=0o755, exist_ok=True)
        with open(f"{slot.rootfs}/.corral/exec", "a"):
            pass


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
