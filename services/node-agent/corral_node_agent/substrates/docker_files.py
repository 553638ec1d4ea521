"""Files in a `docker` sandbox through Docker's archive API (`HEAD`/`GET`/`PUT
/containers/<id>/archive`), which resolves paths inside the container's root; symlinks are
followed here, one hop at a time, each hop resolved by Docker again, so no path leaves the
container."""
from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
import time

from corral_common.contract.errors import Forbidden, Internal, InvalidRequest, NotFound

from .docker_sandbox import DockerSandbox, docker_error

# Go's os.FileMode bits, as Docker's archive stat reports them
GO_MODE_DIR, GO_MODE_SYMLINK = 1 << 31, 1 << 27
GO_MODE_TYPE = GO_MODE_DIR | GO_MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
GO_SETUID, GO_SETGID, GO_STICKY = 1 << 23, 1 << 22, 1 << 20


async def _stat(docker, sb: DockerSandbox, path: str) -> dict | None:
    from aiodocker.exceptions import DockerError

    # a HEAD's error has no body, which aiodocker's error parsing trips over: ask the session directly
    url = docker._canonicalize_url(f"containers/{sb.cid}/archive", versioned_api=True)
    try:
        async with docker.session.head(url, params={"path": path}) as resp:
            if resp.status == 404:
                return None
            if resp.status == 500:  # Docker could not evaluate the path in the container's root
                raise Forbidden(f"{path} resolves through a link that cannot be followed (a symlink loop?)")
            if resp.status // 100 != 2:
                raise docker_error(DockerError(resp.status, resp.headers.get("X-Docker-Container-Path-Stat", "") or resp.reason or ""),
                            f"stat {path}")
            hdr = resp.headers.get("X-Docker-Container-Path-Stat", "")
    except DockerError as e:
        raise docker_error(e, f"stat {path}") from None
    try:
        return json.loads(base64.b64decode(hdr))
    except ValueError:
        raise Internal(f"docker gave no stat for {path}") from None


async def _resolve(docker, sb: DockerSandbox, path: str) -> tuple[str, dict | None]:
    """Follow symlinks the way the sandbox would, each hop resolved by Docker inside the
    container's root (so `..` and absolute targets never leave it)."""
    path = _clean(path)
    for _ in range(40):
        st = await _stat(docker, sb, path)
        if st is None or not st.get("linkTarget") or not (int(st.get("mode", 0)) & GO_MODE_SYMLINK):
            return path, st
        target = st["linkTarget"]
        path = _clean(target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target))
    raise Forbidden(f"{path} resolves through too many symlinks")


async def read_file(docker, sb: DockerSandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
    """`Substrate.read_file` through `docker` (the aiodocker client)."""
    from aiodocker.exceptions import DockerError

    orig = path
    path, st = await _resolve(docker, sb, path)
    if st is None:
        raise NotFound(f"no such file in the sandbox: {orig}")
    mode = int(st.get("mode", 0))
    if mode & GO_MODE_DIR:
        raise InvalidRequest(f"{orig} is a directory")
    if mode & GO_MODE_TYPE:
        raise InvalidRequest(f"{orig} is not a regular file")
    if int(st.get("size", 0)) > max_bytes:
        raise InvalidRequest(f"{orig} is {st['size']} bytes, more than max_bytes={max_bytes}")
    try:
        tf = await sb.container.get_archive(path)
    except DockerError as e:
        raise docker_error(e, f"read {orig}") from None
    with tf:
        member = next((m for m in tf.getmembers() if m.isfile()), None)
        if member is None:
            raise InvalidRequest(f"{orig} is not a regular file")
        f = tf.extractfile(member)
        data = f.read(max_bytes + 1) if f else b""
    if len(data) > max_bytes:
        raise InvalidRequest(f"{orig} is larger than max_bytes={max_bytes}")
    return data, _perm(mode)


async def write_file(docker, sb: DockerSandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
    """`Substrate.write_file` through `docker`: one tar of the file and its missing parents."""
    from aiodocker.exceptions import DockerError

    if "\0" in path:
        raise InvalidRequest("path contains a NUL byte")
    parts = [p for p in _clean(path).split("/") if p]
    if not parts or parts[-1] == "..":
        raise InvalidRequest(f"{path} does not name a file")
    target, st = await _resolve(docker, sb, "/" + "/".join(parts))
    if st is not None and int(st.get("mode", 0)) & GO_MODE_DIR:
        raise InvalidRequest(f"{path} is a directory")
    parent, base = posixpath.split(target)
    missing: list[str] = []
    anchor = parent
    while True:
        pst = await _stat(docker, sb, anchor)
        if pst is not None:
            if not int(pst.get("mode", 0)) & GO_MODE_DIR:
                raise InvalidRequest(f"a parent of {path} is not a directory")
            break
        if not make_parents:
            raise NotFound(f"the directory of {path} does not exist in the sandbox")
        anchor, name = posixpath.split(anchor)
        missing.insert(0, name)
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        prefix = ""
        for d in missing:
            prefix = f"{prefix}{d}/"
            ti = tarfile.TarInfo(prefix.rstrip("/"))
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, now
            tf.addfile(ti)
        ti = tarfile.TarInfo(prefix + base)
        ti.size, ti.mode, ti.mtime = len(data), mode, now
        tf.addfile(ti, io.BytesIO(data))
    try:
        await sb.container.put_archive(anchor or "/", buf.getvalue())
    except DockerError as e:
        if "no space" in str(e.message).lower():
            raise InvalidRequest(f"no space left in the sandbox while writing {path}") from None
        if e.status == 500:  # Docker's untar failed: a Docker-managed bind mount, permissions, ...
            raise InvalidRequest(f"cannot write {path} in the sandbox: {e.message}") from None
        raise docker_error(e, f"write {path}") from None


def _perm(mode: int) -> int:
    return (mode & 0o777) | (0o4000 if mode & GO_SETUID else 0) | (0o2000 if mode & GO_SETGID else 0) | (0o1000 if mode & GO_STICKY else 0)


def _clean(path: str) -> str:
    p = posixpath.normpath("/" + path.lstrip("/"))
    return "/" + p.lstrip("/")
