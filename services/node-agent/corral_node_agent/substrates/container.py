"""The `container` substrate: an OCI container under runc, one per sandbox.

Root is overlayfs: the image's rootfs read-only below, a private upper on a size-capped tmpfs
(disk_mb) above, detached from the host's mount table once the container runs
(container_sandbox.py). PID 1 is corral-init, which forks every exec (container_exec.py). This
module is the sandbox's lifecycle: create (cold, or claimed from the warm pool), pause, resume,
destroy, files, snapshots and changes, and adoption after a restart."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from corral_common import egress, linux
from corral_common.contract.errors import Internal, Unavailable
from corral_common.contract.messages import ChangesReply, ChangesRequest, ExecRequest, ExecResult, SandboxInfo, SandboxSpec

from .. import cgroups, confine, initclient, masks, oci, userns
from ..egress import Egress
from ..initbin import ensure_init_binary
from ..layermounts import LayerMounts
from ..userns_helper import Helper
from . import runc_cli
from .base import AdoptReport, ChunkCallback, Sandbox, Substrate, Usage
from .common import adopt_exec_groups, load_record, make_io_dir, save_record, unwatch_pidfd, watch_pidfd
from .container_exec import exec_in
from .container_fork import copy_upper
from .container_sandbox import DEFAULT_ENV, INIT_NOTIFY_FD, ContainerSandbox, Record, init_responsive, mount_overlay, mount_upper
from .runc_cli import readable

log = logging.getLogger("corral.node.container")

#: the CPU quota a sandbox starts with, whatever it asked for (see _create)
STARTUP_CPU = 1.0
#: warm-pool sandboxes run under internal ids with this prefix until a claim renames them
#: (same length as a scheduler's "sb-" + 12 hex, so nothing derived from the id changes size)
WARM_PREFIX = "wp-"
#: "off": sandboxes without a user namespace (their root is host root); for kernels without
#: idmapped mounts on EROFS and tmpfs (Linux 5.19 or later has them)
USERNS_ENV = "CORRAL_USERNS"
#: what a warm-pool sandbox is built with; a claim rewrites limits, disk size and workdir
WARM_SPEC = SandboxSpec(image="busybox", cpu=1.0, memory_mb=256, disk_mb=1024, pids_max=1024)
#: how long a freeze for reading the sandbox's files may take to settle (tasks in the kernel)
FREEZE_TIMEOUT_S = 2.0
#: what fills a new sandbox's empty upper dir before its overlay is mounted (a fork's copy)
Fill = Callable[[str], Awaitable[None]]


class ContainerSubstrate(Substrate):
    name = "container"
    #: denied syscalls are SCMP_ACT_NOTIFY to the agent's listener once it is set; each
    #: sandbox's init is given its own notify fd to hold (_hand_notify_fd)
    supports_seccomp_notify = True
    protects_paths = True

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
        self.egress = Egress(node)
        # sandbox root is not host root (userns.py) unless CORRAL_USERNS=off
        self.use_userns = os.environ.get(USERNS_ENV, "on") != "off"
        self.uids: userns.UidRanges | None = None
        self.ns_helper: Helper | None = None

    async def start(self) -> None:
        if not os.path.exists(self.runc) and not shutil.which(self.runc):
            raise Unavailable("runc is not installed (apt-get install runc)")
        if os.geteuid() != 0:
            raise Unavailable("the container substrate needs root (mounts, cgroups, runc)")
        os.makedirs(self.sandboxes_dir, exist_ok=True)
        os.makedirs(self.runc_root, mode=0o700, exist_ok=True)
        os.chmod(self.runc_root, 0o700)  # runc's state (each sandbox's config): host root's only
        linux.set_child_subreaper()
        with open(f"{self.state_dir}/cgroup-parent", "w") as f:
            f.write(self.cgroup_parent + "\n")
        self.init_path = await asyncio.to_thread(ensure_init_binary, f"{self.state_dir}/bin")
        if self.use_userns:
            problem = await asyncio.to_thread(userns.probe, f"{self.state_dir}/probe")
            if problem:
                raise Unavailable(f"sandboxes cannot get user namespaces here ({problem}); set {USERNS_ENV}=off "
                                  "to run them without (their root is then host root)")
            self.uids = userns.UidRanges(self.sandboxes_dir)  # (the function substrate's are its own)
            self.ns_helper = Helper()
            await asyncio.to_thread(self.ns_helper.start)
            # what runc cannot set in a sandbox with a user namespace it inherits from here
            # (corral-init lowers it again; one-shot runs have no init): no core dumps
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            # runc mounts the root, the init binary and the io dir from inside the sandbox's
            # user namespace, as its root: an unprivileged host uid, which must be able to pass
            # through (not list) every directory above them
            os.chmod(self.sandboxes_dir, 0o711)  # and not listable: sandbox ids are not theirs to learn
            opened = await asyncio.to_thread(userns.make_traversable, self.sandboxes_dir, os.path.dirname(self.init_path))
            if opened:
                log.info("directories made traversable for sandbox roots", extra={"fields": {"dirs": opened}})

    # ------------------------------------------------------------------ lifecycle

    async def create(self, info: SandboxInfo, spec: SandboxSpec, fill: Fill | None = None) -> Sandbox:
        lowers, layers = await self.layers.acquire(spec.image)
        sid = info.id
        sdir = f"{self.sandboxes_dir}/{sid}"
        cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
        try:
            return await self._create(info, spec, ":".join(lowers), layers, sdir, cg, fill)
        except BaseException:
            await asyncio.shield(self._teardown_async(sid, sdir, cg, None, layers))
            raise

    async def _teardown_async(self, sid: str, sdir: str, cg: cgroups.Cgroups, pidfd: int | None, layers: list[str]) -> None:
        await asyncio.to_thread(self._teardown, sid, sdir, cg, pidfd)
        await self.layers.release(layers)

    async def fork(self, source: Sandbox, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        """A cold create whose upper is filled, before its overlay is mounted, with a copy of the
        frozen source's (container_fork.py)."""
        assert isinstance(source, ContainerSandbox)

        async def fill(upper: str) -> None:
            async with self.frozen(source):
                await copy_upper(source, upper, spec.disk_mb)

        return await self.create(info, spec, fill)

    async def _create(self, info: SandboxInfo, spec: SandboxSpec, lower: str, layers: list[str], sdir: str, cg: cgroups.Cgroups,
                      fill: Fill | None) -> ContainerSandbox:
        sid = info.id
        # traversable, not listable, for the sandbox's root (runc mounts its root from inside
        # its user namespace); what the state dir holds that the sandbox must not read is 0600
        os.makedirs(sdir, mode=0o711, exist_ok=False)
        os.chmod(sdir, 0o711)
        os.makedirs(f"{sdir}/rw")
        os.makedirs(f"{sdir}/rootfs")
        base, user_fd = self._user_namespace(sid, sdir)
        try:
            return await self._create_in(info, spec, lower, layers, sdir, cg, base, user_fd, fill)
        finally:
            if user_fd is not None:
                os.close(user_fd)

    def _user_namespace(self, sid: str, sdir: str) -> tuple[int, int | None]:
        """A host uid range for the sandbox (recorded in its state dir first, so a teardown
        releases it whatever fails next) and a user namespace over it; (0, None) without."""
        if self.uids is None:
            return 0, None
        assert self.ns_helper is not None
        base = self.uids.claim_for(sid, sdir)
        return base, self.ns_helper.make(base)[0]

    async def _create_in(self, info: SandboxInfo, spec: SandboxSpec, lower: str, layers: list[str], sdir: str,
                         cg: cgroups.Cgroups, base: int, user_fd: int | None, fill: Fill | None) -> ContainerSandbox:
        sid = info.id
        make_io_dir(f"{sdir}/io", base)
        upper = mount_upper(sdir, spec.disk_mb)
        if fill is not None:
            await fill(upper)
        mount_overlay(sdir, lower, user_fd, base)
        if spec.workdir not in ("", "/"):
            with userns.acting_as(base):
                confine.mkdirs(f"{sdir}/rootfs", spec.workdir)
        cfg = oci.config(
            hostname=sid,
            init_path=self.init_path,
            io_dir=f"{sdir}/io",
            cgroups_path=cg.rel if cg.rel.startswith("/") else "/" + cg.rel,
            # the spec's env goes to every exec (exec() merges it); init itself gets only the
            # defaults, so /proc/1/environ is the same for a cold and a warm-pool sandbox
            env=dict(DEFAULT_ENV),
            # at least one core while runc sets the sandbox up and init starts (that work is
            # charged to the sandbox's cgroup: at cpu=0.005, 1 ms per 100 ms, it took ~500 ms);
            # the requested quota is applied once init answers
            cpu=max(spec.cpu, STARTUP_CPU),
            memory_mb=spec.memory_mb,
            pids_max=spec.pids_max,
            seccomp_listener=self.seccomp_listener,
            init_caps=True,
            userns=None if user_fd is None else (f"/proc/{os.getpid()}/fd/{user_fd}", base),
        )
        # protected paths are covered by decoys before anything in the sandbox runs (fail closed)
        cfg["mounts"].extend(masks.oci_mounts(masks.build(f"{sdir}/rootfs", list(spec.protected_paths), f"{sdir}/masks")))
        with open(f"{sdir}/config.json", "w") as f:
            json.dump(cfg, f)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held: list[int] = []
        try:
            listener.bind(f"{sdir}/ctl.sock")
            os.chmod(f"{sdir}/ctl.sock", 0o600)
            listener.listen(256)
            held = [linux.open_tree_clone(f"{sdir}/rw"), linux.open_tree_clone(f"{sdir}/rootfs")]
            rc = await runc_cli.run_detached(self.runc, self.runc_root, sid, sdir, [listener.fileno(), *held])
        finally:
            listener.close()
            for fd in held:
                os.close(fd)
            # the container has its own copy of the root (and init the clones): off the host's table
            linux.umount_all(sdir)
        if rc != 0:
            msg = runc_cli.log_tail(f"{sdir}/runc.log")
            raise Internal(f"runc could not start sandbox {sid}: {msg}")
        with open(f"{sdir}/init.pid") as f:
            init_pid = int(f.read().strip())
        linux.loopback_up(init_pid)
        hosts: list[str] = []
        if spec.network == "allowlist":
            hosts = await asyncio.to_thread(self.egress.attach, sid, sdir, init_pid, egress.check(spec.network, spec.egress))
        try:
            await initclient.ping(f"{sdir}/ctl.sock")
        except initclient.InitError as e:
            raise Internal(f"sandbox {sid} started but its init does not answer: {e}") from None
        await self._hand_notify_fd(sid, f"{sdir}/ctl.sock")
        if spec.cpu < STARTUP_CPU:
            cg.set_cpu(spec.cpu)
        sb = ContainerSandbox(info, spec, sdir, cg, init_pid, layers)
        sb.uid_base = base
        if hosts:  # the allowed names, resolved by the node: there is no DNS inside
            await self.write_file(sb, "/etc/hosts", ("127.0.0.1 localhost\n" + "\n".join(hosts) + "\n").encode(), 0o644, True)
        self._persist(sb)
        return sb

    async def _hand_notify_fd(self, sid: str, ctl: str) -> None:
        """Give the sandbox's init a copy of its seccomp notify fd to hold (INIT_NOTIFY_FD): runc
        sends it to the listener once, at start, and a restarted agent takes it back from init
        (take_notify_fd), so adopted sandboxes keep their watched and denied calls answered and
        audited. Without it they would fail every notified call (kill, connect) with ENOSYS."""
        if self.seccomp_listener is None or self.seccomp_fds is None:
            return
        # runc sent the fd before init started; the listener may not have read it yet
        for _ in range(200):
            nfd = self.seccomp_fds.get(sid)
            if nfd is not None:
                break
            await asyncio.sleep(0.005)
        else:
            log.warning("no seccomp notify fd to hand to init", extra={"fields": {"sandbox": sid}})
            return
        try:
            await initclient.hold(ctl, nfd)
        except initclient.InitError as e:
            raise Internal(f"sandbox {sid}: its init did not take its seccomp notify fd: {e}") from None

    def take_notify_fd(self, sb: Sandbox) -> int | None:
        """The seccomp notify fd an adopted sandbox's init holds (None: it holds none)."""
        assert isinstance(sb, ContainerSandbox)
        if sb.pidfd is None:
            return None
        try:
            fd = linux.pidfd_getfd(sb.pidfd, INIT_NOTIFY_FD)
        except OSError:
            return None
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:seccomp notify":
                return fd
        except OSError:
            pass
        os.close(fd)  # init's placeholder: it was never handed one
        return None

    # ------------------------------------------------------------------ warm pool

    def warm_serves(self, spec: SandboxSpec) -> bool:  # masks, canaries, an allow-list are made at build: cold
        return type(self) is ContainerSubstrate and not (spec.protected_paths or spec.canaries or spec.network != "none")

    async def create_warm(self, image: str) -> ContainerSandbox:
        """Built like any other under an internal id (WARM_PREFIX), its init answering, then frozen;
        no record on disk, so a restarted agent cleans it up instead of adopting it."""
        now = time.time()
        wid = f"{WARM_PREFIX}{secrets.token_hex(6)}"
        info = SandboxInfo(id=wid, node=self.node, state="paused", substrate="container", image=image,
                           created_at=now, expires_at=now + 365 * 86400)
        sb = await self.create(info, msgspec.structs.replace(WARM_SPEC, image=image))
        assert isinstance(sb, ContainerSandbox)
        os.unlink(f"{sb.sdir}/sandbox.json")
        if not await asyncio.to_thread(sb.cg.freeze):
            await self.destroy(sb)
            raise Internal(f"warm sandbox {wid} could not be frozen")
        sb.paused = True
        return sb

    async def claim_warm(self, sb: Sandbox, info: SandboxInfo, spec: SandboxSpec) -> ContainerSandbox:
        """Every name that carried the internal id (cgroup dirs, runc's container id and state, the
        state dir, the host name, the seccomp metadata, which the agent re-keys) now carries the
        claimed one; the request's limits, disk size and workdir applied; thawed and answering."""
        assert isinstance(sb, ContainerSandbox)
        old_sid, old_sdir, old_cg = sb.id, sb.sdir, sb.cg
        try:
            # on the loop, not in a worker thread: ~1 ms of small syscalls, and a thread hop
            # costs more than that on a loaded host
            self._claim(sb, info, spec)
            # init answered before it was frozen; it is alive if its pidfd has not fired (its
            # listening socket queues our connections from the moment it is thawed)
            if sb.pidfd is None or readable(sb.pidfd, 0):
                raise Internal(f"the init of warm sandbox {old_sid} is gone")
        except BaseException:
            pidfd, sb.pidfd = sb.pidfd, None
            await asyncio.shield(asyncio.to_thread(self._teardown, old_sid, old_sdir, old_cg, pidfd))
            await asyncio.shield(self._teardown_async(info.id, f"{self.sandboxes_dir}/{info.id}",
                                                      cgroups.Cgroups(f"{self.cgroup_parent}/{info.id}"), None, sb.layers))
            raise
        return sb

    def _claim(self, sb: ContainerSandbox, info: SandboxInfo, spec: SandboxSpec) -> None:
        old, new = sb.id, info.id
        sb.cg = sb.cg.rename(f"{self.cgroup_parent}/{new}")
        sb.cg.set_limits(spec.cpu, spec.memory_mb, spec.pids_max)
        # the state dir (its mounts move with it; the overlay options name no path in it): exec
        # and files need it under the new name at once. runc's state, the bundle's config.json
        # and the record are rewritten by settle(), after the reply (pause, resume and destroy,
        # the only users of runc's state, settle first)
        sdir = f"{self.sandboxes_dir}/{new}"
        os.rename(sb.sdir, sdir)
        sb.rebase(sdir)
        sb.unsettled = True
        if spec.disk_mb != WARM_SPEC.disk_mb:
            linux.reconfigure(sb.rw, size=f"{spec.disk_mb}m")
        linux.set_hostname(sb.init_pid, new)
        if spec.workdir not in ("", "/"):
            with userns.acting_as(sb.uid_base):
                confine.mkdirs(sb.rootfs, spec.workdir)
        sb.info, sb.spec, sb.warm_id = info, spec, old
        sb.cg.thaw()
        sb.paused = False

    def settle(self, sb: Sandbox) -> None:
        """The rest of a claim: runc keeps its state in <root>/<id>/state.json, naming the id,
        the cgroup paths and the bundle; rename the dir and rewrite the names so runc pause,
        resume and delete work. One path keeps the warm name: the hybrid host's controller-less
        "unified" (v2) tracking cgroup, which cgroup v2 cannot rename, and moving init out of it
        would show inside the sandbox (its cgroup namespace root is that cgroup); runc delete
        removes it. Then the bundle's config.json and the sandbox record (adoption after a
        restart reads it)."""
        if not isinstance(sb, ContainerSandbox) or not sb.unsettled:
            return
        sb.unsettled = False
        old, new = sb.warm_id, sb.id
        rstate = f"{self.runc_root}/{old}/state.json"
        with open(rstate) as f:
            text = f.read()
        unified = f"{cgroups.ROOT}/unified/{self.cgroup_parent.strip('/')}/"
        text = text.replace(old, new).replace(unified + new, unified + old)
        with open(rstate + ".tmp", "w") as f:
            f.write(text)
        os.replace(rstate + ".tmp", rstate)
        os.rename(f"{self.runc_root}/{old}", f"{self.runc_root}/{new}")
        with open(f"{sb.sdir}/config.json") as f:
            text = f.read()
        with open(f"{sb.sdir}/config.json", "w") as f:
            f.write(text.replace(old, new))
        self._persist(sb)


    def watch_exit(self, sb: Sandbox, callback) -> None:
        assert isinstance(sb, ContainerSandbox)
        watch_pidfd(sb, callback)

    async def destroy(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        try:
            self.settle(sb)  # runc delete finds the container under its new id
        except OSError as e:
            log.warning("claim not settled before destroy", extra={"fields": {"sandbox": sb.id, "error": str(e)}})
        pidfd = unwatch_pidfd(sb)
        for s in sb.sessions.values():
            s.close()
        sb.sessions.clear()
        await self._teardown_async(sb.id, sb.sdir, sb.cg, pidfd, sb.layers)

    def _teardown(self, sid: str, sdir: str, cg: cgroups.Cgroups, pidfd: int | None) -> None:
        """Kill, unmount, remove cgroups and files. Safe to call on a half-created sandbox and
        idempotent, because reconciliation after a crash calls it on whatever is left."""
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                cg.thaw()
                readable(pidfd, 10)
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # ours as subreaper: reap it
            except (OSError, ChildProcessError):
                pass
            os.close(pidfd)
        # killing PID 1 takes the whole pid namespace down; the cgroup sweep catches stragglers
        cg.destroy(timeout=10)
        self.egress.detach(sid, sdir)
        runc_cli.delete(self.runc, self.runc_root, sid)
        linux.umount_all(sdir)
        cg.destroy(timeout=1)
        base = userns.read_base(sdir)
        shutil.rmtree(sdir, ignore_errors=True)
        if self.uids is not None:
            self.uids.release(base)  # after every process of the range is gone

    def _persist(self, sb: ContainerSandbox) -> None:
        save_record(sb.sdir, Record(info=sb.info, spec=sb.spec, init_pid=sb.init_pid, layers=sb.layers))

    @contextlib.asynccontextmanager
    async def snapshot_dir(self, sb: Sandbox):
        """The upper dir, on a mount of the sandbox's tmpfs made for the snapshot only: mkfs.erofs
        resolves its source path, which a /proc/<init>/fd link to a detached mount is not."""
        assert isinstance(sb, ContainerSandbox)
        mnt = f"{sb.sdir}/snapshot"
        os.makedirs(mnt, exist_ok=True)
        linux.mount_clone(sb.rw, mnt)
        try:
            yield f"{mnt}/upper", list(sb.layers)
        finally:
            linux.umount_or_detach(mnt)
            os.rmdir(mnt)

    async def changes(self, sb: Sandbox, req: ChangesRequest) -> ChangesReply:
        """The upper directory on the sandbox's tmpfs, reached through init's clone of it (no
        mount needed: nothing resolves a path there but the walk, with dir fds)."""
        assert isinstance(sb, ContainerSandbox)
        return await self.frozen_changes(sb, f"{sb.rw}/upper", req)

    # ------------------------------------------------------------------ exec

    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
        assert isinstance(sb, ContainerSandbox)
        return await exec_in(sb, req, on_chunk)

    # ------------------------------------------------------------------ files

    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
        assert isinstance(sb, ContainerSandbox)
        return await asyncio.to_thread(confine.read, sb.rootfs, path, max_bytes)

    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        assert isinstance(sb, ContainerSandbox)
        await asyncio.to_thread(self._write, sb, path, data, mode, make_parents)

    @staticmethod
    def _write(sb: ContainerSandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        with userns.acting_as(sb.uid_base):  # owned by the sandbox's root, as its own writes are
            confine.write(sb.rootfs, path, data, mode, make_parents)

    async def connect_port(self, sb: Sandbox, port: int) -> socket.socket:
        assert isinstance(sb, ContainerSandbox)
        if sb.pidfd is None:
            raise Unavailable(f"sandbox {sb.id}'s init cannot be tracked; its network cannot be entered safely")

        def make() -> socket.socket:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)

        try:
            s = await asyncio.to_thread(linux.in_netns, sb.init_pid, make, sb.pidfd)
        except ProcessLookupError:
            raise Unavailable(f"sandbox {sb.id} has exited") from None
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port)), 10)
        except ConnectionRefusedError:
            s.close()
            raise Unavailable(f"nothing listens on 127.0.0.1:{port} inside sandbox {sb.id} (yet)") from None
        except (TimeoutError, OSError) as e:
            s.close()
            raise Unavailable(f"cannot connect to 127.0.0.1:{port} inside sandbox {sb.id}: {e or 'timed out'}") from None
        return s

    # ------------------------------------------------------------------ pause / usage

    async def pause(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        self.settle(sb)
        if sb.paused:
            return
        # the v1 freezer gives up ("unable to freeze") when tasks keep forking or sit in the
        # kernel on a loaded host; thaw and try again a few times before reporting it
        for attempt in range(4):
            try:
                await runc_cli.simple(self.runc, self.runc_root, "pause", sb.id)
                break
            except Internal:
                if attempt == 3:
                    raise
                try:
                    await runc_cli.simple(self.runc, self.runc_root, "resume", sb.id)
                except Internal:
                    pass  # it was not left frozen
                await asyncio.sleep(0.05 * (attempt + 1))
        sb.paused = True

    async def resume(self, sb: Sandbox) -> None:
        assert isinstance(sb, ContainerSandbox)
        self.settle(sb)
        if not sb.paused:
            return
        await runc_cli.simple(self.runc, self.runc_root, "resume", sb.id)
        sb.paused = False

    @contextlib.asynccontextmanager
    async def frozen(self, sb: Sandbox) -> AsyncIterator[None]:
        """Frozen through the sandbox's cgroup freezer itself rather than `runc pause` and
        `resume`: two runc processes less on the clock of a fork or a `changes` (runc reads a
        container's paused state from that same freezer). Pause and resume requests wait for it
        (they take `changes_lock` too), so a thaw here never undoes one."""
        assert isinstance(sb, ContainerSandbox)
        async with sb.changes_lock:
            if sb.paused:
                yield
                return
            if not await asyncio.to_thread(sb.cg.freeze, FREEZE_TIMEOUT_S):
                sb.cg.thaw()
                raise Unavailable(f"sandbox {sb.id} could not be frozen to read its files; retry", retry_after_s=0.5)
            try:
                yield
            finally:
                sb.cg.thaw()


    async def usage(self, sb: Sandbox) -> Usage:
        assert isinstance(sb, ContainerSandbox)
        return Usage(cpu_ns=sb.cg.cpu_usage_ns(), memory_bytes=sb.cg.memory_bytes(), pids=sb.cg.pids_current())

    async def close(self) -> None:
        if self.ns_helper is not None:
            await asyncio.to_thread(self.ns_helper.close)

    # ------------------------------------------------------------------ crash recovery

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        adopted, report = await asyncio.to_thread(self._reconcile)
        removed = await self.layers.adopt([sb.layers for sb in adopted if isinstance(sb, ContainerSandbox)])
        if removed:
            report.notes.append(f"unmounted {len(removed)} unused layer mount(s)")
        return adopted, report

    def _adopted(self, rec: Record, sdir: str, cg: cgroups.Cgroups, init_pid: int) -> ContainerSandbox:
        return ContainerSandbox(rec.info, rec.spec, sdir, cg, init_pid, rec.layers)

    def _reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        report = AdoptReport()
        adopted: list[Sandbox] = []
        runc_states = runc_cli.states(self.runc, self.runc_root)
        seen: set[str] = set()
        warm = 0
        for sid in sorted(os.listdir(self.sandboxes_dir)) if os.path.isdir(self.sandboxes_dir) else []:
            sdir = f"{self.sandboxes_dir}/{sid}"
            seen.add(sid)
            cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
            if sid.startswith(WARM_PREFIX):  # never claimed: not a user's sandbox, no event
                self._teardown(sid, sdir, cg, None)
                warm += 1
                continue
            rec = load_record(f"{sdir}/sandbox.json", Record)
            st = runc_states.get(sid)
            if rec is not None and st is not None and st.get("status") in ("running", "paused") and init_responsive(f"{sdir}/ctl.sock", st.get("status") == "paused"):
                sb = self._adopted(rec, sdir, cg, int(st.get("pid") or rec.init_pid))
                sb.paused = st.get("status") == "paused"
                sb.uid_base = userns.read_base(sdir)
                adopt_exec_groups(cg, sb.lingering)
                if rec.spec.network == "allowlist":
                    self.egress.adopt(sid, sdir, egress.check(rec.spec.network, rec.spec.egress))
                adopted.append(sb)
                report.adopted.append(sid)
                continue
            self._teardown(sid, sdir, cg, None)
            report.cleaned.append(sid)
        for sid in runc_states:
            if sid not in seen:
                cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
                self._teardown(sid, f"{self.sandboxes_dir}/{sid}", cg, None)
                if sid.startswith(WARM_PREFIX):
                    warm += 1
                    continue
                report.cleaned.append(sid)
                report.notes.append(f"runc container {sid} had no sandbox record")
        # cgroups with neither a record nor a container
        parent = cgroups.Cgroups(self.cgroup_parent)
        for d in parent.all_dirs():
            for sid in os.listdir(d):
                if os.path.isdir(f"{d}/{sid}") and sid not in seen and sid not in runc_states:
                    cgroups.Cgroups(f"{self.cgroup_parent}/{sid}").destroy(timeout=5)
                    if sid not in report.cleaned and not sid.startswith(WARM_PREFIX):
                        report.cleaned.append(sid)
                        report.notes.append(f"stray cgroup {sid} removed")
        if warm:
            report.notes.append(f"removed {warm} unclaimed warm-pool sandbox(es)")
        if self.uids is not None:
            freed = self.uids.sweep({sb.uid_base for sb in adopted if isinstance(sb, ContainerSandbox)})
            if freed:
                report.notes.append(f"released {len(freed)} host uid range(s) no sandbox holds")
        return adopted, report

