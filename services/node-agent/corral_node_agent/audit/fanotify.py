"""File audit with fanotify permission events: protected paths (denied) and canary files (allowed,
reported).

One fanotify group (FAN_CLASS_CONTENT) per node. For each sandbox, every `protected_paths` entry
that exists in its root (resolved with openat2(RESOLVE_IN_ROOT), so a symlink cannot point the mark
at a host file) gets an inode mark for FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM on the sandbox's overlay
inode (directories: on every directory of the tree, with FAN_EVENT_ON_CHILD | FAN_ONDIR). The
container's root is a copy of that overlay mount, so its opens reach the same inodes. The agent
answers FAN_DENY (the open fails with EPERM) and records an AuditEvent(kind="file", op="open",
detail.protected="1"). Canary files (SandboxSpec.canaries) are written at create and marked the
same way, but the open is allowed and an AuditEvent(kind="canary") is recorded.

Which sandbox an event belongs to comes from the opener's cgroup (overlay reports the lower
layer's st_dev/st_ino for files, and lower layers are shared between sandboxes of one image), then
the inode identifies the path inside that sandbox. Opens by the node-agent itself (files.read runs
in a thread) are answered without an event: protected ones denied, canaries allowed; the files.read
handler checks and records those itself.

Marks go away with the sandbox's overlay superblock at destroy (the kernel drops inode marks on
unmount); unregister also removes them explicitly while the root is still mounted. If the agent
dies, the group closes and the kernel allows pending and later opens (fanotify fails open): a
restarted agent re-marks adopted sandboxes from their persisted specs."""
from __future__ import annotations

import ctypes
import logging
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from corral_common import linux, metrics

from ..confine import O_PATH, RESOLVE
from .reader import METADATA, FanotifyReader

log = logging.getLogger("corral.node.fanotify")

FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_CLASS_CONTENT = 0x4
FAN_MARK_ADD = 0x1
FAN_MARK_REMOVE = 0x2
FAN_OPEN_PERM = 0x10000
FAN_OPEN_EXEC_PERM = 0x40000
FAN_EVENT_ON_CHILD = 0x08000000
FAN_ONDIR = 0x40000000
FAN_ALLOW = 0x1
FAN_DENY = 0x2
FAN_NOFD = -1
FAN_Q_OVERFLOW = 0x4000
AT_FDCWD = -100
O_LARGEFILE = 0o100000
RESPONSE = struct.Struct("=iI")
FILE_MASK = FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM
DIR_MASK = FAN_OPEN_PERM | FAN_OPEN_EXEC_PERM | FAN_EVENT_ON_CHILD | FAN_ONDIR
MAX_TREE = 10_000  # directories marked under one protected directory

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_init.restype = ctypes.c_int
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
_libc.fanotify_mark.restype = ctypes.c_int

FILE_EVENTS = metrics.counter("corral_fanotify_events_total", "fanotify permission events answered", ("node", "kind"))


def fanotify_init(flags: int, event_f_flags: int) -> int:
    fd = _libc.fanotify_init(flags, event_f_flags)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fanotify_init: {os.strerror(e)}")
    return fd


def fanotify_mark(group: int, flags: int, mask: int, dirfd: int, path: str | None) -> None:
    """With path None, marks the object `dirfd` refers to; fanotify_mark refuses O_PATH fds
    (EBADF), so those go through their /proc/self/fd magic link (the very same object)."""
    if path is None:
        dirfd, path = AT_FDCWD, f"/proc/self/fd/{dirfd}"
    r = _libc.fanotify_mark(group, flags, mask, dirfd, path.encode())
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fanotify_mark: {os.strerror(e)}")


@dataclass
class Entry:
    path: str  # inside the sandbox
    kind: str  # "protected" or "canary"
    is_dir: bool = False


@dataclass
class Watched:
    sid: str
    root: str
    inodes: dict[tuple[int, int], Entry] = field(default_factory=dict)
    protected: list[str] = field(default_factory=list)  # normalised protected paths, for path checks
    canaries: list[str] = field(default_factory=list)
    marked: list[tuple[str, int]] = field(default_factory=list)  # (path inside the sandbox, mask) for removal
    decoy_marked: list[tuple[str, int]] = field(default_factory=list)  # (host path of a decoy, mask) for removal


# (sandbox id, pid, kind "file"/"canary", path inside the sandbox, denied)
Callback = Callable[[str, int, str, str, bool], None]


def norm(path: str) -> str:
    return os.path.normpath("/" + path.lstrip("/")) if path else "/"


def under(path: str, top: str) -> bool:
    return path == top or top == "/" or path.startswith(top.rstrip("/") + "/")


class FileAudit:
    def __init__(self, node: str, on_event: Callback, on_overflow: Callable[[list[str]], None] | None = None,
                 reader: FanotifyReader | None = None):
        self.node = node
        self.reader = reader or FanotifyReader()
        self.on_event = on_event
        #: the kernel's queue overflowed (FAN_Q_OVERFLOW): called with every watched sandbox, as
        #: the lost events cannot be attributed
        self.on_overflow = on_overflow
        self.fd: int | None = None
        self.sandboxes: dict[str, Watched] = {}
        self.me = os.getpid()

    def start(self) -> None:
        self.fd = fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY | O_LARGEFILE)
        # permission events carry no info records: 64 of them per read
        self.reader.add(self.fd, self._handle, bufsize=64 * METADATA.size)

    def close(self) -> None:
        if self.fd is not None:
            self.reader.remove(self.fd)
            os.close(self.fd)  # the kernel allows whatever was still pending
            self.fd = None
        self.sandboxes.clear()

    # ------------------------------------------------------------------ per sandbox

    def add(self, sid: str, root: str, protected: list[str], canaries: list[str],
            decoys: list[tuple[str, str]] = ()) -> Watched:  # type: ignore[assignment]
        """Mark the sandbox's protected paths and canaries (blocking: call from a thread).
        `decoys` are (protected path, host path of the decoy the container sees there, masks.py):
        marked the same way, under the protected path's name."""
        assert self.fd is not None
        w = Watched(sid=sid, root=root, protected=[norm(p) for p in protected], canaries=[norm(c) for c in canaries])
        for path, decoy in decoys:
            try:
                fd = os.open(decoy, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                n = len(w.marked)
                self._mark_tree(w, fd, norm(path), "protected")
                w.decoy_marked.extend((decoy + p[len(norm(path)):], m) for p, m in w.marked[n:])
                del w.marked[n:]
            finally:
                os.close(fd)
        rootfd = os.open(root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for kind, paths in (("protected", w.protected), ("canary", w.canaries)):
                for p in paths:
                    try:
                        fd = linux.openat2(rootfd, p, O_PATH | os.O_CLOEXEC, 0, RESOLVE)
                    except OSError:
                        continue  # not in this image: nothing to protect
                    try:
                        self._mark_tree(w, fd, p, kind)
                    finally:
                        os.close(fd)
        finally:
            os.close(rootfd)
        self.sandboxes[sid] = w
        return w

    def _mark_tree(self, w: Watched, fd: int, path: str, kind: str) -> None:
        """Mark the object at `fd` (O_PATH); for a directory, every directory below it too. The
        whole tree is listed before anything is marked: our own opens of marked inodes would wait
        for (and be denied by) our own answers."""
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            fanotify_mark(self.fd, FAN_MARK_ADD, FILE_MASK, fd, None)
            w.inodes[(st.st_dev, st.st_ino)] = Entry(path, kind, False)
            w.marked.append((path, FILE_MASK))
            return
        w.inodes[(st.st_dev, st.st_ino)] = Entry(path, kind, True)
        dirs: list[tuple[int, str]] = [(os.dup(fd), path)]  # O_PATH fds to mark
        queue = [(fd, path)]
        try:
            while queue:
                pfd, dpath = queue.pop()
                try:  # O_PATH cannot be listed: reopen for reading (never following a link)
                    rfd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    names = os.listdir(rfd)
                    for name in names:
                        child = f"{dpath.rstrip('/')}/{name}"
                        try:
                            cfd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
                        except OSError:
                            continue
                        cst = os.fstat(cfd)
                        isdir = stat.S_ISDIR(cst.st_mode)
                        w.inodes[(cst.st_dev, cst.st_ino)] = Entry(child, kind, isdir)
                        if isdir and len(dirs) < MAX_TREE:
                            dirs.append((cfd, child))
                            queue.append((cfd, child))
                        else:
                            os.close(cfd)
                except OSError:
                    pass
                finally:
                    os.close(rfd)
            for dfd, dpath in dirs:
                fanotify_mark(self.fd, FAN_MARK_ADD, DIR_MASK, dfd, None)
                w.marked.append((dpath, DIR_MASK))
        finally:
            for dfd, _ in dirs:
                os.close(dfd)

    def remove(self, sid: str) -> None:
        """Drop the sandbox's marks (blocking: call from a thread, before its root is unmounted)."""
        w = self.sandboxes.pop(sid, None)
        if w is None or self.fd is None:
            return
        for host, mask in w.decoy_marked:
            try:
                fanotify_mark(self.fd, FAN_MARK_REMOVE, mask, AT_FDCWD, host)
            except OSError:
                pass
        try:
            rootfd = os.open(w.root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            for path, mask in w.marked:
                try:
                    fd = linux.openat2(rootfd, path, O_PATH | os.O_CLOEXEC, 0, RESOLVE)
                except OSError:
                    continue
                try:
                    fanotify_mark(self.fd, FAN_MARK_REMOVE, mask, fd, None)
                except OSError:
                    pass  # moved or replaced: the umount drops it
                finally:
                    os.close(fd)
        finally:
            os.close(rootfd)

    def check_read(self, sid: str, path: str) -> str | None:
        """For files.read: the protected path that `path` reaches (after the kernel's resolution
        inside the root, symlinks included), or None. Blocking (call from a thread)."""
        w = self.sandboxes.get(sid)
        if w is None or not w.protected:
            return None
        p = norm(path)
        for top in w.protected:
            if under(p, top):
                return top
        rootfd = os.open(w.root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd = linux.openat2(rootfd, p, O_PATH | os.O_CLOEXEC, 0, RESOLVE)
            except OSError:
                return None  # the read itself will fail the same way
            try:
                st = os.fstat(fd)
                e = w.inodes.get((st.st_dev, st.st_ino))
                if e is not None and e.kind == "protected":
                    return e.path
                real = os.readlink(f"/proc/self/fd/{fd}")
                rootreal = os.path.realpath(w.root)
                if real.startswith(rootreal + "/"):
                    inner = real[len(rootreal):]
                    for top in w.protected:
                        if under(inner, top):
                            return top
            finally:
                os.close(fd)
        finally:
            os.close(rootfd)
        return None

    def canary_of(self, sid: str, path: str) -> str | None:
        w = self.sandboxes.get(sid)
        if w is None:
            return None
        p = norm(path)
        return p if p in w.canaries else None

    # ------------------------------------------------------------------ events

    def _sandbox_of(self, pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                text = f.read()
        except OSError:
            return None
        for line in text.splitlines():
            for part in line.split(":", 2)[-1].split("/"):
                if part in self.sandboxes:
                    return part
        return None

    def drain(self) -> None:
        """Answer everything queued now (agent `audit` op: the grader's consistent point)."""
        if self.fd is not None:
            self.reader.drain(self.fd)

    def _handle(self, mask: int, efd: int, pid: int, _buf: bytes = b"", _start: int = 0, _end: int = 0, _now: float = 0.0) -> None:
        """Answer one permission event (the reader closes its fd after the answer)."""
        allow = True
        try:
            if efd == FAN_NOFD:
                if mask & FAN_Q_OVERFLOW and self.on_overflow is not None:
                    self.on_overflow(list(self.sandboxes))
                return
            try:
                st = os.fstat(efd)
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = None
            sid = None if pid == self.me else self._sandbox_of(pid)
            entry: Entry | None = None
            if key is not None:
                if sid is not None:
                    entry = self.sandboxes[sid].inodes.get(key)
                else:  # the agent itself, or a process we cannot place: the most restrictive match
                    for w in self.sandboxes.values():
                        e = w.inodes.get(key)
                        if e is not None and (entry is None or e.kind == "protected"):
                            entry = e
            if entry is None and sid is not None:
                entry = self._by_path(sid, efd)  # created under a protected directory after marking
            if entry is None:
                return  # not ours (a child of a marked dir created later and unprotected): allow
            allow = entry.kind != "protected"
            FILE_EVENTS.labels(self.node, entry.kind).inc()
            if pid != self.me and sid is not None:
                path = entry.path
                if entry.is_dir and not (mask & FAN_ONDIR):
                    path = self._path_of(sid, efd) or path
                try:
                    self.on_event(sid, pid, "canary" if entry.kind == "canary" else "file", path, not allow)
                except Exception:
                    log.exception("fanotify audit callback failed")
        finally:
            if self.fd is not None and efd != FAN_NOFD:
                try:
                    os.write(self.fd, RESPONSE.pack(efd, FAN_ALLOW if allow else FAN_DENY))
                except OSError:
                    pass  # the opener is gone (or the group closed): nothing waits for the answer

    def _path_of(self, sid: str, efd: int) -> str | None:
        w = self.sandboxes.get(sid)
        if w is None:
            return None
        try:
            real = os.readlink(f"/proc/self/fd/{efd}")
        except OSError:
            return None
        for prefix in (os.path.realpath(w.root), w.root):
            if real.startswith(prefix + "/"):
                return real[len(prefix):]
        return real if real.startswith("/") else None

    def _by_path(self, sid: str, efd: int) -> Entry | None:
        """A file under a protected directory that was created after the marks were set."""
        w = self.sandboxes.get(sid)
        inner = self._path_of(sid, efd)
        if w is None or inner is None:
            return None
        for top in w.protected:
            if under(inner, top):
                return Entry(inner, "protected")
        return None
