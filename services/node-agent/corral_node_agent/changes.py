"""What a sandbox changed: its overlay upper directory, read on the host (`corral.v1.sandbox.<id>.changes`).

The grader learns from this what an agent changed and carries only the changes inside an
environment's solution surface into a fresh grading sandbox, so nothing inside the sandbox (tar,
ls, a shell) may take part: the sandbox is hostile. The caller freezes the sandbox; this module
walks the upper directory host-side with directory fds only (`openat` with O_NOFOLLOW, `lstat`
relative to the parent fd), so a name the agent chose, or a rename racing the walk from a process
the freezer missed, can never lead the agent-side reader out of the upper directory.

Overlay format of the upper (overlayfs(5)): a character device 0/0 is a whiteout (the image's
path was removed: kind "deleted"); a directory with xattr `trusted.overlay.opaque` = "y" replaced
the image's directory of that name (nothing of the image's remains below it: `opaque`).

Paths are bytes on disk. The listing names them as text: UTF-8 where they are valid UTF-8,
otherwise each undecodable byte as `\\xNN` (backslashreplace); the archive keeps the real bytes."""
from __future__ import annotations

import base64
import errno
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterator

from corral_common.contract.errors import InvalidRequest
from corral_common.contract.messages import Change, ChangesReply, ChangesRequest

OPAQUE_XATTR = "trusted.overlay.opaque"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
MAX_DEPTH = 256  # deeper trees are listed down to here (a tmpfs allows arbitrary depth)
CHUNK = 1 << 20


def norm_paths(paths: list[str], what: str) -> list[str]:
    """Absolute, normalised paths (`/a//b/../c/` -> `/a/c`); NUL bytes are refused."""
    out = []
    for p in paths:
        if "\0" in p:
            raise InvalidRequest(f"{what} path {p!r} contains a NUL byte")
        if not p.startswith("/"):
            raise InvalidRequest(f"{what} path {p!r} is not absolute")
        out.append("/" + posixpath.normpath(p).lstrip("/"))
    return out


def under(path: str, prefixes: list[str]) -> bool:
    return any(top == "/" or path == top or path.startswith(top + "/") for top in prefixes)


def shown(raw: str) -> str:
    """A path as the listing names it: valid UTF-8 as is, other bytes as `\\xNN`."""
    return os.fsencode(raw).decode("utf-8", "backslashreplace")


class Packer:
    """A gzip'd tar built member by member, never past `limit` bytes compressed.

    Before each member the compressor's state is copied; after it, a copy of the new state is
    finished (end-of-archive blocks, gzip trailer) to learn the exact size the archive would have
    if it ended there. A member that would pass the limit is undone (the saved state restored)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.comp = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: gzip wrapper
        self.out = bytearray()
        self.count = 0

    def add(self, info: tarfile.TarInfo, chunks: Iterator[bytes]) -> bool:
        saved, mark = self.comp.copy(), len(self.out)
        ok = True
        try:
            self.out += self.comp.compress(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            n = 0
            for data in chunks:
                n += len(data)
                self.out += self.comp.compress(data)
                if len(self.out) > self.limit:  # already past it, whatever the finish adds
                    ok = False
                    break
            if ok and n != info.size:
                raise OSError(errno.EIO, "file changed size while it was read")
            if ok and n % tarfile.BLOCKSIZE:
                self.out += self.comp.compress(b"\0" * (tarfile.BLOCKSIZE - n % tarfile.BLOCKSIZE))
            ok = ok and len(self.out) + len(self._finish(self.comp.copy())) <= self.limit
        except BaseException:
            self.comp, self.out[mark:] = saved, b""
            raise
        if not ok:
            self.comp, self.out[mark:] = saved, b""
            return False
        self.count += 1
        return True

    @staticmethod
    def _finish(comp) -> bytes:
        return comp.compress(b"\0" * (2 * tarfile.BLOCKSIZE)) + comp.flush()

    def archive(self) -> bytes:
        if not self.count:
            return b""
        return bytes(self.out) + self._finish(self.comp)


def _read_chunks(fd: int, size: int) -> Iterator[bytes]:
    left = size
    while left > 0:
        data = os.read(fd, min(CHUNK, left))
        if not data:
            return
        left -= len(data)
        yield data


def list_changes(upper: str, req: ChangesRequest) -> ChangesReply:
    """Walk the upper directory at `upper` (host path; the sandbox frozen by the caller) and pack
    the regular files and symlinks under `req.include`. Owners are reported as stored, which is
    as the sandbox sees them: a container's upper keeps its own uids on disk (it sees it through
    an idmapped mount, userns.py), Docker's without userns-remap too. Blocking: run it in a thread."""
    include = norm_paths(req.include, "include")
    exclude = norm_paths(req.exclude, "exclude")
    reply = ChangesReply()
    packer = Packer(req.max_archive_bytes)
    top = os.open(upper, DIR_FLAGS)
    try:
        _walk(top, "", 0, include, exclude, req, reply, packer)
    finally:
        os.close(top)
    reply.archive_b64 = base64.b64encode(packer.archive()).decode()
    reply.packed = packer.count
    return reply


def _walk(dfd: int, prefix: str, depth: int, include: list[str], exclude: list[str], req: ChangesRequest,
          reply: ChangesReply, packer: Packer) -> None:
    with os.scandir(dfd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        if reply.truncated:
            return
        path = f"{prefix}/{name}"
        if exclude and under(path, exclude):
            continue
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            continue  # removed by a process the freezer had not stopped yet
        if len(reply.changes) >= req.max_entries:
            reply.truncated = True
            return
        mode, uid = stat.S_IMODE(st.st_mode), st.st_uid
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # replaced meanwhile
                raise
            try:
                try:
                    opaque = os.getxattr(sub, OPAQUE_XATTR) == b"y"
                except OSError:
                    opaque = False
                reply.changes.append(Change(path=shown(path), kind="dir", mode=mode, opaque=opaque, uid=uid))
                if depth < MAX_DEPTH:
                    _walk(sub, path, depth + 1, include, exclude, req, reply, packer)
                else:
                    reply.truncated = True
            finally:
                os.close(sub)
        elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            reply.changes.append(Change(path=shown(path), kind="deleted"))
        elif stat.S_ISREG(st.st_mode):
            reply.changes.append(Change(path=shown(path), kind="file", size=st.st_size, mode=mode, uid=uid))
            if include and under(path, include):
                _pack_file(dfd, name, path, packer, reply)
        elif stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                continue
            reply.changes.append(Change(path=shown(path), kind="symlink", mode=mode, target=shown(target), uid=uid))
            if include and under(path, include):
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, mode, int(st.st_mtime)
                if not packer.add(info, iter(())):
                    reply.too_large.append(shown(path))
        else:  # fifo, socket, a device other than a whiteout: listed, never packed
            reply.changes.append(Change(path=shown(path), kind="other", mode=mode, uid=uid))


def _pack_file(dfd: int, name: str, path: str, packer: Packer, reply: ChangesReply) -> None:
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return  # replaced by a symlink or removed meanwhile (O_NOFOLLOW: ELOOP)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode, info.mtime = st.st_size, stat.S_IMODE(st.st_mode), int(st.st_mtime)
        if not packer.add(info, _read_chunks(fd, st.st_size)):
            reply.too_large.append(shown(path))
    finally:
        os.close(fd)
