"""The `container` substrate: an OCI container under runc, one per sandbox.

Root is overlayfs: the image's rootfs read-only below, a private upper on a size-capped tmpfs
(disk_mb) above. PID 1 is corral-init, which forks every exec so that exec inherits the
sandbox's namespaces, cgroups, seccomp filter and empty capability sets without a ~25 ms
`runc exec`. Each exec runs in its own child cgroup so that a timeout kills exactly its tree."""
from __future__ import annotations

import asyncio
import errno
import hashlib
import itertools
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import time

import msgspec

from corral_common.errors import Code, Conflict, CorralError, Internal, InvalidRequest, Unavailable
from corral_common.messages import ExecRequest, ExecResult, SandboxInfo, SandboxSpec

from corral_common import linux

from .. import cgroups, confine, initclient, masks, oci
from ..initbin import ensure_init_binary
from ..layermounts import LayerMounts
from ..output import PipeReader
from ..sessions import Session
from .base import AdoptReport, ChunkCallback, Sandbox, Substrate, Usage

log = logging.getLogger("corral.node.container")

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


class ContainerSandbox(Sandbox):
    def __init__(self, info: SandboxInfo, spec: SandboxSpec, sdir: str, cg: cgroups.Cgroups, init_pid: int, layers: list[str]):
        super().__init__(info, spec)
        self.layers = layers
        self.sdir = sdir
        self.rootfs = f"{sdir}/rootfs"
        self.ctl = f"{sdir}/ctl.sock"
        self.io = f"{sdir}/io"
        self.cg = cg
        self.init_pid = init_pid
        self.pidfd: int | None = None
        self.sessions: dict[str, Session] = {}
        self.session_locks: dict[str, asyncio.Lock] = {}
        # protected paths covered by decoys in the container's mount namespace (masks.py)
        self.masks: list[masks.Mask] = masks.load(f"{sdir}/masks")
        # exec cgroup names carry a per-agent-run prefix so an adopted sandbox's lingering
        # groups (background processes started before a restart) are never reused
        self.seq = itertools.count(1)
        self.epoch = secrets.token_hex(3)
        self.paused = False
        self.lingering: set[str] = set()
        try:
            self.pidfd = os.pidfd_open(init_pid)
        except OSError:
            self.pidfd = None


class ContainerSubstrate(Substrate):
    name = "container"
    #: the node-agent's seccomp-notify socket (audit_seccomp.py), set by the agent before create:
    #: denied syscalls are then SCMP_ACT_NOTIFY and audited; None keeps them SCMP_ACT_ERRNO
    seccomp_listener: str | None = None

    def __init__(self, node: str, state_dir: str, layers: LayerMounts, runc: str = "runc"):
        self.node = node
        self.state_dir = state_dir
        self.sandboxes_dir = f"{state_dir}/sandboxes"
        self.runc_root = f"{state_dir}/runc"
        self.layers = layers
        self.runc = shutil.which(runc) or runc
        # unique per state dir: two stacks on one host may both have a "node-1", and each
        # node-agent's reconciliation sweeps everything under its own parent
        tag = hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:8]
        self.cgroup_parent = f"/corral/{node}-{tag}"
        self.init_path = ""

    async def start(self) -> None:
        if not os.path.exists(self.runc) and not shutil.which(self.runc):
            raise Unavailable("runc is not installed (apt-get install runc)")
        if os.geteuid() != 0:
            raise Unavailable("the container substrate needs root (mounts, cgroups, runc)")
        os.makedirs(self.sandboxes_dir, exist_ok=True)
        os.makedirs(self.runc_root, exist_ok=True)
        linux.set_child_subreaper()
        with open(f"{self.state_dir}/cgroup-parent", "w") as f:
            f.write(self.cgroup_parent + "\n")
        self.init_path = await asyncio.to_thread(ensure_init_binary, f"{self.state_dir}/bin")

    # ------------------------------------------------------------------ lifecycle

    async def create(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        lowers, layers = await self.layers.acquire(spec.image)
        sid = info.id
        sdir = f"{self.sandboxes_dir}/{sid}"
        cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
        try:
            return await self._create(info, spec, ":".join(lowers), layers, sdir, cg)
        except BaseException:
            await asyncio.shield(self._teardown_async(sid, sdir, cg, None, layers))
            raise

    async def _teardown_async(self, sid: str, sdir: str, cg: cgroups.Cgroups, pidfd: int | None, layers: list[str]) -> None:
        await asyncio.to_thread(self._teardown, sid, sdir, cg, pidfd)
        await self.layers.release(layers)

    async def _create(self, info: SandboxInfo, spec: SandboxSpec, lower: str, layers: list[str], sdir: str, cg: cgroups.Cgroups) -> ContainerSandbox:
        sid = info.id
        os.makedirs(sdir, mode=0o700, exist_ok=False)
        os.makedirs(f"{sdir}/rw")
        os.makedirs(f"{sdir}/rootfs")
        os.makedirs(f"{sdir}/io", mode=0o755)
        linux.mount("tmpfs", f"{sdir}/rw", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"size={spec.disk_mb}m,mode=755")
        os.mkdir(f"{sdir}/rw/upper", 0o755)
        os.mkdir(f"{sdir}/rw/work", 0o755)
        # nosuid/nodev on the host side too: a setuid file the sandbox makes must not be a way
        # to root for a host user who can reach the state dir. index=on,nfs_export=on make the
        # overlay's file handles decodable, which fanotify needs to report its directory entry
        # events (create/unlink/rename) with paths (audit_files.py); without them (a lower that
        # cannot export handles) the overlay is mounted plain and file activity falls back to fd mode
        opts = f"lowerdir={lower},upperdir={sdir}/rw/upper,workdir={sdir}/rw/work"
        try:
            linux.mount("overlay", f"{sdir}/rootfs", "overlay", linux.MS_NOSUID | linux.MS_NODEV, opts + ",index=on,nfs_export=on")
        except OSError:
            linux.mount("overlay", f"{sdir}/rootfs", "overlay", linux.MS_NOSUID | linux.MS_NODEV, opts)
        if spec.workdir not in ("", "/"):
            confine.mkdirs(f"{sdir}/rootfs", spec.workdir)
        cfg = oci.config(
            hostname=sid,
            init_path=self.init_path,
            io_dir=f"{sdir}/io",
            cgroups_path=cg.rel if cg.rel.startswith("/") else "/" + cg.rel,
            env={**DEFAULT_ENV, **spec.env},
            cpu=spec.cpu,
            memory_mb=spec.memory_mb,
            pids_max=spec.pids_max,
            seccomp_listener=self.seccomp_listener,
        )
        # protected paths are covered by decoys before anything in the sandbox runs (fail closed)
        cfg["mounts"].extend(masks.oci_mounts(masks.build(f"{sdir}/rootfs", list(spec.protected_paths), f"{sdir}/masks")))
        with open(f"{sdir}/config.json", "w") as f:
            json.dump(cfg, f)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(f"{sdir}/ctl.sock")
            os.chmod(f"{sdir}/ctl.sock", 0o600)
            listener.listen(256)
            rc = await self._runc_run(sid, sdir, listener.fileno())
        finally:
            listener.close()
        if rc != 0:
            msg = _tail(f"{sdir}/runc.log")
            raise Internal(f"runc could not start sandbox {sid}: {msg}")
        with open(f"{sdir}/init.pid") as f:
            init_pid = int(f.read().strip())
        linux.loopback_up(init_pid)
        try:
            await initclient.ping(f"{sdir}/ctl.sock")
        except initclient.InitError as e:
            raise Internal(f"sandbox {sid} started but its init does not answer: {e}") from None
        sb = ContainerSandbox(info, spec, sdir, cg, init_pid, layers)
        self._persist(sb)
        return sb

    async def _runc_run(self, sid: str, sdir: str, listen_fd: int) -> int:
        if listen_fd == 3:  # dup2(3, 3) would keep close-on-exec set
            listen_fd = os.dup(listen_fd)
        argv = [self.runc, "--root", self.runc_root, "run", "-d", "--preserve-fds", "1",
                "--pid-file", f"{sdir}/init.pid", "--bundle", sdir, sid]
        pid = os.posix_spawn(self.runc, argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, f"{sdir}/runc.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            (os.POSIX_SPAWN_DUP2, listen_fd, 3),
        ])
        return await wait_pid(pid)

    def watch_exit(self, sb: Sandbox, callback) -> None:
        assert isinstance(sb, ContainerSandbox)
        if sb.pidfd is None:
            return
        loop = asyncio.get_running_loop()
        fd = sb.pidfd

        def fired() -> None:
            loop.remove_reader(fd)
            if sb.pidfd is not None:  # not a destroy in progress
                callback(sb)

        loop.add_reader(fd, fired)

    async def destroy(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        if sb.pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(sb.pidfd)
            except (RuntimeError, ValueError):
                pass
        for s in sb.sessions.values():
            s.close()
        sb.sessions.clear()
        pidfd, sb.pidfd = sb.pidfd, None
        await self._teardown_async(sb.id, sb.sdir, sb.cg, pidfd, sb.layers)

    def _teardown(self, sid: str, sdir: str, cg: cgroups.Cgroups, pidfd: int | None) -> None:
        """Kill, unmount, remove cgroups and files. Safe to call on a half-created sandbox and
        idempotent, because reconciliation after a crash calls it on whatever is left."""
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                cg.thaw()
                select.select([pidfd], [], [], 10)
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # ours as subreaper: reap it
            except (OSError, ChildProcessError):
                pass
            os.close(pidfd)
        # killing PID 1 takes the whole pid namespace down; the cgroup sweep catches stragglers
        cg.destroy(timeout=10)
        subprocess.run([self.runc, "--root", self.runc_root, "delete", "--force", sid],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        for mp in linux.mounted_under(sdir):
            try:
                linux.umount(mp)
            except OSError:
                linux.umount(mp, detach=True)
        cg.destroy(timeout=1)
        shutil.rmtree(sdir, ignore_errors=True)

    def _persist(self, sb: ContainerSandbox) -> None:
        tmp = f"{sb.sdir}/sandbox.json.tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(Record(info=sb.info, spec=sb.spec, init_pid=sb.init_pid, layers=sb.layers)))
        os.replace(tmp, f"{sb.sdir}/sandbox.json")

    async def snapshot_dir(self, sb: Sandbox) -> tuple[str, list[str]]:
        assert isinstance(sb, ContainerSandbox)
        return f"{sb.sdir}/rw/upper", list(sb.layers)

    # ------------------------------------------------------------------ exec

    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
        assert isinstance(sb, ContainerSandbox)
        if sb.paused:
            raise Conflict(f"sandbox {sb.id} is paused; resume it before exec")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        env = {**DEFAULT_ENV, **sb.spec.env, **req.env}
        for k in env:
            if not k or "=" in k or "\0" in k:
                raise InvalidRequest(f"invalid environment variable name {k!r}")
        if req.session:
            return await self._session_exec(sb, req, argv, env, on_chunk)
        cwd = req.cwd or sb.spec.workdir or "/"
        group = f"x{sb.epoch}-{next(sb.seq)}"
        t0 = time.perf_counter()
        oom_before = sb.cg.oom_kills()
        cg_fds = sb.cg.make_exec_group(group)
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        child_fds = [in_r, out_w, err_w, *cg_fds]
        try:
            spawned = await initclient.spawn(sb.ctl, argv, env, cwd, (in_r, out_w, err_w), cg_fds)
        except (initclient.InitError, ValueError) as e:
            for fd in (*child_fds, in_w, out_r, err_r):
                os.close(fd)
            sb.cg.remove_group(group)
            if isinstance(e, ValueError):
                raise InvalidRequest(str(e)) from None
            raise Unavailable(f"sandbox {sb.id} is not accepting commands: {e}") from None
        for fd in child_fds:
            os.close(fd)
        reader = PipeReader({"stdout": out_r, "stderr": err_r}, req.max_output_bytes, on_chunk)
        feeder = asyncio.create_task(_feed(in_w, req.stdin.encode()))
        wait = asyncio.ensure_future(spawned.wait())
        timed_out = False
        try:
            status = await asyncio.wait_for(asyncio.shield(wait), req.timeout_s)
        except TimeoutError:
            timed_out = True
            await asyncio.to_thread(sb.cg.kill_group, group)
            try:
                status = await asyncio.wait_for(wait, 10)
            except (TimeoutError, initclient.InitError):
                status = signal.SIGKILL
        except initclient.InitError as e:
            reader.drain()
            feeder.cancel()
            raise Unavailable(f"sandbox {sb.id} went away during exec: {e}") from None
        finally:
            if not wait.done():
                wait.cancel()
        await reader.finish(grace=0.05)
        feeder.cancel()
        if not sb.cg.remove_group(group):
            sb.lingering.add(group)  # background processes still running; swept on destroy
        code, sig = _exit_code(status)
        stderr = reader.text("stderr")
        oom = sig == signal.SIGKILL and sb.cg.oom_kills() > oom_before
        if oom:
            stderr += f"\ncorral: killed: the sandbox ran out of memory (memory_mb={sb.spec.memory_mb})\n"
        if timed_out:
            stderr += f"\ncorral: timed out after {req.timeout_s:g}s; every process of this exec was killed\n"
        return ExecResult(
            exit_code=code, stdout=reader.text("stdout"), stderr=stderr,
            duration_ms=(time.perf_counter() - t0) * 1000, timed_out=timed_out,
            truncated=reader.truncated, oom_killed=oom, signal=sig,
        )

    async def _session_exec(self, sb: ContainerSandbox, req: ExecRequest, argv: list[str], env: dict[str, str], on_chunk: ChunkCallback | None) -> ExecResult:
        lock = sb.session_locks.setdefault(req.session, asyncio.Lock())
        async with lock:
            t0 = time.perf_counter()
            session = sb.sessions.get(req.session)
            if session is None or not session.alive:
                if session is not None:
                    session.close()
                session = await self._start_session(sb, req.session, env)
                sb.sessions[req.session] = session
            n = next(sb.seq)
            script = f"c{n}"
            script_text = req.cmd if isinstance(req.cmd, str) else " ".join(_shquote(a) for a in argv)
            with open(f"{sb.io}/{script}", "w") as f:
                f.write(script_text + "\n")
            stdin_path = None
            if req.stdin:
                with open(f"{sb.io}/i{n}", "wb") as f:
                    f.write(req.stdin.encode())
                stdin_path = f"/.corral/io/i{n}"
            oom_before = sb.cg.oom_kills()
            extra_env = {k: v for k, v in req.env.items()}

            async def kill() -> None:
                await asyncio.to_thread(sb.cg.kill_group, session.group)

            try:
                res = await session.run(
                    f"/.corral/io/{script}", stdin_path, req.cwd, extra_env, req.timeout_s,
                    req.max_output_bytes, on_chunk, kill,
                )
            finally:
                for p in (f"{sb.io}/{script}", f"{sb.io}/i{n}"):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
            stderr = res.stderr.decode("utf-8", errors="replace")
            oom = res.ended and sb.cg.oom_kills() > oom_before
            if res.ended:
                session.close()
                sb.sessions.pop(req.session, None)
                sb.cg.remove_group(session.group)
            if oom:
                stderr += f"\ncorral: killed: the sandbox ran out of memory (memory_mb={sb.spec.memory_mb})\n"
            if res.timed_out:
                stderr += f"\ncorral: timed out after {req.timeout_s:g}s; session {req.session!r} was killed and will start afresh\n"
            return ExecResult(
                exit_code=res.exit_code, stdout=res.stdout.decode("utf-8", errors="replace"), stderr=stderr,
                duration_ms=(time.perf_counter() - t0) * 1000, timed_out=res.timed_out,
                truncated=res.truncated, oom_killed=oom, signal=9 if res.timed_out or oom else None,
            )

    async def _start_session(self, sb: ContainerSandbox, name: str, env: dict[str, str]) -> Session:
        group = f"s{sb.epoch}-{name}-{next(sb.seq)}"
        cg_fds = sb.cg.make_exec_group(group)
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            spawned = await initclient.spawn(sb.ctl, ["/bin/sh"], env, sb.spec.workdir or "/", (in_r, out_w, err_w), cg_fds)
        except initclient.InitError as e:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise Unavailable(f"sandbox {sb.id} cannot start a session: {e}") from None
        finally:
            for fd in (in_r, out_w, err_w, *cg_fds):
                os.close(fd)
        return Session(name, group, in_w, out_r, err_r, spawned.wait())

    # ------------------------------------------------------------------ files

    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
        assert isinstance(sb, ContainerSandbox)
        return await asyncio.to_thread(confine.read, sb.rootfs, path, max_bytes)

    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        assert isinstance(sb, ContainerSandbox)
        await asyncio.to_thread(confine.write, sb.rootfs, path, data, mode, make_parents)

    # ------------------------------------------------------------------ pause / usage

    async def pause(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        if sb.paused:
            return
        # the v1 freezer gives up ("unable to freeze") when tasks keep forking or sit in the
        # kernel on a loaded host; thaw and try again a few times before reporting it
        for attempt in range(4):
            try:
                await self._runc_simple("pause", sb.id)
                break
            except Internal:
                if attempt == 3:
                    raise
                try:
                    await self._runc_simple("resume", sb.id)
                except Internal:
                    pass  # it was not left frozen
                await asyncio.sleep(0.05 * (attempt + 1))
        sb.paused = True

    async def resume(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        if not sb.paused:
            return
        await self._runc_simple("resume", sb.id)
        sb.paused = False

    async def _runc_simple(self, verb: str, sid: str, timeout: float = 15.0) -> None:
        p = await asyncio.create_subprocess_exec(
            self.runc, "--root", self.runc_root, verb, sid,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(p.communicate(), timeout)
        except TimeoutError:
            # a process stuck in uninterruptible sleep (e.g. a FUSE read) cannot be frozen:
            # give up and make sure the sandbox is left running
            p.kill()
            await p.wait()
            if verb == "pause":
                await self._runc_simple("resume", sid, timeout)
            raise CorralError(f"runc {verb} {sid} did not finish within {timeout:g}s", Code.TIMEOUT) from None
        if p.returncode != 0:
            raise Internal(f"runc {verb} {sid} failed: {err.decode(errors='replace').strip()}")

    async def usage(self, sb: Sandbox) -> Usage:
        assert isinstance(sb, ContainerSandbox)
        return Usage(cpu_ns=sb.cg.cpu_usage_ns(), memory_bytes=sb.cg.memory_bytes(), pids=sb.cg.pids_current())

    # ------------------------------------------------------------------ crash recovery

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        adopted, report = await asyncio.to_thread(self._reconcile)
        removed = await self.layers.adopt([sb.layers for sb in adopted if isinstance(sb, ContainerSandbox)])
        if removed:
            report.notes.append(f"unmounted {len(removed)} unused layer mount(s)")
        return adopted, report

    def _reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        report = AdoptReport()
        adopted: list[Sandbox] = []
        runc_states = self._runc_list()
        seen: set[str] = set()
        for sid in sorted(os.listdir(self.sandboxes_dir)) if os.path.isdir(self.sandboxes_dir) else []:
            sdir = f"{self.sandboxes_dir}/{sid}"
            seen.add(sid)
            cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
            rec = _load_record(f"{sdir}/sandbox.json")
            st = runc_states.get(sid)
            if rec is not None and st is not None and st.get("status") in ("running", "paused") and _responsive(f"{sdir}/ctl.sock", st.get("status") == "paused"):
                sb = ContainerSandbox(rec.info, rec.spec, sdir, cg, int(st.get("pid") or rec.init_pid), rec.layers)
                sb.paused = st.get("status") == "paused"
                for group in cg.exec_groups():
                    # background processes from before the restart keep running (a server the
                    # agent started must survive us); empty groups go now, the rest on destroy
                    if not cg.remove_group(group):
                        sb.lingering.add(group)
                adopted.append(sb)
                report.adopted.append(sid)
                continue
            self._teardown(sid, sdir, cg, None)
            report.cleaned.append(sid)
        for sid in runc_states:
            if sid not in seen:
                cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
                self._teardown(sid, f"{self.sandboxes_dir}/{sid}", cg, None)
                report.cleaned.append(sid)
                report.notes.append(f"runc container {sid} had no sandbox record")
        # cgroups with neither a record nor a container
        parent = cgroups.Cgroups(self.cgroup_parent)
        for d in parent.all_dirs():
            for sid in os.listdir(d):
                if os.path.isdir(f"{d}/{sid}") and sid not in seen and sid not in runc_states:
                    cgroups.Cgroups(f"{self.cgroup_parent}/{sid}").destroy(timeout=5)
                    if sid not in report.cleaned:
                        report.cleaned.append(sid)
                        report.notes.append(f"stray cgroup {sid} removed")
        return adopted, report

    def _runc_list(self) -> dict[str, dict]:
        p = subprocess.run([self.runc, "--root", self.runc_root, "list", "--format", "json"],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0 or not p.stdout.strip() or p.stdout.strip() == "null":
            return {}
        return {c["id"]: c for c in json.loads(p.stdout)}


async def wait_pid(pid: int) -> int:
    """Wait for a child without blocking the loop or using a SIGCHLD watcher (pidfd readiness)."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    try:
        fut = loop.create_future()
        loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(pidfd)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        os.close(pidfd)


async def _feed(fd: int, data: bytes) -> None:
    """Write stdin without blocking the loop; close it so the reader sees EOF."""
    try:
        os.set_blocking(fd, False)
        view = memoryview(data)
        loop = asyncio.get_running_loop()
        while view:
            try:
                n = os.write(fd, view)
                view = view[n:]
            except BlockingIOError:
                fut = loop.create_future()
                loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
                try:
                    await fut
                finally:
                    loop.remove_writer(fd)
            except BrokenPipeError:
                break
    finally:
        os.close(fd)


def _exit_code(status: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return 255, None


def _shquote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


def _load_record(path: str) -> Record | None:
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=Record)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _responsive(ctl: str, paused: bool) -> bool:
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
