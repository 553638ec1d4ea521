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

Exec is `docker exec` with a small `/bin/sh` wrapper that waits for one line on stdin before it
`exec`s the command: in that moment the node-agent moves it into a fresh child cgroup of the
container's (pids + freezer, like the container substrate's per-exec groups), so a timeout
freezes and kills exactly that exec's processes, daemonised or not. Then the caller's stdin
follows and is closed. The exec ends when its process exits (a pidfd on its host pid), not when
Docker closes the stream, so a background child that keeps stdout open does not hold it.
Sessions reuse sessions.py over one such exec running `/bin/sh`, its stdio bridged through pipes;
scripts reach it through a host directory bind-mounted read-only at /.corral/io.

Files go through Docker's archive API (`HEAD`/`GET`/`PUT /containers/<id>/archive`), which
resolves paths inside the container's root; symlinks are followed here, one hop at a time, each
hop resolved by Docker again, so no path leaves the container. Snapshots are `docker commit`, then
`docker save` and an image-cache import (`source: docker_archive`): the result is a Docker image
(`corral-snapshot/<name>:latest`) and a layered corral image of the same name.

Containers carry labels `corral.node`, `corral.state` (a hash of the state dir, so two stacks
on one host never touch each other's) and `corral.sandbox`; a restarted node-agent adopts the
running ones it has records for and removes the rest."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import posixpath
import secrets
import shutil
import signal
import tarfile
import time
from typing import Any

import msgspec

from corral_common import dockerimg
from corral_common.contract import subjects
from corral_common.contract.errors import Conflict, CorralError, Forbidden, Internal, InvalidRequest, NotFound, Unavailable
from corral_common.contract.labels import DOCKER_JOB, DOCKER_NODE, DOCKER_SANDBOX, DOCKER_STATE, DOCKER_USER_PREFIX
from corral_common.contract.messages import ChangesReply, ChangesRequest, ExecRequest, ExecResult, SandboxInfo, SandboxSpec
from corral_common.layers import ImageManifest, LayerManifest, check_image_name

from .. import cgroups, oci
from ..aio import wait_readable as _wait_readable
from ..layermounts import LayerMounts
from ..output import Capture
from ..sessions import Session
from . import docker_disk
from .base import AdoptReport, ChunkCallback, Sandbox, Substrate, Usage
from .common import IO_MOUNT, StayingSandbox, adopt_exec_groups, load_record, result_stderr, save_record, session_exec, unwatch_pidfd, watch_pidfd

log = logging.getLogger("corral.node.docker")

# waits for the go-ahead line (sent once the node-agent has moved it into its exec cgroup), then
# becomes the command; a missing command gets the container substrate's message and code
WRAPPER = ('read -r _ || exit 125; command -v -- "$1" >/dev/null 2>&1 || '
           '{ printf "corral: cannot run %s: No such file or directory\\n" "$1" >&2; exit 127; }; exec "$@"')
# Go's os.FileMode bits, as Docker's archive stat reports them
GO_MODE_DIR, GO_MODE_SYMLINK = 1 << 31, 1 << 27
GO_MODE_TYPE = GO_MODE_DIR | GO_MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
GO_SETUID, GO_SETGID, GO_STICKY = 1 << 23, 1 << 22, 1 << 20


class Record(msgspec.Struct, kw_only=True):
    info: SandboxInfo
    spec: SandboxSpec
    container_id: str
    image_ref: str
    layer_dir: str = ""  # the overlay2 layer dir whose tmpfs caps the writable layer (disk_mb)


class DockerSandbox(StayingSandbox):
    def __init__(self, info: SandboxInfo, spec: SandboxSpec, container, cid: str, sdir: str, image_ref: str):
        super().__init__(info, spec, sdir, None)  # cg and pidfd: from _attach, once it runs
        self.container = container
        self.cid = cid
        self.image_ref = image_ref
        self.init_pid = 0
        self.merged = ""  # the container's overlay2 merged dir (file-activity audit)
        self.session_links: dict[str, _Bridge] = {}
        self.layer_dir = ""


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
        os.makedirs(f"{sdir}/io", mode=0o755)
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
                raise _derr(e, f"create of docker sandbox {sid}") from None
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
        sb.cg = cgroups.Cgroups(_cgroup_rel(pid))
        try:
            sb.pidfd = os.pidfd_open(pid)
        except OSError:
            sb.pidfd = None

    def audit_root(self, sb: Sandbox) -> str | None:
        """Docker's overlay2 merged dir (its own overlay superblock per container). Docker mounts it
        without nfs_export, so fanotify watches it in fd mode: opens, writes, execs with paths, but
        no create/unlink/rename events (audit_files.py)."""
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
            self._close_session(sb, name)
        await self._remove(sb.container, sb.cg)
        await asyncio.to_thread(docker_disk.release, sb.layer_dir)
        shutil.rmtree(sb.sdir, ignore_errors=True)

    async def _remove(self, container, cg: cgroups.Cgroups | None) -> None:
        from aiodocker.exceptions import DockerError

        try:
            await container.delete(force=True, v=True)
        except DockerError as e:
            if e.status != 404:
                raise _derr(e, "remove") from None
        if cg is not None:  # our exec sub-cgroups, should runc have left the container's dir for them
            await asyncio.to_thread(_sweep_cgroup, cg)

    # ------------------------------------------------------------------ exec

    async def _start(self, sb: DockerSandbox, argv: list[str], env: dict[str, str], cwd: str | None):
        """Start the wrapped command; returns (exec, stream, host pid) with the wrapper waiting for
        its go-ahead line, or (exec, stream, 0) when Docker could not start it at all."""
        from aiodocker.exceptions import DockerError

        try:
            ex = await sb.container.exec(["/bin/sh", "-c", WRAPPER, "corral-exec", *argv], stdin=True, stdout=True, stderr=True,
                                         environment=env, workdir=cwd)
            stream = ex.start(detach=False)
            await stream._init()
            deadline = time.monotonic() + 30
            delay = 0.001
            while True:
                info = await ex.inspect()
                if info.get("Pid"):
                    return ex, stream, int(info["Pid"])
                if not info.get("Running") and info.get("ExitCode") is not None:
                    return ex, stream, 0
                if time.monotonic() > deadline:
                    await stream.close()
                    raise Unavailable(f"docker exec in {sb.id} did not start within 30s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
        except DockerError as e:
            raise _derr(e, f"exec in {sb.id}") from None

    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
        assert isinstance(sb, DockerSandbox)
        if sb.paused:
            raise Conflict(f"sandbox {sb.id} is paused; resume it before exec")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        for k in req.env:
            if not k or "=" in k or "\0" in k:
                raise InvalidRequest(f"invalid environment variable name {k!r}")
        if any("\0" in s for s in (*argv, *req.env.values(), req.cwd or "")):
            raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
        if req.session:
            return await session_exec(sb, req, on_chunk, lambda: self._start_session(sb, req.session),
                                      lambda name: self._close_session(sb, name))
        assert sb.cg is not None
        t0 = time.perf_counter()
        cwd = req.cwd or sb.spec.workdir or "/"
        if not cwd.startswith("/"):
            cwd = "/" + cwd
        group = f"x{sb.epoch}-{next(sb.seq)}"
        ex, stream, pid = await self._start(sb, argv, req.env, cwd)
        caps = {"stdout": Capture(req.max_output_bytes), "stderr": Capture(req.max_output_bytes)}
        if not pid:  # Docker refused to start it: bad cwd, no /bin/sh in the image, ...
            text = await _drain(stream, 2.0)
            await stream.close()
            return _start_failed(argv, cwd, text, t0)
        oom_before = sb.cg.oom_kills()
        try:
            _join_group(sb.cg, group, pid)
        except OSError as e:
            await stream.close()
            raise Internal(f"cannot move docker exec {pid} of {sb.id} into its cgroup: {e}") from None

        def sink(name: str, data: bytes) -> None:
            caps[name].add(data)
            if on_chunk is not None:
                on_chunk(name, data)

        reader = asyncio.create_task(_pump_out(stream, sink))
        timed_out = False
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
        try:
            await stream.write_in(b"\n" + req.stdin.encode())
            _write_eof(stream)
            if pidfd is not None and not await _wait_readable(pidfd, req.timeout_s):
                timed_out = True
                await asyncio.to_thread(sb.cg.kill_group, group)
                await _wait_readable(pidfd, 10)
        except (ConnectionError, RuntimeError):
            pass  # the command ended before reading its stdin
        finally:
            if pidfd is not None:
                os.close(pidfd)
        try:
            await asyncio.wait_for(asyncio.shield(reader), 0.05 if pidfd is not None else req.timeout_s)
        except Exception:  # a background child keeps the stream open, or it broke: what we have is the output
            pass
        reader.cancel()
        await stream.close()
        code = await _exit_code(ex, timed_out)
        if not sb.cg.remove_group(group):
            sb.lingering.add(group)
        oom_now = sb.cg.oom_kills() > oom_before
        if code == 255 and oom_now:  # Docker never said; the memory cgroup did
            code = 137
        oom = code == 137 and oom_now
        stderr = result_stderr(caps["stderr"].buf.decode("utf-8", errors="replace"), sb.spec, req, oom, timed_out)
        return ExecResult(exit_code=code, stdout=caps["stdout"].buf.decode("utf-8", errors="replace"), stderr=stderr,
                          duration_ms=(time.perf_counter() - t0) * 1000, timed_out=timed_out,
                          truncated=caps["stdout"].truncated or caps["stderr"].truncated, oom_killed=oom,
                          signal=signal.SIGKILL if (timed_out or oom or code == 137) else None)

    # ------------------------------------------------------------------ sessions

    async def _start_session(self, sb: DockerSandbox, name: str) -> Session:
        assert sb.cg is not None
        group = f"s{sb.epoch}-{name}-{next(sb.seq)}"
        ex, stream, pid = await self._start(sb, ["/bin/sh"], {}, sb.spec.workdir or "/")
        if not pid:
            text = await _drain(stream, 2.0)
            await stream.close()
            raise Unavailable(f"sandbox {sb.id} cannot start a session: {text.strip()[-500:]}")
        try:
            _join_group(sb.cg, group, pid)
        except OSError as e:
            await stream.close()
            raise Internal(f"cannot move the session shell of {sb.id} into its cgroup: {e}") from None
        await stream.write_in(b"\n")
        bridge = _Bridge(ex, stream, pid)
        session = Session(name, group, bridge.stdin_w, bridge.out_r, bridge.err_r, bridge.wait())
        sb.sessions[name] = session
        sb.session_links[name] = bridge
        return session

    def _close_session(self, sb: DockerSandbox, name: str) -> None:
        s = sb.sessions.pop(name, None)
        if s is not None:
            s.close()
        b = sb.session_links.pop(name, None)
        if b is not None:
            b.close()

    # ------------------------------------------------------------------ files

    async def _stat(self, sb: DockerSandbox, path: str) -> dict | None:
        from aiodocker.exceptions import DockerError

        # a HEAD's error has no body, which aiodocker's error parsing trips over: ask the session directly
        url = self.docker._canonicalize_url(f"containers/{sb.cid}/archive", versioned_api=True)
        try:
            async with self.docker.session.head(url, params={"path": path}) as resp:
                if resp.status == 404:
                    return None
                if resp.status == 500:  # Docker could not evaluate the path in the container's root
                    raise Forbidden(f"{path} resolves through a link that cannot be followed (a symlink loop?)")
                if resp.status // 100 != 2:
                    raise _derr(DockerError(resp.status, resp.headers.get("X-Docker-Container-Path-Stat", "") or resp.reason or ""),
                                f"stat {path}")
                hdr = resp.headers.get("X-Docker-Container-Path-Stat", "")
        except DockerError as e:
            raise _derr(e, f"stat {path}") from None
        try:
            return json.loads(base64.b64decode(hdr))
        except ValueError:
            raise Internal(f"docker gave no stat for {path}") from None

    async def _resolve(self, sb: DockerSandbox, path: str) -> tuple[str, dict | None]:
        """Follow symlinks the way the sandbox would, each hop resolved by Docker inside the
        container's root (so `..` and absolute targets never leave it)."""
        path = _clean(path)
        for _ in range(40):
            st = await self._stat(sb, path)
            if st is None or not st.get("linkTarget") or not (int(st.get("mode", 0)) & GO_MODE_SYMLINK):
                return path, st
            target = st["linkTarget"]
            path = _clean(target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target))
        raise Forbidden(f"{path} resolves through too many symlinks")

    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
        from aiodocker.exceptions import DockerError

        assert isinstance(sb, DockerSandbox)
        orig = path
        path, st = await self._resolve(sb, path)
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
            raise _derr(e, f"read {orig}") from None
        with tf:
            member = next((m for m in tf.getmembers() if m.isfile()), None)
            if member is None:
                raise InvalidRequest(f"{orig} is not a regular file")
            f = tf.extractfile(member)
            data = f.read(max_bytes + 1) if f else b""
        if len(data) > max_bytes:
            raise InvalidRequest(f"{orig} is larger than max_bytes={max_bytes}")
        return data, _perm(mode)

    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        from aiodocker.exceptions import DockerError

        assert isinstance(sb, DockerSandbox)
        if "\0" in path:
            raise InvalidRequest("path contains a NUL byte")
        parts = [p for p in _clean(path).split("/") if p]
        if not parts or parts[-1] == "..":
            raise InvalidRequest(f"{path} does not name a file")
        target, st = await self._resolve(sb, "/" + "/".join(parts))
        if st is not None and int(st.get("mode", 0)) & GO_MODE_DIR:
            raise InvalidRequest(f"{path} is a directory")
        parent, base = posixpath.split(target)
        missing: list[str] = []
        anchor = parent
        while True:
            pst = await self._stat(sb, anchor)
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
            raise _derr(e, f"write {path}") from None

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
        except DockerError as e:
            raise _derr(e, f"{'pause' if paused else 'resume'} {sb.id}") from None
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
            raise _derr(e, f"commit {sb.id}") from None
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


class _Bridge:
    """Pipes between a session's docker exec stream and sessions.Session (which wants fds)."""

    def __init__(self, ex, stream, pid: int):
        self.ex = ex
        self.stream = stream
        self.pid = pid
        in_r, self.stdin_w = os.pipe2(os.O_CLOEXEC)
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self._in_r, self._out_w, self._err_w = in_r, out_w, err_w
        os.set_blocking(out_w, False)
        os.set_blocking(err_w, False)
        self.tasks = [asyncio.create_task(self._pump_in()), asyncio.create_task(self._pump_out())]

    async def _pump_in(self) -> None:
        loop = asyncio.get_running_loop()
        os.set_blocking(self._in_r, False)
        try:
            while True:
                try:
                    data = os.read(self._in_r, 65536)
                except BlockingIOError:
                    if not await _wait_readable(self._in_r, 3600 * 24 * 365):
                        return
                    continue
                if not data:
                    return
                await self.stream.write_in(data)
        except (OSError, RuntimeError, ConnectionError):
            pass
        finally:
            _ = loop

    async def _pump_out(self) -> None:
        try:
            while (m := await self.stream.read_out()) is not None:
                fd = self._out_w if m.stream == 1 else self._err_w
                view = memoryview(m.data)
                while view:
                    try:
                        n = os.write(fd, view)
                        view = view[n:]
                    except BlockingIOError:
                        await asyncio.sleep(0.001)
        except (OSError, asyncio.CancelledError, Exception):  # the exec ended or closed its stdin (or was cancelled): the rest has no reader
            pass
        finally:
            for fd in (self._out_w, self._err_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._out_w = self._err_w = -1

    async def wait(self) -> int:
        """Until the shell exits; its status in waitpid's encoding (what Session expects)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            pidfd = None
        if pidfd is not None:
            try:
                await _wait_readable(pidfd, 3600 * 24 * 365)
            finally:
                os.close(pidfd)
        code = await _exit_code(self.ex, False)
        return (code & 0xFF) << 8 if code < 128 else (code - 128) & 0x7F

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for fd in (self._in_r,):
            with contextlib.suppress(OSError):
                os.close(fd)
        asyncio.ensure_future(self.stream.close())


def _cgroup_rel(pid: int) -> str:
    """The container's cgroup path (the same in every v1 hierarchy for Docker's cgroupfs driver)."""
    rel = ""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            if "pids" in ctrl.split(",") or (ctrl == "" and cgroups.is_v2()):
                rel = path
                if ctrl:
                    break
    if not rel or rel == "/":
        raise Internal(f"cannot find the cgroup of docker container process {pid}")
    return rel


def _join_group(cg: cgroups.Cgroups, group: str, pid: int) -> None:
    fds = cg.make_exec_group(group)
    try:
        for fd in fds:
            os.write(fd, str(pid).encode())
    finally:
        for fd in fds:
            os.close(fd)


def _sweep_cgroup(cg: cgroups.Cgroups) -> None:
    for top in cg.all_dirs():
        cgroups.rmtree_cgroup(top)


async def _pump_out(stream, sink) -> None:
    while (m := await stream.read_out()) is not None:
        sink("stdout" if m.stream == 1 else "stderr", m.data)


async def _drain(stream, timeout: float) -> str:
    out: list[bytes] = []

    async def go() -> None:
        while (m := await stream.read_out()) is not None:
            out.append(m.data)

    with contextlib.suppress(TimeoutError, Exception):
        await asyncio.wait_for(go(), timeout)
    return b"".join(out).decode("utf-8", errors="replace")


def _write_eof(stream) -> None:
    """Close the exec's stdin but keep reading its output (aiodocker's close() does both)."""
    conn = stream._resp.connection if stream._resp is not None else None
    transport = conn.transport if conn is not None else None
    if transport is not None and transport.can_write_eof():
        transport.write_eof()


async def _exit_code(ex, timed_out: bool, wait_s: float = 60.0) -> int:
    """The exec's exit code as Docker reports it (authoritative; the process is not our child).
    Docker may report it late: after an OOM kill under load, or while it still drains the output
    of an earlier exec whose background children hold it open (up to a few seconds)."""
    deadline = time.monotonic() + wait_s
    delay = 0.001
    while True:
        try:
            info = await ex.inspect()
        except Exception:
            return 137 if timed_out else 255
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"])
        if time.monotonic() > deadline:
            return 137 if timed_out else 255
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)




def _start_failed(argv: list[str], cwd: str, text: str, t0: float) -> ExecResult:
    ms = (time.perf_counter() - t0) * 1000
    low = text.lower()
    if "chdir" in low or "cwd" in low:
        return ExecResult(exit_code=126, stderr=f"corral: cannot change directory to {cwd}: No such file or directory\n", duration_ms=ms)
    if "executable file not found" in low or "no such file" in low:
        return ExecResult(exit_code=127, stderr=f"corral: cannot run /bin/sh (the image needs a shell): {text.strip()}\n", duration_ms=ms)
    return ExecResult(exit_code=126, stderr=f"corral: docker could not start {argv[0]}: {text.strip()}\n", duration_ms=ms)


def _perm(mode: int) -> int:
    return (mode & 0o777) | (0o4000 if mode & GO_SETUID else 0) | (0o2000 if mode & GO_SETGID else 0) | (0o1000 if mode & GO_STICKY else 0)


def _clean(path: str) -> str:
    p = posixpath.normpath("/" + path.lstrip("/"))
    return "/" + p.lstrip("/")


def _derr(e, what: str) -> CorralError:
    msg = f"docker: {what}: {e.message}"
    if e.status == 404:
        return NotFound(msg)
    if e.status == 409:
        return Conflict(msg)
    if e.status == 400:
        return InvalidRequest(msg)
    if e.status == 403:
        return Forbidden(msg)
    return Unavailable(msg)
