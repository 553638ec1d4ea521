"""The `function` substrate: one command in a fresh, throwaway sandbox, returned and gone.

Isolation is the `container` substrate's, from the same OCI config (`oci.config`): new pid, mount,
network, ipc, uts and cgroup namespaces, the same seccomp filter, empty capability sets,
no_new_privs, masked /proc corners, cgroup limits for memory, cpu and pids, and a root that is
overlayfs over the image's read-only EROFS layers with a private upper on a size-capped tmpfs.

What it leaves out is what a one-shot call does not need: there is no resident init, no control
socket and no `runc exec`. The command itself is the container's process, started by one
`runc run -d` whose stdin, stdout and stderr are the call's pipes (runc passes them through). When
the command exits, its pid namespace goes with it, so nothing it started outlives the call; a
timeout freezes and kills the sandbox's cgroup.

What does not depend on the call is done before it arrives, in two tiers per recently used image:

* *warm* sandboxes (`warm_per_image`, default 1): a complete container sandbox, made exactly as the
  `container` substrate makes one (corral-init as PID 1, same config) but never used. A call that
  finds one sets its cgroup limits (memory, cpu, pids), disk size and workdir to the call's spec
  and runs the command through init, like a container exec: a few milliseconds instead of a runc
  start. Refills wait until the node has been quiet for a moment, because making one costs a
  full runc start that back-to-back calls would otherwise compete with.
* *slots* (`slots_per_image`, default 2): layers mounted through the node's loader, tmpfs,
  overlay root, and a network namespace holding only `lo`, already up, which runc joins instead of
  creating one (which is also what makes runc fastest). A call without a warm sandbox takes a
  slot, applies its disk size and workdir, writes config.json, runs runc and waits. Cheap to
  refill, so back-to-back calls always find one.

The reply goes out as soon as the command has exited; the teardown (cgroup, runc state, mounts,
files, layer references) follows right after, off the caller's clock. Idle images' slots and warm
sandboxes are released after `slot_idle_s`; a node-agent restart cleans up everything it finds.
`CORRAL_FUNCTION_WARM` and `CORRAL_FUNCTION_SLOTS` set the two pool sizes (0 disables a tier)."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import msgspec

from corral_common import linux, metrics
from corral_common.contract import subjects
from corral_common.contract.errors import Internal, InvalidRequest, Unavailable
from corral_common.contract.messages import ExecRequest, ExecResult, SandboxInfo, SandboxSpec

from .. import cgroups, confine, oci
from ..aio import wait_readable as _wait_readable
from ..layermounts import LayerMounts
from ..output import PipeReader
from .base import AdoptReport, ChunkCallback, Sandbox
from .common import result_stderr
from .container import DEFAULT_ENV, ContainerSandbox, ContainerSubstrate, _feed, mount_root, readable, wait_pid

log = logging.getLogger("corral.node.function")

CALLS = metrics.counter("corral_function_calls_total", "Function calls by the tier that served them: warm (a ready "
                        "sandbox), slot (runc in a prepared root) or cold (root prepared during the call)", ("node", "tier"))

MS_REMOUNT = 32
CLONE_NEWNET = 0x40000000
ID_PREFIX = "fn-"
NATIVE_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
WARM_QUIET_S = 0.25  # make a warm sandbox only after this long without a call starting (and none tearing down)


@dataclass
class Hold:
    """The node's layer mounts of one image, taken once and shared by all its slots (so a call
    costs the loader no prepare/release round trip); given back once dropped and unused."""

    image: str
    lowers: list[str]
    layers: list[str]
    users: int = 0
    dropped: bool = False


@dataclass
class Slot:
    """A prepared, never used sandbox root: `sdir/rootfs` (overlay), `sdir/rw` (tmpfs upper),
    `sdir/netns` (a bind-mounted network namespace with lo up)."""

    sid: str
    sdir: str
    hold: Hold
    disk_mb: int
    made_at: float = field(default_factory=time.monotonic)

    @property
    def rootfs(self) -> str:
        return f"{self.sdir}/rootfs"


class FunctionSubstrate(ContainerSubstrate):
    name = "function"

    def __init__(self, node: str, state_dir: str, layers: LayerMounts, runc: str = "runc",
                 slots_per_image: int | None = None, max_images: int = 8, slot_idle_s: float = 120.0,
                 warm_per_image: int | None = None):
        super().__init__(node, state_dir, layers, runc)
        # own directories and runc root: the container substrate's reconciliation must never see
        # (or adopt) a function call, and ours must never touch a container sandbox
        self.sandboxes_dir = f"{state_dir}/functions"
        self.runc_root = f"{state_dir}/runc-fn"
        self.slots_per_image = int(os.environ.get("CORRAL_FUNCTION_SLOTS", 2)) if slots_per_image is None else slots_per_image
        self.warm_per_image = int(os.environ.get("CORRAL_FUNCTION_WARM", 1)) if warm_per_image is None else warm_per_image
        self.warm: dict[str, list[ContainerSandbox]] = {}
        self.warming: dict[str, asyncio.Task] = {}
        self.running_warm: dict[str, ContainerSandbox] = {}
        self.last_call = 0.0
        self.inflight = 0
        self.tearing = 0
        self.max_images = max_images
        self.slot_idle_s = slot_idle_s
        self.slots: dict[str, list[Slot]] = {}
        self.holds: dict[str, Hold] = {}
        self.hold_locks: dict[str, asyncio.Lock] = {}
        self.last_used: dict[str, float] = {}
        self.disk_hint: dict[str, int] = {}
        self.filling: dict[str, asyncio.Task] = {}
        self.running: dict[str, Slot] = {}
        self.tasks: set[asyncio.Task] = set()
        self.closing = False
        self.janitor: asyncio.Task | None = None

    async def start(self) -> None:
        await super().start()
        self.janitor = asyncio.create_task(self._janitor())

    # ------------------------------------------------------------------ not a long-lived sandbox

    async def create(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        raise InvalidRequest(f"substrate 'function' is one-shot: run a command with {subjects.SANDBOX_RUN} "
                             "(SDK client.run / client.call); for a sandbox that stays, use substrate 'container' or 'docker'")

    # ------------------------------------------------------------------ one-shot run

    async def run(self, info: SandboxInfo, spec: SandboxSpec, req: ExecRequest, on_chunk: ChunkCallback | None):
        if self.closing:
            raise Unavailable(f"node {self.node} is shutting down", retry_after_s=1)
        if req.session:
            raise InvalidRequest("sessions need a sandbox that stays: a function call is one-shot "
                                 "(create a 'container' or 'docker' sandbox for sessions)")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        env = {**DEFAULT_ENV, **spec.env, **req.env}
        for k in env:
            if not k or "=" in k or "\0" in k:
                raise InvalidRequest(f"invalid environment variable name {k!r}")
        cwd = req.cwd or spec.workdir or "/"
        if not cwd.startswith("/"):
            cwd = "/" + cwd
        if any("\0" in s for s in (*argv, *env.values(), cwd)):
            raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
        self.last_call = time.monotonic()
        self.inflight += 1
        try:
            wanted = list((await self.layers.catalog.image(spec.image)).layers)  # NotFound (with the list) for unknown images
            self.last_used[spec.image] = time.monotonic()
            self.disk_hint[spec.image] = spec.disk_mb
            sb = await self._take_warm(spec, wanted)
            if sb is not None:
                CALLS.labels(self.node, "warm").inc()
                info.id = sb.id
                self.running_warm[sb.id] = sb
                try:
                    async with self.watch_run(info, sb.rootfs):
                        result = await ContainerSubstrate.exec(self, sb, req, on_chunk)
                except BaseException:
                    await asyncio.shield(self._destroy_warm(sb))
                    raise
                return result, lambda: self._destroy_warm(sb)
            slot = await self._take(spec, wanted)
            info.id = slot.sid
            self.running[slot.sid] = slot
            try:
                async with self.watch_run(info, slot.rootfs):
                    result = await self._run_in(slot, spec, req, argv, env, cwd, on_chunk)
            except BaseException:
                await asyncio.shield(self._release(slot))
                raise
            return result, lambda: self._release(slot)
        finally:
            self.inflight -= 1
            self._refill_warm(spec.image)

    async def _run_in(self, slot: Slot, spec: SandboxSpec, req: ExecRequest, argv: list[str], env: dict[str, str],
                      cwd: str, on_chunk: ChunkCallback | None) -> ExecResult:
        sid, sdir = slot.sid, slot.sdir
        t0 = time.perf_counter()
        if spec.disk_mb != slot.disk_mb:
            await asyncio.to_thread(linux.mount, "tmpfs", f"{sdir}/rw", "tmpfs",
                                    MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV, f"size={spec.disk_mb}m")
            slot.disk_mb = spec.disk_mb
        if spec.workdir not in ("", "/"):
            await asyncio.to_thread(confine.mkdirs, slot.rootfs, spec.workdir)
        if cwd != "/":
            problem = _dir_problem(slot.rootfs, cwd)
            if problem:  # what the container substrate's init answers, instead of runc creating it
                return ExecResult(exit_code=126, stderr=f"corral: cannot change directory to {cwd}: {problem}\n",
                                  duration_ms=(time.perf_counter() - t0) * 1000)
        cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
        cfg = oci.config(hostname=sid, init_path=self.init_path, io_dir=f"{sdir}/io",
                         cgroups_path="/" + cg.rel, env=env, cpu=spec.cpu, memory_mb=spec.memory_mb, pids_max=spec.pids_max)
        cfg["process"]["args"] = argv
        cfg["process"]["cwd"] = cwd
        cfg["mounts"] = [m for m in cfg["mounts"] if not m["destination"].startswith("/.corral")]
        for ns in cfg["linux"]["namespaces"]:
            if ns["type"] == "network":
                ns["path"] = f"{sdir}/netns"
        # only the architectures this kernel can present: the filter (and runc's work compiling
        # it) shrinks, nothing is allowed that was denied (a foreign arch never matches here)
        cfg["linux"]["seccomp"]["architectures"] = NATIVE_ARCHES.get(platform.machine(), cfg["linux"]["seccomp"]["architectures"])
        with open(f"{sdir}/config.json", "wb") as f:
            f.write(msgspec.json.encode(cfg))
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        deadline = time.monotonic() + req.timeout_s
        try:
            pid = os.posix_spawn(self.runc, [
                self.runc, "--root", self.runc_root, "--log", f"{sdir}/runc.log", "run", "-d",
                "--pid-file", f"{sdir}/pid", "--bundle", sdir, sid,
            ], os.environ, file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2),
            ])
        except OSError:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        reader = PipeReader({"stdout": out_r, "stderr": err_r}, req.max_output_bytes, on_chunk)
        feeder = asyncio.create_task(_feed(in_w, req.stdin.encode()))
        try:
            try:
                rc = await asyncio.wait_for(wait_pid(pid), max(0.1, deadline - time.monotonic()) + 30)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                await wait_pid(pid)
                raise Unavailable(f"runc did not start function sandbox {sid} in time") from None
            if rc != 0:
                reader.drain()
                return _runc_failed(argv, reader.text("stderr"), _tail(f"{sdir}/runc.log"), t0)
            with open(f"{sdir}/pid") as f:
                cpid = int(f.read().strip())
            pidfd = os.pidfd_open(cpid)
            timed_out = False
            try:
                if not await _wait_readable(pidfd, deadline - time.monotonic()):
                    timed_out = True
                    await asyncio.to_thread(cgroups.kill_dirs, cg.all_dirs(), cg.v2, 5.0)
                    await _wait_readable(pidfd, 10)
                try:
                    si = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                except ChildProcessError:
                    si = None
            finally:
                os.close(pidfd)
        finally:
            feeder.cancel()
        await reader.finish(grace=0.2)
        code, sig = _status(si)
        oom = sig == signal.SIGKILL and cg.oom_kills() > 0
        stderr = result_stderr(reader.text("stderr"), spec, req, oom, timed_out)
        return ExecResult(exit_code=code, stdout=reader.text("stdout"), stderr=stderr,
                          duration_ms=(time.perf_counter() - t0) * 1000, timed_out=timed_out,
                          truncated=reader.truncated, oom_killed=oom, signal=sig)

    # ------------------------------------------------------------------ slots

    async def _take(self, spec: SandboxSpec, wanted: list[str]) -> Slot:
        image = spec.image
        self.last_used[image] = time.monotonic()
        self.disk_hint[image] = spec.disk_mb
        pool = self.slots.get(image, [])
        slot = None
        while pool:
            cand = pool.pop()
            if cand.hold.layers == wanted:
                slot = cand
                break
            self._spawn(self._release(cand))  # the image was re-imported since: stale
        if len(self.slots) > self.max_images:
            self._evict_lru()
        CALLS.labels(self.node, "slot" if slot is not None else "cold").inc()
        if slot is None:
            slot = await self._prepare(image, spec.disk_mb, wanted)
        self._refill(image)
        return slot

    def _refill(self, image: str) -> None:
        if self.closing or self.slots_per_image <= 0:
            return
        t = self.filling.get(image)
        if t is not None and not t.done():
            return
        self.filling[image] = asyncio.create_task(self._fill(image))

    async def _fill(self, image: str) -> None:
        try:
            while not self.closing and len(self.slots.get(image, [])) < self.slots_per_image:
                slot = await self._prepare(image, self.disk_hint.get(image, 1024), None)
                if self.closing or image not in self.last_used:
                    await self._release(slot)
                    return
                self.slots.setdefault(image, []).append(slot)
        except Exception as e:
            log.warning("could not prepare a function slot", extra={"fields": {"image": image, "error": str(e)}})

    async def _hold(self, image: str, wanted: list[str] | None) -> Hold:
        lock = self.hold_locks.setdefault(image, asyncio.Lock())
        async with lock:
            h = self.holds.get(image)
            if h is not None and (wanted is None or h.layers == wanted):
                return h
            lowers, layers = await self.layers.acquire(image)
            if h is not None:
                self._drop_hold(h)
            h = self.holds[image] = Hold(image=image, lowers=lowers, layers=layers)
            return h

    def _drop_hold(self, h: Hold) -> None:
        h.dropped = True
        if self.holds.get(h.image) is h:
            del self.holds[h.image]
        if h.users == 0 and h.layers:
            layers, h.layers = h.layers, []
            self._spawn(self.layers.release(layers))

    async def _prepare(self, image: str, disk_mb: int, wanted: list[str] | None) -> Slot:
        hold = await self._hold(image, wanted)
        hold.users += 1
        sid = f"{ID_PREFIX}{secrets.token_hex(6)}"
        slot = Slot(sid=sid, sdir=f"{self.sandboxes_dir}/{sid}", hold=hold, disk_mb=disk_mb)
        try:
            await asyncio.to_thread(self._prepare_sync, slot, ":".join(hold.lowers))
        except BaseException:
            await asyncio.shield(self._release(slot))
            raise
        return slot

    def _prepare_sync(self, slot: Slot, lower: str) -> None:
        sdir = slot.sdir
        os.makedirs(sdir, mode=0o700)
        os.makedirs(f"{sdir}/rw")
        os.makedirs(f"{sdir}/rootfs")
        mount_root(sdir, lower, slot.disk_mb)  # (with decodable handles: file activity with paths)
        make_netns(f"{sdir}/netns")

    async def _release(self, slot: Slot) -> None:
        """Remove everything of a slot or finished call: cgroup (and any process in it), runc
        state, mounts, files, layer references. Idempotent."""
        self.running.pop(slot.sid, None)
        self.tearing += 1
        try:
            await asyncio.to_thread(self._teardown_fn, slot.sid, slot.sdir)
        finally:
            self.tearing -= 1
            h, slot.hold = slot.hold, None  # type: ignore[assignment]
            if h is not None:
                h.users -= 1
                if h.dropped:
                    self._drop_hold(h)

    def _teardown_fn(self, sid: str, sdir: str) -> None:
        cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
        cg.destroy(timeout=10)
        # `runc delete` would do just this for a stopped container (its cgroup is gone already)
        shutil.rmtree(f"{self.runc_root}/{sid}", ignore_errors=True)
        linux.umount_all(sdir)
        cg.destroy(timeout=1)
        # runc also made the container's group in a hybrid host's empty v2 tree (what `runc delete`
        # would remove; cgroups.V1_ALL does not list it)
        cgroups.rmtree_cgroup(f"{cgroups.ROOT}/unified/{cg.rel}")
        shutil.rmtree(sdir, ignore_errors=True)

    def _evict_lru(self) -> None:
        for image in sorted(self.last_used, key=self.last_used.get)[: max(0, len(self.slots) - self.max_images)]:
            self._drop_image(image)

    def _drop_image(self, image: str) -> None:
        self.last_used.pop(image, None)
        for slot in self.slots.pop(image, []):
            self._spawn(self._release(slot))
        for sb in self.warm.pop(image, []):
            self._spawn(self._destroy_warm(sb))
        h = self.holds.get(image)
        if h is not None:
            self._drop_hold(h)

    async def _janitor(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.5, self.slot_idle_s / 4)))
            now = time.monotonic()
            for image, t in list(self.last_used.items()):
                if now - t > self.slot_idle_s:
                    self._drop_image(image)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------------ warm sandboxes

    async def _take_warm(self, spec: SandboxSpec, wanted: list[str]) -> ContainerSandbox | None:
        pool = self.warm.get(spec.image)
        while pool:
            sb = pool.pop()
            alive = sb.pidfd is not None and not readable(sb.pidfd, 0)
            if not alive or sb.layers != wanted:
                self._spawn(self._destroy_warm(sb))
                continue
            try:
                await asyncio.to_thread(self._fit, sb, spec)
            except OSError as e:  # e.g. a memory limit below what it already uses: not this one
                log.warning("warm sandbox does not fit the call", extra={"fields": {"sandbox": sb.id, "error": str(e)}})
                self._spawn(self._destroy_warm(sb))
                return None
            sb.spec = spec
            sb.info.job, sb.info.labels, sb.info.cpu, sb.info.memory_mb = spec.job, spec.labels, spec.cpu, spec.memory_mb
            return sb
        return None

    def _fit(self, sb: ContainerSandbox, spec: SandboxSpec) -> None:
        """Give a warm sandbox the call's limits (what runc set from the template spec)."""
        cg = sb.cg
        mem = spec.memory_mb << 20
        quota = max(1000, int(spec.cpu * 100_000))
        if cg.v2:
            _write(cg.path("", "memory.max"), str(mem))
            _write(cg.path("", "cpu.max"), f"{quota} 100000")
            _write(cg.path("", "pids.max"), str(spec.pids_max))
        else:
            _write(cg.path("memory", "memory.limit_in_bytes"), str(mem))
            _write(cg.path("memory", "memory.soft_limit_in_bytes"), str(mem // 4))
            _write(cg.path("cpu", "cpu.cfs_quota_us"), str(quota))
            _write(cg.path("pids", "pids.max"), str(spec.pids_max))
        if spec.disk_mb != sb.spec.disk_mb:
            linux.reconfigure(sb.rw, size=f"{spec.disk_mb}m")
        if spec.workdir not in ("", "/"):
            confine.mkdirs(sb.rootfs, spec.workdir)

    def _refill_warm(self, image: str) -> None:
        if self.closing or self.warm_per_image <= 0 or image not in self.last_used:
            return
        t = self.warming.get(image)
        if t is None or t.done():
            self.warming[image] = asyncio.create_task(self._warm_fill(image))

    async def _warm_fill(self, image: str) -> None:
        try:
            while not self.closing and image in self.last_used and len(self.warm.get(image, [])) < self.warm_per_image:
                quiet = time.monotonic() - self.last_call
                if self.inflight or self.tearing or quiet < WARM_QUIET_S:
                    await asyncio.sleep(max(0.01, WARM_QUIET_S - quiet))
                    continue
                sid = f"{ID_PREFIX}{secrets.token_hex(6)}"
                now = time.time()
                info = SandboxInfo(id=sid, node=self.node, state="creating", substrate="function", image=image,
                                   created_at=now, expires_at=now + 365 * 86400)
                spec = SandboxSpec(image=image, substrate="function", disk_mb=self.disk_hint.get(image, 1024))
                sb = await ContainerSubstrate.create(self, info, spec)
                assert isinstance(sb, ContainerSandbox)
                if self.closing or image not in self.last_used:
                    await self._destroy_warm(sb)
                    return
                self.warm.setdefault(image, []).append(sb)
        except Exception as e:
            log.warning("could not make a warm function sandbox", extra={"fields": {"image": image, "error": str(e)}})

    async def _destroy_warm(self, sb: ContainerSandbox) -> None:
        self.running_warm.pop(sb.id, None)
        self.tearing += 1
        try:
            await ContainerSubstrate.destroy(self, sb)
        finally:
            self.tearing -= 1

    # ------------------------------------------------------------------ restart, shutdown

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        """Nothing of a function call is worth adopting: a restarted agent cannot return its result.
        Every call and slot left behind is removed (processes, cgroups, runc state, mounts)."""
        report = await asyncio.to_thread(self._reconcile_fn)
        return [], report

    def _reconcile_fn(self) -> AdoptReport:
        report = AdoptReport()
        seen = set()
        for d in (self.sandboxes_dir, self.runc_root):
            if os.path.isdir(d):
                seen.update(n for n in os.listdir(d) if n.startswith(ID_PREFIX))
        parent = cgroups.Cgroups(self.cgroup_parent)
        for d in [*parent.all_dirs(), *([f"{cgroups.ROOT}/unified/{parent.rel}"] if not parent.v2 else [])]:
            if not os.path.isdir(d):
                continue
            seen.update(n for n in os.listdir(d) if n.startswith(ID_PREFIX) and os.path.isdir(f"{d}/{n}"))
        for sid in sorted(seen):
            self._teardown_fn(sid, f"{self.sandboxes_dir}/{sid}")
            report.cleaned.append(sid)
        if report.cleaned:
            report.notes.append(f"removed {len(report.cleaned)} function call(s)/slot(s) left by the previous node-agent")
        return report

    async def close(self) -> None:
        self.closing = True
        if self.janitor is not None:
            self.janitor.cancel()
        # refills in progress see `closing` and give back what they made; cancelling one half-way
        # through a create could leave its teardown running past our exit
        pending = [t for t in (*self.filling.values(), *self.warming.values()) if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=30)
        slots = [s for pool in self.slots.values() for s in pool] + list(self.running.values())
        self.slots.clear()
        await asyncio.gather(*(self._release(s) for s in slots), return_exceptions=True)
        warm = [sb for pool in self.warm.values() for sb in pool] + list(self.running_warm.values())
        self.warm.clear()
        await asyncio.gather(*(self._destroy_warm(sb) for sb in warm), return_exceptions=True)
        for h in list(self.holds.values()):
            self._drop_hold(h)
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


# ---------------------------------------------------------------------- helpers


def make_netns(path: str) -> None:
    """A fresh network namespace with only `lo`, up, kept alive by a bind mount at `path`.

    unshare(CLONE_NEWNET) moves only the calling thread, so a throwaway thread makes it; the
    agent's own threads stay in the host namespace."""
    import ctypes
    import fcntl

    libc = ctypes.CDLL(None, use_errno=True)
    err: list[BaseException] = []

    def run() -> None:
        try:
            if libc.unshare(CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), linux.SIOCGIFFLAGS, req))[1]
                fcntl.ioctl(s.fileno(), linux.SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | linux.IFF_UP))
            with open(path, "w"):
                pass
            linux.mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, "", linux.MS_BIND)
        except BaseException as e:  # reported to the caller
            err.append(e)

    t = threading.Thread(target=run, name="netns")
    t.start()
    t.join()
    if err:
        raise err[0]


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _dir_problem(root: str, path: str) -> str:
    """'' if `path` is a directory inside `root` (resolved as the sandbox would), else why not."""
    rootfd = os.open(root, confine.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = linux.openat2(rootfd, path, confine.O_PATH | os.O_DIRECTORY, 0, confine.RESOLVE)
        os.close(fd)
        return ""
    except OSError as e:
        return os.strerror(e.errno or errno.ENOENT)
    finally:
        os.close(rootfd)




def _status(si) -> tuple[int, int | None]:
    if si is None:
        return 255, None
    if si.si_code == os.CLD_EXITED:
        return si.si_status, None
    return 128 + si.si_status, si.si_status


def _runc_failed(argv: list[str], stderr: str, runc_log: str, t0: float) -> ExecResult:
    """runc exits non-zero only if the command never started: say why the way the container
    substrate's init does (127 not found, 126 not executable), or fail the call."""
    text = f"{stderr}\n{runc_log}"
    ms = (time.perf_counter() - t0) * 1000
    if "executable file not found" in text or ("no such file or directory" in text and "exec" in text):
        return ExecResult(exit_code=127, stderr=f"corral: cannot run {argv[0]}: No such file or directory\n", duration_ms=ms)
    if "permission denied" in text and "exec" in text:
        return ExecResult(exit_code=126, stderr=f"corral: cannot run {argv[0]}: Permission denied\n", duration_ms=ms)
    if "exec format error" in text:
        return ExecResult(exit_code=126, stderr=f"corral: cannot run {argv[0]}: Exec format error\n", duration_ms=ms)
    raise Internal(f"runc could not start the function sandbox: {(stderr.strip() or runc_log)[-2000:]}")


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""
