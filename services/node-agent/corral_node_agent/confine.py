"""files.read / files.write inside a sandbox's root without ever reaching a host path.

Every path is resolved by the kernel with openat2(RESOLVE_IN_ROOT): `..` stops at the sandbox
root, absolute symlinks are taken relative to it, magic /proc links are refused. So an agent that
plants `ln -s /etc/shadow x` or `../../..` gets its own files, never the host's."""
from __future__ import annotations

import errno
import os
import stat

from corral_common import linux
from corral_common.contract.errors import Forbidden, InvalidRequest, NotFound

RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV
O_PATH = getattr(os, "O_PATH", 0o10000000)


def _fail(e: OSError, path: str) -> Exception:
    if e.errno == errno.ENOENT:
        return NotFound(f"no such file in the sandbox: {path}")
    if e.errno == errno.EISDIR:
        return InvalidRequest(f"{path} is a directory")
    if e.errno == errno.ENOTDIR:
        return InvalidRequest(f"a parent of {path} is not a directory")
    if e.errno in (errno.ELOOP, errno.EXDEV):
        return Forbidden(f"{path} resolves through a link that is not allowed (symlink loop, /proc magic link or another mount)")
    if e.errno == errno.ENOSPC:
        return InvalidRequest(f"no space left in the sandbox (disk_mb) while writing {path}")
    if e.errno == errno.ENXIO:
        return InvalidRequest(f"{path} is not a regular file")
    if e.errno in (errno.EACCES, errno.EPERM):
        return Forbidden(f"permission denied: {path}")
    return InvalidRequest(f"cannot access {path}: {os.strerror(e.errno or 0)}")


def _check_path(path: str) -> str:
    if "\0" in path:
        raise InvalidRequest("path contains a NUL byte")
    return path if path.startswith("/") else "/" + path


def read(root: str, path: str, max_bytes: int) -> tuple[bytes, int]:
    path = _check_path(path)
    rootfd = os.open(root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = linux.openat2(rootfd, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, 0, RESOLVE)
        except OSError as e:
            raise _fail(e, path) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise InvalidRequest(f"{path} is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"{path} is not a regular file")
            if st.st_size > max_bytes:
                raise InvalidRequest(f"{path} is {st.st_size} bytes, more than max_bytes={max_bytes}")
            chunks = []
            left = max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise InvalidRequest(f"{path} is larger than max_bytes={max_bytes}")
            return data, stat.S_IMODE(st.st_mode)
        finally:
            os.close(fd)
    finally:
        os.close(rootfd)


def write(root: str, path: str, data: bytes, mode: int, make_parents: bool) -> None:
    path = _check_path(path)
    parts = [p for p in path.split("/") if p and p != "."]
    if not parts or parts[-1] == "..":
        raise InvalidRequest(f"{path} does not name a file")
    rootfd = os.open(root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if make_parents:
            _ensure_dirs(rootfd, parts[:-1])
        try:
            fd = linux.openat2(rootfd, path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, mode, RESOLVE)
        except OSError as e:
            raise _fail(e, path) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InvalidRequest(f"{path} is not a regular file")
            os.ftruncate(fd, 0)
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as e:
                    raise _fail(e, path) from None
                view = view[n:]
        finally:
            os.close(fd)
    finally:
        os.close(rootfd)


def _ensure_dirs(rootfd: int, parts: list[str]) -> None:
    for i in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:i])
        try:
            os.close(linux.openat2(rootfd, prefix, O_PATH | os.O_DIRECTORY, 0, RESOLVE))
            continue
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise _fail(e, prefix) from None
        parent = "/" + "/".join(parts[: i - 1])
        try:
            pfd = linux.openat2(rootfd, parent, O_PATH | os.O_DIRECTORY, 0, RESOLVE)
        except OSError as e:
            raise _fail(e, parent) from None
        try:
            os.mkdir(parts[i - 1], 0o755, dir_fd=pfd)
        except FileExistsError:
            pass
        except OSError as e:
            raise _fail(e, prefix) from None
        finally:
            os.close(pfd)


def mkdirs(root: str, path: str) -> None:
    """Create a directory (and its parents) inside the sandbox root."""
    parts = [p for p in _check_path(path).split("/") if p and p != "."]
    rootfd = os.open(root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _ensure_dirs(rootfd, parts)
    finally:
        os.close(rootfd)
