"""Sandbox root that is not host root: a user namespace per sandbox, over a host uid range of its own.

Each sandbox's uids 0..65535 are host uids base..base+65535, a range no other sandbox on the host
holds (UidRanges). So a process that escapes its namespaces is an unprivileged host user, the
per-uid kernel budgets (inotify instances, RLIMIT_NPROC, keyrings) of one sandbox are not host
root's nor a neighbour's, and files it could reach on the host are not its own.

The image's layers and the upper stay owned by uid 0 on disk: the sandbox sees them through
idmapped mounts (mount_setattr MOUNT_ATTR_IDMAP, which EROFS and tmpfs support; overlayfs itself
cannot be idmapped, but accepts idmapped layers), so layers are shared between sandboxes of every
range, and snapshots and change lists read the upper as it is. The overlay does its own work in
the upper with its mounter's credentials: it is mounted with fsuid/fsgid = base (acting_as), the
host-side files API writes with the same, everything else of the agent stays host root.

The user namespace is created by a process that first becomes uid `base` (make_userns): the
namespace's owner then is `base`, so what the kernel charges to the owner of a namespace (its
ucounts) is charged to the sandbox's range, not to host root. runc joins it by path."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import shutil
import socket
import stat
import struct
import time
from collections.abc import Iterator

from corral_common import config, linux

from .oci import USERNS_RANGE as RANGE

#: systemd's range for container uids (0x00080000..0x6FFFFFFF): not handed to users or services
FIRST_BASE = 0x00080000
LAST_BASE = 0x6FFF0000 - RANGE
CLAIMS_DIR = config.UID_RANGES_DIR
#: a sandbox's host uid base, kept in its state dir (it moves with a warm-pool claim's rename)
BASE_FILE = "uid-base"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SYS_OPEN_TREE = 428
SYS_MOUNT_SETATTR = 442
SYS_SETFSUID = {"x86_64": 122, "aarch64": 151}.get(os.uname().machine, 122)
SYS_SETFSGID = {"x86_64": 123, "aarch64": 152}.get(os.uname().machine, 123)
OPEN_TREE_CLONE = 1
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
MOUNT_ATTR_IDMAP = 0x00100000
PR_GET_SECUREBITS = 27
PR_SET_SECUREBITS = 28
SECBIT_NO_SETUID_FIXUP = 1 << 2


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _err(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


class UidRanges:
    """Host uid ranges handed out to sandboxes, unique across every node-agent on this host (two
    stacks may share one): a claim is a file named by the range's base in CLAIMS_DIR, created
    with O_EXCL, holding the claiming agent's state dir. It outlives an agent restart (adopted
    sandboxes keep their range) and is removed when its sandbox is torn down; sweep() drops what
    a crashed agent, or one whose state dir is gone, left behind."""

    def __init__(self, owner: str, claims_dir: str = CLAIMS_DIR):
        self.owner = os.path.abspath(owner)
        self.dir = claims_dir
        os.makedirs(claims_dir, mode=0o700, exist_ok=True)

    def claim(self, sid: str) -> int:
        slots = (LAST_BASE - FIRST_BASE) // RANGE + 1
        for _ in range(64):
            base = FIRST_BASE + random.randrange(slots) * RANGE
            try:
                fd = os.open(f"{self.dir}/{base}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:
                os.write(fd, f"{self.owner}\n{sid}\n".encode())
            finally:
                os.close(fd)
            return base
        raise OSError(errno.ENOSPC, "no free host uid range for a sandbox (every one tried is claimed)")

    def claim_for(self, sid: str, sdir: str) -> int:
        """claim(), recorded in the sandbox's state dir (BASE_FILE) at once, so that its teardown
        releases the range whatever fails next."""
        base = self.claim(sid)
        try:
            with open(f"{sdir}/{BASE_FILE}", "w") as f:
                f.write(f"{base}\n")
        except BaseException:
            self.release(base)
            raise
        return base

    def release(self, base: int) -> None:
        if base:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self.dir}/{base}")

    def owned(self) -> dict[int, str]:
        """base -> owner (a state dir) of every claim on the host."""
        out: dict[int, str] = {}
        for name in os.listdir(self.dir):
            try:
                with open(f"{self.dir}/{name}") as f:
                    out[int(name)] = f.readline().strip()
            except (OSError, ValueError):
                continue
        return out

    def sweep(self, keep: set[int]) -> list[int]:
        """Release this agent's claims not in `keep`, and every claim whose owner's state dir is
        gone; returns the bases released."""
        gone: list[int] = []
        for base, owner in self.owned().items():
            if (owner == self.owner and base not in keep) or (owner and not os.path.isdir(owner)):
                self.release(base)
                gone.append(base)
        return gone


def read_base(sdir: str) -> int:
    """The host uid base of the sandbox whose state dir is `sdir` (0: it has no user namespace)."""
    try:
        with open(f"{sdir}/{BASE_FILE}") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def make_userns(base: int, netns: bool = False) -> tuple[int, int | None]:
    """A user namespace mapping uids and gids 0..RANGE-1 to base.., owned by host uid `base`, as an
    fd (close-on-exec); with `netns`, also a network namespace it owns, holding only `lo`, up.

    A forked child becomes uid `base`, unshares, and waits while this process (root) writes its
    maps and opens its namespaces; then it exits (the fds keep the namespaces)."""
    if not 0 < base <= 0xFFFFFFFE - RANGE:
        raise ValueError(f"uid base {base} is out of range (1..{0xFFFFFFFE - RANGE})")
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: only async-signal-safe calls, then _exit
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            os.setresgid(base, base, base)
            os.setresuid(base, base, base)
            if _libc.unshare(CLONE_NEWUSER) == 0 and _lower_limits():
                os.write(ready_w, b"u")
                if os.read(go_r, 1) == b"n":  # maps written: root in the namespace now
                    if _libc.unshare(CLONE_NEWNET) == 0 and _lo_up():
                        os.write(ready_w, b"n")
                        os.read(go_r, 1)
                code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    user_fd = net_fd = None
    try:
        if os.read(ready_r, 1) != b"u":
            raise OSError(errno.EPERM, f"could not create a user namespace as uid {base}")
        for kind in ("uid", "gid"):
            with open(f"/proc/{pid}/{kind}_map", "w") as f:
                f.write(f"0 {base} {RANGE}\n")
        user_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        if netns:
            os.write(go_w, b"n")
            if os.read(ready_r, 1) != b"n":
                raise OSError(errno.EPERM, "could not create the sandbox's network namespace")
            net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return user_fd, net_fd
    except BaseException:
        for fd in (user_fd, net_fd):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        os.close(go_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


#: per-uid limits inside every sandbox's user namespace (/proc/sys/user/*, which its root, with
#: CAP_SYS_RESOURCE there, may set for it: the child sets them right after unsharing). The kernel
#: also charges the same counts up to the namespace's owner (the range), against the host's limits.
#: No nested user namespaces (seccomp refuses creating them too); inotify instances as
#: audit/budgets.py INOTIFY_PER_SANDBOX, and watches at a third of a common host default, per uid.
#: runc's own namespaces (mount, pid, ...) are made in this namespace: those counts stay as they are.
USERNS_LIMITS = {"max_user_namespaces": 0, "max_inotify_instances": 64, "max_inotify_watches": 65536}


def _lower_limits() -> bool:
    """(In the child, as root of the new namespace.)"""
    try:
        for name, value in USERNS_LIMITS.items():
            with open(f"/proc/sys/user/{name}", "w") as f:
                f.write(str(value))
        return True
    except OSError:
        return False


def _lo_up() -> bool:
    """(In the child: everything it uses is imported already, as uid `base` it may read no module.)"""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
        return True
    except OSError:
        return False


def idmapped(path: str, userns_fd: int) -> int:
    """A detached clone of the mount at `path` (open_tree), idmapped through `userns_fd`: files
    owned by uid N on disk show as the namespace's N (host uid base+N). An fd, close-on-exec;
    overlayfs takes it as a layer by its /proc/self/fd path."""
    fd: int = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        raise _err(f"open_tree {path}")
    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    if _libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
        err = _err(f"idmapping {path}")
        os.close(fd)
        raise err
    return fd


@contextlib.contextmanager
def acting_as(base: int) -> Iterator[None]:
    """Run the body with this thread's filesystem uid and gid set to `base` (the sandbox's root),
    its capabilities kept (SECBIT_NO_SETUID_FIXUP): what it creates is owned by the sandbox's
    root, and an overlay mounted here works in its idmapped upper as that uid. Credentials are
    per thread, so the rest of the agent is untouched; the body must not await. `base` 0: no-op."""
    if not base:
        yield
        return
    old_bits = _libc.prctl(PR_GET_SECUREBITS, 0, 0, 0, 0)
    if old_bits < 0 or _libc.prctl(PR_SET_SECUREBITS, old_bits | SECBIT_NO_SETUID_FIXUP, 0, 0, 0) != 0:
        raise _err("prctl(PR_SET_SECUREBITS)")
    _libc.syscall(SYS_SETFSGID, base)
    _libc.syscall(SYS_SETFSUID, base)
    try:
        yield
    finally:
        _libc.syscall(SYS_SETFSUID, 0)
        _libc.syscall(SYS_SETFSGID, 0)
        _libc.prctl(PR_SET_SECUREBITS, old_bits, 0, 0, 0)


def make_traversable(*paths: str) -> list[str]:
    """Give "other" search (x) permission on each of `paths` and every directory above it that
    lacks it (never read permission: nothing becomes listable); returns those changed."""
    changed: list[str] = []
    for path in paths:
        d = os.path.abspath(path)
        while True:
            st = os.stat(d)
            if not st.st_mode & stat.S_IXOTH:
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
                changed.append(d)
            if d == "/":
                break
            d = os.path.dirname(d)
    return changed


def probe(scratch: str) -> str | None:
    """Why user namespaces with idmapped layers cannot be used here, or None when they can: make
    a namespace, idmap a tmpfs through it and mount an overlay on it as acting_as does."""
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    t = f"{scratch}/probe-{os.getpid()}-{time.monotonic_ns()}"
    os.makedirs(f"{t}/rw")
    os.makedirs(f"{t}/root")
    fds: list[int] = []
    try:
        user_fd, _ = make_userns(FIRST_BASE)
        fds.append(user_fd)
        linux.mount("tmpfs", f"{t}/rw", "tmpfs", 0, "size=1m")
        for d in ("lower", "upper", "work"):
            os.mkdir(f"{t}/rw/{d}")
        fds.append(idmapped(f"{t}/rw", user_fd))
        m = fds[-1]
        with acting_as(FIRST_BASE):
            linux.mount("overlay", f"{t}/root", "overlay", 0,
                        f"lowerdir=/proc/self/fd/{m}/lower,upperdir=/proc/self/fd/{m}/upper,workdir=/proc/self/fd/{m}/work")
        try:
            with acting_as(FIRST_BASE):
                with open(f"{t}/root/x", "w") as f:
                    f.write("x")
            if os.stat(f"{t}/rw/upper/x").st_uid != 0:
                return "a file the sandbox's root writes is not owned by uid 0 in the upper"
        finally:
            linux.umount(f"{t}/root", detach=True)
        return None
    except OSError as e:
        return str(e)
    finally:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            linux.umount(f"{t}/rw", detach=True)
        shutil.rmtree(t, ignore_errors=True)
