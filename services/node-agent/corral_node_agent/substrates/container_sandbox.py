"""What a `container` sandbox is on the host: its state (ContainerSandbox, and the record a
restarted agent adopts it from), its root (overlayfs over the image's layers, the upper on a
size-capped tmpfs) and the fds its init holds.

A running sandbox keeps no mount in the host's mount table: the tmpfs and the overlay are
mounted under the state dir only for `runc run`, then detached. Every new mount namespace
copies the whole host table, so two host mounts per sandbox made each `runc run` slower with
every sandbox alive (45 ms at 20 host mounts, 200 ms at 4,000). The agent still needs both
filesystems (files.read/write, file audit, snapshots), also after a restart: corral-init holds
private clones of them (open_tree) as fds INIT_RW_FD and INIT_ROOT_FD, which the agent (root)
reaches as /proc/<init>/fd/N; init is non-dumpable, so nothing inside the sandbox can."""
from __future__ import annotations

import errno
import os
import socket

import msgspec

from corral_common import linux
from corral_common.contract.messages import SandboxInfo, SandboxSpec

from .. import cgroups, masks, userns
from .common import StayingSandbox

#: what every exec's environment starts from (the spec's env and the request's go over it)
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}


class Record(msgspec.Struct, kw_only=True):
    """Persisted beside the bundle so a restarted agent can adopt or clean the sandbox."""

    info: SandboxInfo
    spec: SandboxSpec
    init_pid: int
    layers: list[str] = []


#: the fds corral-init holds: 3 is its control socket, then the sandbox's tmpfs and its root
INIT_RW_FD = 4
INIT_ROOT_FD = 5
#: and, handed over after start, its seccomp notify fd (ContainerSubstrate._hand_notify_fd)
INIT_NOTIFY_FD = 6


class ContainerSandbox(StayingSandbox):
    """A runc container with corral-init as PID 1: its control socket, the layers it holds, and
    its filesystems through the clones init keeps."""

    cg: cgroups.Cgroups

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, sdir: str, cg: cgroups.Cgroups, init_pid: int, layers: list[str]):
        super().__init__(info, spec, sdir, cg)
        self.layers = layers
        self.warm_id = ""  # the internal id it had in the warm pool, if it was claimed from there
        self.unsettled = False  # claimed, and runc's state, config.json and the record still name warm_id
        self.rebase(sdir)
        self.init_pid = init_pid
        self.init_token = ""  # what init asks of every request: none, its socket is outside the sandbox
        # the sandbox's filesystems, through the clones its init holds (see the module docstring)
        self.rootfs = f"/proc/{init_pid}/fd/{INIT_ROOT_FD}"
        self.rw = f"/proc/{init_pid}/fd/{INIT_RW_FD}"
        # protected paths covered by decoys in the container's mount namespace (masks.py)
        self.masks: list[masks.Mask] = masks.load(f"{sdir}/masks")
        try:
            self.pidfd = os.pidfd_open(init_pid)
        except OSError:
            self.pidfd = None

    def rebase(self, sdir: str) -> None:
        self.sdir = sdir
        self.ctl = f"{sdir}/ctl.sock"
        self.io = f"{sdir}/io"


#: tmpfs option for large folios: Linux 6.14+ backs writes that stay within a file's size with
#: pages of up to 2 MiB, which made a fork's copy of 256 MiB ~2.5x faster here (120 -> 50 ms),
#: and never takes more room than the data (small files keep 4 KiB pages). Kernels without
#: transparent huge pages refuse the option (EINVAL): the first mount finds out
LARGE_FOLIOS_OPT = ",huge=within_size"
_large_folios: bool | None = None


def mount_upper(sdir: str, disk_mb: int) -> str:
    """`sdir/rw`: a tmpfs of disk_mb holding the overlay's upper and work dirs. Returns the upper
    dir, which a fork fills before the overlay is mounted over it (mount_overlay)."""
    global _large_folios
    opts = f"size={disk_mb}m,mode=755"
    flags = linux.MS_NOSUID | linux.MS_NODEV
    try:
        linux.mount("tmpfs", f"{sdir}/rw", "tmpfs", flags, opts + (LARGE_FOLIOS_OPT if _large_folios is not False else ""))
    except OSError as e:
        if e.errno != errno.EINVAL or _large_folios is not None:
            raise
        linux.mount("tmpfs", f"{sdir}/rw", "tmpfs", flags, opts)
        _large_folios = False
    else:
        if _large_folios is None:
            _large_folios = True
    os.mkdir(f"{sdir}/rw/upper", 0o755)
    os.mkdir(f"{sdir}/rw/work", 0o755)
    return f"{sdir}/rw/upper"


def mount_overlay(sdir: str, lower: str, userns_fd: int | None = None, base: int = 0) -> None:
    """`sdir/rootfs`: the overlay of `lower` (image layers, ':'-separated) and the upper on
    `sdir/rw` (mount_upper). With a user namespace (`userns_fd`, its range at host uid `base`),
    every layer, the upper's too, is an idmapped clone (userns.py) and the overlay is mounted as
    the sandbox's root: files stay owned by uid 0 on disk and are the sandbox's root's inside,
    not host root's."""
    # nosuid/nodev on the host side too: a setuid file the sandbox makes must not be a way
    # to root for a host user who can reach the state dir. upper and work are given as
    # /proc/self/fd paths: overlayfs shows its options verbatim in the sandbox's own
    # /proc/mounts, and the state dir's name (the sandbox id, or a warm-pool id before a
    # claim renames it) must not show there. index=on,nfs_export=on make the overlay's file
    # handles decodable, which fanotify needs to report its directory entry events
    # (create/unlink/rename) with paths (audit/files.py); without them (a lower that cannot
    # export handles) the overlay is mounted plain and file activity falls back to fd mode
    fds: list[int] = []
    try:
        if userns_fd is not None:
            fds = [userns.idmapped(p, userns_fd) for p in lower.split(":")]
            lower = ":".join(f"/proc/self/fd/{fd}" for fd in fds)
            fds.append(userns.idmapped(f"{sdir}/rw", userns_fd))
            up = os.open(f"/proc/self/fd/{fds[-1]}/upper", os.O_PATH | os.O_CLOEXEC)
            wk = os.open(f"/proc/self/fd/{fds[-1]}/work", os.O_PATH | os.O_CLOEXEC)
        else:
            up = os.open(f"{sdir}/rw/upper", os.O_PATH | os.O_CLOEXEC)
            wk = os.open(f"{sdir}/rw/work", os.O_PATH | os.O_CLOEXEC)
        fds += [up, wk]
        opts = f"lowerdir={lower},upperdir=/proc/self/fd/{up},workdir=/proc/self/fd/{wk}"
        with userns.acting_as(base):
            try:
                linux.mount("overlay", f"{sdir}/rootfs", "overlay", linux.MS_NOSUID | linux.MS_NODEV, opts + ",index=on,nfs_export=on")
            except OSError:
                linux.mount("overlay", f"{sdir}/rootfs", "overlay", linux.MS_NOSUID | linux.MS_NODEV, opts)
    finally:
        for fd in fds:
            os.close(fd)


def mount_root(sdir: str, lower: str, disk_mb: int, userns_fd: int | None = None, base: int = 0) -> None:
    """The upper's tmpfs and the overlay over it, with nothing filled in between."""
    mount_upper(sdir, disk_mb)
    mount_overlay(sdir, lower, userns_fd, base)


def init_responsive(ctl: str, paused: bool) -> bool:
    """Whether the init behind control socket `ctl` still listens (a frozen one cannot answer: its
    socket existing is all that can be asked)."""
    if paused:
        return os.path.exists(ctl)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect(ctl)
        return True
    except OSError as e:
        return e.errno == errno.EAGAIN
    finally:
        s.close()
