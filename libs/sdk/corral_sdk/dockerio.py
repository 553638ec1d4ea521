"""Images between corral and the local Docker Engine, from the SDK side (root, on a machine that
runs the image-cache, as the embedded stack does):

* `export_image(url, "debian")`: a corral image as a Docker image (`corral-image/debian:<tag>`
  unless named): its layers are fetched from the chunk store, mounted (EROFS) and stacked
  read-only, and the result is `docker import`ed as one layer.
* `import_docker_image(url, "python:3.12-slim")`: `docker save` to a temporary archive, then the
  image-cache imports it (`corral.v1.image.import`, source `docker_archive`): one EROFS layer per
  Docker layer. The archive path must be readable by the image-cache, so this works where the
  image-cache runs on the same machine."""
from __future__ import annotations

import os
import re
import tempfile

import nats
from nats.aio.client import Client as NATS

from corral_common import auth, config, dockerimg
from corral_common.contract import subjects
from corral_common.contract.envelope import decode_reply
from corral_common.contract.images import ImageManifest, ImportReply, ImportRequest
from corral_common.contract.messages import encoder


def corral_name(docker_ref: str) -> str:
    """A corral image name for a Docker reference: `library/python:3.12` -> `library-python-3.12`."""
    n = re.sub(r"[^a-z0-9._-]+", "-", docker_ref.lower()).strip("-._")
    return (n or "docker-image")[:128]


async def _connect(nats_url: str | None) -> NATS:
    url = config.nats_url(nats_url)
    return await nats.connect(auth.servers(url), **auth.connect_options(url))


async def export_image(nats_url: str | None, name: str, ref: str | None = None) -> str:
    nc = await _connect(nats_url)
    try:
        return await dockerimg.export_to_docker(nc.jetstream(), name, ref)
    finally:
        await nc.close()


async def import_docker_image(nats_url: str | None, docker_ref: str, name: str | None = None,
                              labels: dict[str, str] | None = None, timeout: float = 1800) -> ImageManifest:
    name = name or corral_name(docker_ref)
    docker = await dockerimg.connect()
    fd, path = tempfile.mkstemp(prefix="corral-docker-save-", suffix=".tar")
    os.close(fd)
    try:
        await dockerimg.save_image(docker, docker_ref, path)
        os.chmod(path, 0o644)
        nc = await _connect(nats_url)
        try:
            req = ImportRequest(name=name, source="docker_archive", path=path, labels={"docker_image": docker_ref, **(labels or {})})
            msg = await nc.request(subjects.IMAGE_IMPORT, encoder.encode(req), timeout=timeout)
        finally:
            await nc.close()
        return decode_reply(msg.data, ImportReply).image
    finally:
        await docker.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
