"""The `docker` substrate: Docker Engine through aiodocker, for users with Docker images.

`SandboxSpec.image` is a local Docker image (`docker images`); a name that Docker lacks but
corral's catalog has (`busybox`, `debian`, snapshots, ...) is exported to Docker once, from the
node's layer mounts, as `corral-image/<name>:<layers tag>`.

Limits and isolation, as close to `container` as Docker allows: `NanoCpus`, `Memory` (= swap:
no swap), `PidsLimit`, network `none`, every capability dropped, no-new-privileges, corral's
seccomp profile (the one `container` uses) instead of Docker's default, Docker's masked /proc
paths, tini (`--init`) as PID 1 reaping orphans. The container's writable layer is Docker's
overlay2 upper on a tmpfs of `disk_mb` mounted between create and start (docker_disk.py says why
not `--storage-opt size=`): writes past it fail with ENOSPC, as on `container`.

Exec is `docker exec` moved into a per-exec cgroup before the command starts (docker_exec.py);
files go through Docker's archive API (docker_files.py). Snapshots are `docker commit`, then
`docker save` and an image-cache import (`source: docker_archive`): the result is a Docker image
(`corral-snapshot/<name>:latest`) and a layered corral image of the same name.

Containers carry labels `corral.node`, `corral.state` (a hash of the state dir, so two stacks
on one host never touch each other's) and `corral.sandbox`; a restarted node-agent adopts the
running ones it has records for and removes the rest."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from typing import Any

import msgspec

from corral_common import dockerimg
from corral_common.contract import subjects
from corral_common.contract.errors import CorralError, Internal, InvalidRequest, NotFound, Unavailable
from corral_common.contract.labels import DOCKER_JOB, DOCKER_NODE, DOCKER_SANDBOX, DOCKER_STATE, DOCKER_USER_PREFIX
from corral_common.contract.messages import ChangesReply, ChangesRequest, ExecRequest, ExecResult, SandboxInfo, SandboxSpec
from corral_common.layers import ImageManifest, LayerManifest, check_image_name

from .. import cgroups, oci
from ..layermounts import LayerMounts
from . import docker_disk, docker_files
from .base import AdoptReport, ChunkCallback, Sandbox, Substrate, Usage
from .common import IO_MOUNT, adopt_exec_groups, load_record, make_io_dir, save_record, unwatch_pidfd, watch_pidfd
from .docker_exec import close_session, exec_in
from .docker_sandbox import DockerSandbox, Record, cgroup_rel, docker_error

log = logging.getLogger("corral.node.docker")
PAUSE_STATE_WAIT_S = 5.0  # how long a pause or resume waits for dockerd to report the new state


class DockerSubstrate(Substrate):
    name = "docker"
    uses_catalog = False
    snapshots_itself = True

    def __init__(self, node: str, state_dir: str, layers: LayerMounts, url: str | None = None):
        self.node = node
        self.state_dir = state_dir
        self.dir = f"{state_dir}/docker"
        self.layers = layers
        self.url = url or dockerimg.docker_host()
        self.tag = hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:8]
        self.docker = None
        self.seccomp = json.dumps(oci.seccomp_profile())
        self.export_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        try:
            self.docker = await dockerimg.connect(self.url)
        except Unavailable as e:
            raise SystemExit(f"node-agent: substrate 'docker' is enabled but {e.message}. Start dockerd "
                             f"(e.g. `dockerd &`, or set DOCKER_HOST) or run without `--substrate docker`.") from None
        if os.geteuid() != 0:
            raise SystemExit("node-agent: substrate 'docker' needs root (per-exec cgroups, layer mounts)")
        self.docker_layers = docker_disk.layers_dir(await self.docker.system.info())
        os.makedirs(self.dir, exist_ok=True)

    def _labels(self, sid: str, spec: SandboxSpec) -> dict[str, str]:
        return {DOCKER_NODE: self.node, DOCKER_STATE: self.tag, DOCKER_SANDBOX: sid, DOCKER_JOB: spec.job,
                **{f"{DOCKER_USER_PREFIX}{k}": v for k, v in spec.labels.items()}}

    # ------------------------------------------------------------------ images

    async def _resolve_image(self, image: str) -> str:
        from aiodocker.exceptions import DockerError

        try:
            if await dockerimg.image_exists(self.docker, image):
                return image
        except DockerError as e:
            if e.status == 400:
                raise InvalidRequest(f"invalid Docker image reference {image!r}: {e.message}") from None
            raise Unavailable(f"Docker could not look up image {image!r}: {e.message}") from None
        try:
            check_image_name(image)
            manifest = await self.layers.catalog.image(image)
        except (InvalidRequest, NotFound):
            raise NotFound(f"no Docker image {image!r} on node {self.node} (see `docker images`; import one with "
                           f"`docker import` or `docker load`), and no corral image of that name") from None
        ref = f"corral-image/{image}:{dockerimg.layers_tag(manifest.layers)}"
        async with self.export_locks.setdefault(ref, asyncio.Lock()):
            if await dockerimg.image_exists(self.docker, ref):
                return ref
            t0 = time.perf_counter()
            lowers, layers = await self.layers.acquire(image)
            try:
                with dockerimg.merged_view(lowers, self.dir) as root:
                    await dockerimg.import_tree(self.docker, root, ref, f"corral image {image}")
            finally:
                await self.layers.release(layers)
            log.info("exported corral image to docker", extra={"fields": {"image": image, "ref": ref,
                                                                            "seconds": round(time.perf_counter() - t0, 2)}})
        return ref

    # ------------------------------------------------------------------ lifecycle

    async def create(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        from aiodocker.exceptions import DockerError

        ref = await self._resolve_image(spec.image)
        sid = info.id
        sdir = f"{self.dir}/{sid}"
        make_io_dir(f"{sdir}/io")
        cfg: dict[str, Any] = {
            "Image": ref,
            "Entrypoint": ["/bin/sh"],  # reads its (open, never written) stdin forever: the sandbox stays up
            "Cmd": [],
            "OpenStdin": True,
            "StdinOnce": False,
            "Tty": False,
            "Hostname": sid,
            "WorkingDir": spec.workdir or "/",
            "Env": [f"{k}={v}" for k, v in spec.env.items()],
            "Labels": self._labels(sid, spec),
            "NetworkDisabled": True,
            "HostConfig": {
                "Init": True,
                "NetworkMode": "none",
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges", f"seccomp={self.seccomp}"],
                "NanoCpus": int(spec.cpu * 1e9),
                "Memory": spec.memory_mb << 20,
                "MemorySwap": spec.memory_mb << 20,
                "PidsLimit": spec.pids_max,
                "Ulimits": [{"Name": r["type"].removeprefix("RLIMIT_").lower(), "Soft": r["soft"], "Hard": r["hard"]}
                            for r in oci.rlimits()],
                "Binds": [f"{sdir}/io:{IO_MOUNT}:ro"],
                "ReadonlyRootfs": False,
                "AutoRemove": False,
                "RestartPolicy": {"Name": "no"},
            },
        }
        container = None
        layer = ""
        try:
            container = await self.docker.containers.create(cfg, name=f"corral-{self.tag}-{sid}")
            sb = DockerSandbox(info, spec, container, container.id, sdir, ref)
            shown = await container.show()
            layer = docker_disk.layer_of(shown["GraphDriver"]["Data"]["UpperDir"], self.docker_layers)
            await asyncio.to_thread(docker_disk.cap, layer, spec.disk_mb)
            sb.layer_dir = layer
            self._persist(sb)
            await container.start()
            await self._attach(sb)
            return sb
        except BaseException as e:
            if container is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(container.delete(force=True, v=True))
                with contextlib.suppress(Exception):
                    docker_disk.release(layer)
            shutil.rmtree(sdir, ignore_errors=True)
            if isinstance(e, DockerError):
                raise docker_error(e, f"create of docker sandbox {sid}") from None
            raise

    async def _attach(self, sb: DockerSandbox) -> None:
        """Learn the container's init pid and cgroup (for pidfd exit watching, exec cgroups, usage)."""
        info = await sb.container.show()
        pid = int(info["State"].get("Pid") or 0)
        if not pid:
            raise Internal(f"docker sandbox {sb.id} is not running: {info['State'].get('Error') or info['State'].get('Status')}")
        sb.init_pid = pid
        sb.merged = str(((info.get("GraphDriver") or {}).get("Data") or {}).get("MergedDir") or "")
        sb.paused = bool(info["State"].get("Paused"))
        sb.cg = cgroups.Cgroups(cgroup_rel(pid))
        try:
            sb.pidfd = os.pidfd_open(pid)
        except OSError:
            sb.pidfd = None

    def audit_root(self, sb: Sandbox) -> str | None:
        """Docker's overlay2 merged dir (its own overlay superblock per container). Docker mounts it
        without nfs_export, so fanotify watches it in fd mode: opens, writes, execs with paths, but
        no create/unlink/rename events (audit/files.py)."""
        assert isinstance(sb, DockerSandbox)
        return sb.merged if sb.merged and os.path.ismount(sb.merged) else None

    def _persist(self, sb: DockerSandbox) -> None:
        save_record(sb.sdir, Record(info=sb.info, spec=sb.spec, container_id=sb.cid, image_ref=sb.image_ref,
                                    layer_dir=sb.layer_dir))

    def watch_exit(self, sb: Sandbox, callback) -> None:
        assert isinstance(sb, DockerSandbox)
        watch_pidfd(sb, callback)

    async def destroy(self, sb: Sandbox) -> None:
        assert isinstance(sb, DockerSandbox)
        pidfd = unwatch_pidfd(sb)
        if pidfd is not None:
            os.close(pidfd)
        for name in list(sb.sessions):
            close_session(sb, name)
        await self._remove(sb.container, sb.cg)
        await asyncio.to_thread(docker_disk.release, sb.layer_dir)
        shutil.rmtree(sb.sdir, ignore_errors=True)

    async def _remove(self, container, cg: cgroups.Cgroups | None) -> None:
        from aiodocker.exceptions import DockerError

        try:
            await container.delete(force=True, v=True)
        except DockerError as e:
            if e.status != 404:
                raise docker_error(e, "remove") from None
        if cg is not None:  # our exec sub-cgroups, should runc have left the container's dir for them
            await asyncio.to_thread(_sweep_cgroup, cg)

    # ------------------------------------------------------------------ exec


    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
        assert isinstance(sb, DockerSandbox)
        return await exec_in(sb, req, on_chunk)

    # ------------------------------------------------------------------ files


    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
        assert isinstance(sb, DockerSandbox)
        return await docker_files.read_file(self.docker, sb, path, max_bytes)

    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        assert isinstance(sb, DockerSandbox)
        await docker_files.write_file(self.docker, sb, path, data, mode, make_parents)

    # ------------------------------------------------------------------ pause / usage / snapshot

    async def pause(self, sb: Sandbox) -> None:
        await self._set_paused(sb, True)

    async def resume(self, sb: Sandbox) -> None:
        await self._set_paused(sb, False)

    async def _set_paused(self, sb: Sandbox, paused: bool) -> None:
        """`docker pause` / `unpause` (the cgroup freezer), a no-op when already so."""
        from aiodocker.exceptions import DockerError

        assert isinstance(sb, DockerSandbox)
        if sb.paused == paused:
            return
        try:
            await (sb.container.pause() if paused else sb.container.unpause())
            # dockerd answers once containerd has frozen or thawed the cgroup, but sets the
            # container's Paused state from containerd's event afterwards: an exec in between is
            # refused as "paused" (cc34). Answer once dockerd itself says so.
            deadline = time.monotonic() + PAUSE_STATE_WAIT_S
            while (await sb.container.show())["State"].get("Paused") != paused and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        except DockerError as e:
            raise docker_error(e, f"{'pause' if paused else 'resume'} {sb.id}") from None
        sb.paused = paused

    async def changes(self, sb: Sandbox, req: ChangesRequest) -> ChangesReply:
        """Docker's overlay2 upper (`diff`) is on the tmpfs this substrate mounted over the
        container's layer (docker_disk.py), on this host: walked host-side like `container`'s,
        frozen with `docker pause`. (Docker's own `GET /containers/<id>/changes` knows no opaque
        directories and its archive API reads through the merged view.)"""
        assert isinstance(sb, DockerSandbox)
        if not sb.layer_dir:
            raise InvalidRequest(f"sandbox {sb.id}: its Docker writable layer is not known to this node-agent")
        return await self.frozen_changes(sb, f"{sb.layer_dir}/diff", req)

    async def usage(self, sb: Sandbox) -> Usage:
        assert isinstance(sb, DockerSandbox)
        if sb.cg is None:
            return Usage()
        return Usage(cpu_ns=sb.cg.cpu_usage_ns(), memory_bytes=sb.cg.memory_bytes(), pids=sb.cg.pids_current())

    async def snapshot_image(self, sb: Sandbox, name: str, labels: dict[str, str]) -> tuple[ImageManifest, LayerManifest, int]:
        """`docker commit` (the container paused meanwhile), then `docker save` and an image-cache
        import of the archive, so the snapshot is a Docker image and a layered corral image."""
        from aiodocker.exceptions import DockerError

        assert isinstance(sb, DockerSandbox)
        check_image_name(name)
        repo = f"corral-snapshot/{name}"
        try:
            await sb.container.commit(repository=repo, tag="latest", pause=not sb.paused,
                                      message=f"corral snapshot of {sb.id}")
        except DockerError as e:
            raise docker_error(e, f"commit {sb.id}") from None
        ref = f"{repo}:latest"
        path = f"{self.dir}/save-{name}-{secrets.token_hex(4)}.tar"
        try:
            await dockerimg.save_image(self.docker, ref, path)
            body = {"name": name, "source": "docker_archive", "path": path,
                    "labels": {**labels, "snapshot_of": sb.id, "docker_image": ref}}
            try:
                msg = await self.layers.nc.request(subjects.IMAGE_IMPORT, json.dumps(body).encode(), timeout=900)
            except Exception as e:
                raise Unavailable(f"committed {sb.id} as Docker image {ref}, but the image-cache did not import it: {e}") from None
            r = json.loads(msg.data)
            if not r.get("ok"):
                err = r.get("error") or {}
                raise CorralError(f"committed {sb.id} as Docker image {ref}, but the import into corral failed: "
                                  f"{err.get('message')}", Unavailable.code)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        image = msgspec.convert(r["image"], ImageManifest)
        top = await self.layers.catalog.layer(image.layers[-1])
        return image, top, int(r.get("uploaded_bytes", 0))

    # ------------------------------------------------------------------ crash recovery, shutdown

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        report = AdoptReport()
        adopted: list[Sandbox] = []
        filters = json.dumps({"label": [f"{DOCKER_NODE}={self.node}", f"{DOCKER_STATE}={self.tag}"]})
        containers = await self.docker.containers.list(all=True, filters=filters)
        seen: set[str] = set()
        for c in containers:
            labels = c._container.get("Labels") or {}
            sid = labels.get(DOCKER_SANDBOX, "")
            seen.add(sid)
            sdir = f"{self.dir}/{sid}"
            rec = load_record(f"{sdir}/sandbox.json", Record)
            running = c._container.get("State") in ("running", "paused")
            if rec is not None and running and rec.container_id == c.id:
                sb = DockerSandbox(rec.info, rec.spec, c, c.id, sdir, rec.image_ref)
                sb.layer_dir = rec.layer_dir
                try:
                    await self._attach(sb)
                except CorralError:
                    pass
                else:
                    if sb.cg is not None:
                        adopt_exec_groups(sb.cg, sb.lingering)
                    adopted.append(sb)
                    report.adopted.append(sid)
                    continue
            await self._remove(c, None)
            if rec is not None:
                docker_disk.release(rec.layer_dir)
            shutil.rmtree(sdir, ignore_errors=True)
            report.cleaned.append(sid or c.id[:12])
        for sid in os.listdir(self.dir) if os.path.isdir(self.dir) else []:
            p = f"{self.dir}/{sid}"
            if sid in seen or not os.path.isdir(p):
                continue
            shutil.rmtree(p, ignore_errors=True)
            report.cleaned.append(sid)
            report.notes.append(f"docker sandbox {sid} had a record but no container")
        return adopted, report

    async def close(self) -> None:
        if self.docker is not None:
            await self.docker.close()


# ---------------------------------------------------------------------- helpers


def _sweep_cgroup(cg: cgroups.Cgroups) -> None:
    for top in cg.all_dirs():
        cgroups.rmtree_cgroup(top)
