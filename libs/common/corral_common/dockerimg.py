"""Moving images between corral and a local Docker Engine (aiodocker), for the node-agent's
`docker` substrate and the CLI (`corral image export NAME --docker`, `corral image import-docker`).

corral -> Docker: an image's layers are EROFS filesystems; mounted and stacked read-only with
overlayfs they are the image's root, which `tar` streams into Docker's `images/create?fromSrc=-`
(what `docker import` does): one Docker layer. Docker -> corral: `docker save` (the engine's
`images/<name>/get`) writes an archive that the image-cache imports with source `docker_archive`,
one EROFS layer per Docker layer."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from . import extras, linux
from .contract.errors import Internal, InvalidRequest, NotFound, Unavailable

if TYPE_CHECKING:
    from aiodocker import Docker
    from nats.js import JetStreamContext

DEFAULT_HOST = "unix:///var/run/docker.sock"


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or DEFAULT_HOST


async def connect(url: str | None = None, timeout: float = 5.0) -> Docker:
    """An aiodocker client that answered `version`, or Unavailable saying why not."""
    aiodocker = extras.require("aiodocker", "docker", "Docker Engine access")

    host = url or docker_host()
    try:
        docker: Docker = aiodocker.Docker(url=host)
    except Exception as e:  # no socket at all
        raise Unavailable(f"Docker is not reachable at {host}: {e}") from None
    try:
        await asyncio.wait_for(docker.version(), timeout)
    except Exception as e:
        await docker.close()
        raise Unavailable(f"Docker is not reachable at {host}: {type(e).__name__}: {e}") from None
    return docker


def layers_tag(layers: list[str]) -> str:
    """A Docker tag naming exactly this list of corral layers (so an export is done once)."""
    return hashlib.sha256("\n".join(layers).encode()).hexdigest()[:16]


async def image_exists(docker: Docker, ref: str) -> bool:
    from aiodocker.exceptions import DockerError

    try:
        await docker.images.inspect(ref)
        return True
    except DockerError as e:
        if e.status == 404:
            return False
        raise


@contextlib.contextmanager
def merged_view(lowers: list[str], work_dir: str) -> Iterator[str]:
    """The read-only union of layer dirs (top first, as overlayfs wants them) at a temporary
    mount point; a single layer is used as it is."""
    if len(lowers) == 1:
        yield lowers[0]
        return
    mp = tempfile.mkdtemp(prefix="corral-merged-", dir=work_dir)
    try:
        linux.mount("overlay", mp, "overlay", linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV, f"lowerdir={':'.join(lowers)}")
        try:
            yield mp
        finally:
            linux.umount_or_detach(mp)
    finally:
        os.rmdir(mp)


async def _tar_stream(root: str) -> AsyncIterator[bytes]:
    p = await asyncio.create_subprocess_exec(
        "tar", "--numeric-owner", "--xattrs", "--warning=no-file-ignored", "-C", root, "-cf", "-", ".",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert p.stdout is not None
    try:
        while chunk := await p.stdout.read(1 << 20):
            yield chunk
    finally:
        err = await p.stderr.read() if p.stderr else b""
        rc = await p.wait()
        if rc not in (0, 1):  # 1: "file changed as we read it", harmless on a read-only tree
            raise Internal(f"tar of {root} failed: {err.decode(errors='replace')[-1000:]}")


async def import_tree(docker: Docker, root: str, ref: str, message: str = "") -> str:
    """`docker import` of a directory tree as image `ref` (repo:tag); returns the image id."""
    repo, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "latest")
    params = {"fromSrc": "-", "repo": repo, "tag": tag or "latest"}
    if message:
        params["message"] = message
    async with docker._query_chunked_post("images/create", "POST", params=params, data=_tar_stream(root),
                                          headers={"Content-Type": "application/x-tar"}, timeout=None) as resp:
        body = await resp.read()
    last: dict[str, Any] = {}
    for line in body.decode(errors="replace").splitlines():
        try:
            last = json.loads(line)
        except ValueError:
            continue
        if "error" in last:
            raise Internal(f"docker import of {ref} failed: {last['error']}")
    return str(last.get("status", ""))


async def save_image(docker: Docker, ref: str, path: str) -> int:
    """`docker save ref > path`; returns the archive's size."""
    from aiodocker.exceptions import DockerError

    n = 0
    try:
        async with docker.images.export_image(ref) as content:
            with open(path, "wb") as f:
                async for chunk in content.iter_chunked(1 << 20):
                    f.write(chunk)
                    n += len(chunk)
    except DockerError as e:
        if e.status == 404:
            raise NotFound(f"no Docker image {ref!r} (see `docker images`)") from None
        raise Unavailable(f"docker save {ref} failed: {e}") from None
    return n


async def fetch_layer_file(js: JetStreamContext, digest: str, path: str) -> None:
    """Assemble a layer's EROFS file from the chunk store (for hosts without a node loader)."""
    from .layers import Catalog, ObjectStoreBackend

    cat = await Catalog(js).open()
    m = await cat.layer(digest)
    backend = ObjectStoreBackend(js)
    with open(path, "wb") as f:
        for h in m.chunks:
            f.write(await backend.get(h))


async def export_to_docker(js: JetStreamContext, name: str, ref: str | None = None, work_dir: str | None = None,
                           docker: Docker | None = None) -> str:
    """corral image `name` -> Docker image `ref` (default `corral-image/<name>:<layers tag>`),
    fetching its layers from the chunk store and mounting them here (root). Returns the ref."""
    from .layers import Catalog, check_image_name

    check_image_name(name)
    cat = await Catalog(js).open()
    manifest = await cat.image(name)
    ref = ref or f"corral-image/{name}:{layers_tag(manifest.layers)}"
    own = docker is None
    docker = docker or await connect()
    tmp = tempfile.mkdtemp(prefix="corral-export-", dir=work_dir)
    mounted: list[str] = []
    try:
        lowers: list[str] = []
        for i, d in enumerate(manifest.layers):
            f = os.path.join(tmp, f"{i}.erofs")
            await fetch_layer_file(js, d, f)
            mp = os.path.join(tmp, f"l{i}")
            os.mkdir(mp)
            try:
                linux.mount(f, mp, "erofs", linux.MS_RDONLY)
            except OSError as e:
                raise InvalidRequest(f"cannot mount layer {d} (needs root and EROFS file-backed mounts): {e}") from None
            mounted.append(mp)
            lowers.insert(0, mp)
        with merged_view(lowers, tmp) as root:
            await import_tree(docker, root, ref, f"corral image {name}")
        return ref
    finally:
        for mp in reversed(mounted):
            linux.umount_or_detach(mp)
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            await docker.close()
