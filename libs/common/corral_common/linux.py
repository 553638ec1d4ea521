"""Thin ctypes wrappers for the Linux calls the standard library lacks (mount, umount2, setns,
openat2). Spawning `mount(8)` per sandbox would cost milliseconds; these cost microseconds."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REMOUNT = 32
MNT_DETACH = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000

# the same numbers on every architecture (added after the syscall table unification)
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_FSCONFIG = 431
SYS_FSPICK = 433
SYS_OPENAT2 = 437
SYS_PIDFD_GETFD = 438
AT_FDCWD = -100
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
FSPICK_CLOEXEC = 1
MOVE_MOUNT_F_EMPTY_PATH = 4
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_RECONFIGURE = 7
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_XDEV = 0x01
RESOLVE_IN_ROOT = 0x10


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() if data else None),
        f"mount {fstype} on {target}",
    )


def umount(target: str, detach: bool = False) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH if detach else 0), f"umount {target}")


def umount_or_detach(target: str) -> None:
    """Unmount; if it is busy (a process still has a file open there), detach it so it goes when
    the last user does. Raises only if even the detach fails (not mounted)."""
    try:
        umount(target)
    except OSError:
        umount(target, detach=True)


def umount_all(prefix: str) -> None:
    """Every mount at or below prefix, deepest first, detaching busy ones."""
    for mp in mounted_under(prefix):
        umount_or_detach(mp)


PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> None:
    """Orphans below us (a container's init once `runc run -d` exits) are re-parented to us
    instead of the host's PID 1, so we can reap them and know they are fully gone."""
    _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): with RESOLVE_IN_ROOT every `..` and absolute symlink resolves inside dirfd,
    which is exactly the confinement files.read/write need. EAGAIN (a rename or mount change
    raced the lookup; the kernel asks the caller to retry) is retried a few times."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, mode, resolve)
    buf = ctypes.create_string_buffer(how)
    for _ in range(8):
        fd: int = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), buf, len(how))
        if fd >= 0:
            return fd
        e = ctypes.get_errno()
        if e != errno.EAGAIN:
            break
    raise OSError(e, os.strerror(e), path)


def open_tree_clone(path: str) -> int:
    """A detached private copy of the mount at `path` (open_tree(2), OPEN_TREE_CLONE): an fd that
    keeps the filesystem reachable after the mount point is unmounted, without being a mount
    any namespace lists. Sandboxes hold their roots this way: every mount in the host's table
    is copied into each new mount namespace, so host mounts per sandbox made `runc run` slower
    with every sandbox alive."""
    fd: int = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"open_tree {path}: {os.strerror(e)}")
    return fd


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy of another process's fd `fd` (pidfd_getfd(2); close-on-exec)."""
    got: int = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pidfd_getfd {fd}: {os.strerror(e)}")
    return got


def mount_clone(path: str, target: str) -> None:
    """Mount a private copy of the mount at `path` (which may be a detached one, reached through
    a /proc/<pid>/fd link) on `target`: for tools that need a path in the mount table."""
    fd = open_tree_clone(path)
    try:
        _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount {path} to {target}")
    finally:
        os.close(fd)


def reconfigure(path: str, **options: str) -> None:
    """Change options of the filesystem whose mount root is `path` (fspick + fsconfig). Unlike
    mount(MS_REMOUNT) this works on a detached mount (open_tree_clone), e.g. a tmpfs's size."""
    fd = _libc.syscall(SYS_FSPICK, AT_FDCWD, path.encode(), FSPICK_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fspick {path}: {os.strerror(e)}")
    try:
        for k, v in options.items():
            _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, k.encode(), v.encode(), 0), f"fsconfig {k}={v}")
        _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0), f"reconfigure {path}")
    finally:
        os.close(fd)


def mounted_under(prefix: str) -> list[str]:
    """Mount points at or below prefix, deepest first (the order to unmount them)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix.rstrip("/") + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


_own_uts: int | None = None


def set_hostname(pid: int, name: str) -> None:
    """Set the host name in the UTS namespace of `pid` (a warm-pool sandbox takes its claimed id
    as host name). setns(CLONE_NEWUTS) moves only the calling thread and touches nothing but the
    host name it sees, so the caller's thread goes in and straight back (to the namespace it was
    in, kept open): no thread to start on the claim's hot path."""
    global _own_uts
    if _own_uts is None:
        _own_uts = os.open("/proc/thread-self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
    nsfd = os.open(f"/proc/{pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(nsfd, CLONE_NEWUTS)
        try:
            raw = name.encode()
            _check(_libc.sethostname(raw, len(raw)), "sethostname")
        finally:
            setns(_own_uts, CLONE_NEWUTS)
    finally:
        os.close(nsfd)


def in_netns(pid: int, fn: Callable[[], T], pidfd: int | None = None) -> T:
    """`fn()` run inside the network namespace of `pid`, its result handed back.

    setns(CLONE_NEWNET) only moves the calling thread, so a throwaway thread goes in, runs fn
    and ends: the agent's own threads never leave the host namespace, even if fn fails. A socket
    made there stays in that namespace for life, whichever thread later uses it. With `pidfd`
    (the same process), the namespace is checked to still be that process's after it was opened:
    a pid reused by another process would otherwise hand over a stranger's namespace."""
    import signal
    import threading

    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, 0)  # ProcessLookupError: it exited, pid maybe reused
                setns(nsfd, CLONE_NEWNET)
            finally:
                os.close(nsfd)
            out.append(fn())
        except BaseException as e:  # reported to the caller
            err.append(e)

    t = threading.Thread(target=run, name=f"netns-{pid}")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def loopback_up(pid: int) -> None:
    """Bring `lo` up in the network namespace of `pid`: runc leaves a fresh netns with lo down;
    tests and servers inside a sandbox need 127.0.0.1."""
    import fcntl
    import socket

    def up() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))

    in_netns(pid, up)
