"""The `function` substrate: one command in a fresh, throwaway sandbox, returned and gone.

Isolation is the `container` substrate's, from the same OCI config (`oci.config`): new pid, mount,
network, ipc, uts and cgroup namespaces, the same seccomp filter, empty capability sets,
no_new_privs, masked /proc corners, cgroup limits for memory, cpu and pids, and a root that is
overlayfs over the image's read-only EROFS layers with a private upper on a size-capped tmpfs.

What it leaves out is what a one-shot call does not need: there is no resident init, no control
socket and no `runc exec`. The command itself is the container's process (function_run.py).

What does not depend on the call is done before it arrives, in two tiers per recently used image:

* *warm* sandboxes (`warm_per_image`, default 1): a complete container sandbox, made exactly as the
  `container` substrate makes one (corral-init as PID 1, same config) but never used. A call that
  finds one sets its cgroup limits (memory, cpu, pids), disk size and workdir to the call's spec
  and runs the command through init, like a container exec: a few milliseconds instead of a runc
  start. Refills wait until the node has been quiet for a moment, because making one costs a
  full runc start that back-to-back calls would otherwise compete with.
* *slots* (`slots_per_image`, default 2): layers mounted through the node's loader, tmpfs,
  overlay root, and a network namespace holding only `lo` (function_slots.py). A call without a
  warm sandbox takes a slot, applies its disk size and workdir, writes config.json, runs runc and waits. Cheap to
  refill, so back-to-back calls always find one.

A slot's runc gets no seccomp profile to compile: the call's process is corral-exec, which
installs the program runc compiled for that profile once (function_filter.py), then the command.

The reply goes out as soon as the command has exited; the teardown (cgroup, runc state, mounts,
files, layer references) follows right after, off the caller's clock. Idle images' slots and warm
sandboxes are released after `slot_idle_s`; a node-agent restart cleans up everything it finds.
`CORRAL_FUNCTION_WARM` and `CORRAL_FUNCTION_SLOTS` set the two pool sizes (0 disables a tier)."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time

from corral_common import linux, metrics
from corral_common.contract import subjects
from corral_common.contract.errors import InvalidRequest, Unavailable
from corral_common.contract.messages import ExecRequest, SandboxInfo, SandboxSpec

from .. import cgroups, confine, userns
from ..initbin import ensure_binary
from ..layermounts import LayerMounts
from .base import AdoptReport, ChunkCallback, Sandbox
from .container import ContainerSubstrate
from .container_sandbox import DEFAULT_ENV, ContainerSandbox
from .function_filter import CompiledFilters
from .function_run import run_in_slot
from .function_slots import Hold, Slot, prepare_slot
from .runc_cli import readable

log = logging.getLogger("corral.node.function")

CALLS = metrics.counter("corral_function_calls_total", "Function calls by the tier that served them: warm (a ready "
                        "sandbox), slot (runc in a prepared root) or cold (root prepared during the call)", ("node", "tier"))

ID_PREFIX = "fn-"
SCRATCH_MB = 1024  # cap of each in-memory dir of calls (_mount_scratch); pages are taken only as written
COMPILED_FILTER_ENV = "CORRAL_FUNCTION_COMPILED_FILTER"  # "off": runc compiles each call's seccomp profile
WARM_QUIET_S = 0.25  # make a warm sandbox only after this long without a call starting (and none tearing down)


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
        self.filters: CompiledFilters | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._mount_scratch)
        await super().start()
        self.janitor = asyncio.create_task(self._janitor())
        if os.environ.get(COMPILED_FILTER_ENV, "on") == "off":
            return
        try:
            exec_path = await asyncio.to_thread(ensure_binary, f"{self.state_dir}/bin", "corral-exec")
        except Unavailable as e:
            log.warning("function calls keep runc's seccomp compilation", extra={"fields": {"error": e.message}})
            return
        # the first call starts the capture (in the background), not this: reconcile() comes
        # after start() and removes every fn- directory it finds, a capture's too
        self.filters = CompiledFilters(self.runc, self.runc_root, self.sandboxes_dir, self.cgroup_parent, exec_path)

    def _mount_scratch(self) -> None:
        """Each call's bundle (config, pid file, runc's log, namespace binds) and runc's state for
        it live in memory: they are made and removed within the call, and on the node's disk
        (ext4, journalled) that churn cost ~10% of a call's CPU at 16 at once (36 vs 33 calls/s
        through the gateway). Kept across a node-agent restart (what it finds there is
        reconciled), removed at close."""
        for d, mode in ((self.sandboxes_dir, 0o711), (self.runc_root, 0o700)):
            os.makedirs(d, mode=mode, exist_ok=True)
            if not os.path.ismount(d):
                linux.mount("tmpfs", d, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"mode={mode:o},size={SCRATCH_MB}m")

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
                    result = await run_in_slot(self, slot, spec, req, argv, env, cwd, on_chunk, self.filters)
            except BaseException:
                await asyncio.shield(self._release(slot))
                raise
            return result, lambda: self._release(slot)
        finally:
            self.inflight -= 1
            self._refill_warm(spec.image)


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
            await asyncio.to_thread(prepare_slot, slot, ":".join(hold.lowers), self.uids, self.ns_helper)
        except BaseException:
            await asyncio.shield(self._release(slot))
            raise
        return slot


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
        base = userns.read_base(sdir)
        # runc also made the container's group in a hybrid host's empty v2 tree (what `runc delete`
        # would remove; cgroups.V1_ALL does not list it)
        cgroups.rmtree_cgroup(f"{cgroups.ROOT}/unified/{cg.rel}")
        shutil.rmtree(sdir, ignore_errors=True)
        if self.uids is not None:
            self.uids.release(base)

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
            with userns.acting_as(sb.uid_base):
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
        if self.uids is not None:
            self.uids.sweep(set())  # a warm sandbox's or a slot's that was half made
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
        if self.filters is not None:
            await self.filters.close()
        await super().close()
        for d in (self.sandboxes_dir, self.runc_root):
            if os.path.ismount(d):
                await asyncio.to_thread(linux.umount_or_detach, d)


# ---------------------------------------------------------------------- helpers


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
