"""The `microvm` substrate: each sandbox is a QEMU `-M microvm` guest with a kernel of its own, so
code inside reaches the host only through QEMU's few virtio devices, never the host kernel's
system calls.

The guest (microvm_guest.py) boots the distribution's kernel with corral's initramfs; the image's
EROFS layers, as the node's loader presents them (fetched lazily, block by block), are read-only
virtio block devices under an overlay whose upper is a tmpfs of `disk_mb` inside the guest; the
guest agent answers on a virtio-serial port (microvm_channel.py). No network device: network none.

KVM when the host's passes a real boot (probed once per host, cached in GUEST_CACHE; a nested
KVM that creates VMs but never runs a vCPU is common), TCG otherwise (`CORRAL_MICROVM_ACCEL`
forces one). QEMU runs in the sandbox's cgroup: cpu as asked, memory as the guest's RAM plus
QEMU's own share. The guest's RAM is memory_mb + disk_mb (its writable layer lives in it) and a
base share; inside, memory_mb binds the sandbox's processes (its cgroup's memory.max), what they
write to its files included, as on a container.

Warm pools (`--warm-pool microvm:IMAGE=N`) keep booted guests stopped, for creates whose RAM
and vCPUs are the defaults. A streaming exec gets its output every ~0.1 s as the guest agent finds
it. Sessions are shells the guest agent keeps (guest/agent.sh). Inside the guest, the sandbox's
commands run in namespaces of their own without a capability, harness commands as HARNESS_UID
(init/corral-guest.c), out of reach of the agent, which is the guest's root. A memory snapshot
saves the whole guest (microvm_qmp.py); a create of its image resumes it. `changes` and file
snapshots read the writable layer through the agent (microvm_upper.py). Protected paths and
canaries are guarded by fanotify in the guest's own kernel (corral-guest guard), reported over the
channel, as is the sandbox's file activity (opens, writes, execs). QEMU runs in a session of its
own and outlives the node-agent: a restarted agent adopts the guests (microvm_adopt.py). Not yet
(a clear error): forks."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import signal
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

import msgspec

from corral_common.contract.errors import Conflict, Forbidden, Internal, InvalidRequest, NotFound, Unavailable
from corral_common.contract.images import GuestMemory
from corral_common.contract.messages import HARNESS_UID, ChangesReply, ChangesRequest, ExecRequest, ExecResult, SandboxInfo, SandboxSpec

from .. import cgroups
from ..layermounts import ImageFiles, LayerMounts
from ..sessions import SHELLS
from . import microvm_accel, microvm_adopt, microvm_qmp, microvm_upper
from .base import AdoptReport, ChunkCallback, GuardedOpen, Sandbox, Substrate, Usage
from .common import load_record, result_stderr, save_record
from .container import WARM_PREFIX
from .container_sandbox import DEFAULT_ENV
from .microvm_channel import ExecDone, GuestChannel, SessionCall
from .microvm_guest import Guest, ensure_guest
from .microvm_process import QemuProcess
from .microvm_scripts import exec_script, session_script

log = logging.getLogger("corral.node.microvm")

BOOT_TIMEOUT_S = 25.0  # under the scheduler's 30 s wait for a node: the node says why, not the scheduler "no answer"
#: QEMU's own memory beside the guest's RAM (its code, TCG's translation cache of TB_SIZE_MB)
QEMU_OVERHEAD_MB = 160
TB_SIZE_MB = 32
#: the guest kernel, its page cache of the image and the agent, beside memory_mb and disk_mb
GUEST_BASE_MB = 64
QEMU_TASKS = 64
UPPER_S = 60.0  # the guest's writable layer read for `changes` or a snapshot: + 0.1 s per MiB of disk_mb
BOOT_CPU = 1.0  # the cpu quota while the guest boots (the asked one, if lower, after)
#: what warm-pool guests boot with: the defaults, so a create that names no sizes claims one
WARM_SPEC = SandboxSpec(image="busybox")


class MicrovmSandbox(Sandbox):
    def __init__(self, info: SandboxInfo, spec: SandboxSpec, sdir: str, cg: cgroups.Cgroups,
                 proc: QemuProcess, chan: GuestChannel, files: ImageFiles, append: str):
        super().__init__(info, spec)
        self.sdir = sdir
        self.cg = cg
        self.proc = proc
        self.chan = chan
        self.files = files  # its disks' layers (and the memory it was resumed from): released at destroy
        self.append = append  # the kernel command line it booted with (a memory snapshot records it)
        self.exit_watch: asyncio.Task[None] | None = None
        self.destroying = False
        self.session_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # a session's calls take turns


class MicrovmSubstrate(Substrate):
    name = "microvm"
    snapshots_memory = True
    protects_paths = True
    guards_paths = True
    #: QEMU's machine: microvm has no PCI bus, no firmware and no ACPI tables to walk at boot
    machine = "microvm,x-option-roms=off,rtc=off"
    #: the transport of the virtio devices on that machine (virtio-blk-device, virtio-blk-pci)
    virtio = "device"

    def __init__(self, node: str, state_dir: str, layers: LayerMounts):
        self.node = node
        self.state_dir = state_dir
        self.layers = layers
        self.sandboxes_dir = f"{state_dir}/{self.name}"
        tag = hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:8]
        self.cgroup_parent = f"/corral/{node}-{tag}-{self.name}"
        self.qemu = shutil.which("qemu-system-x86_64") or ""
        self.accel = ""
        self.guest: Guest | None = None

    async def start(self) -> None:
        if not self.qemu:
            raise Unavailable("QEMU is not installed (apt-get install qemu-system-x86)")
        if os.geteuid() != 0:
            raise Unavailable(f"the {self.name} substrate needs root (cgroups, the loader's layer files)")
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        with open(f"{self.state_dir}/cgroup-parent-{self.name}", "w") as f:  # for the stack's last-resort sweep
            f.write(self.cgroup_parent + "\n")
        self.guest = await asyncio.to_thread(ensure_guest)
        self.accel = await microvm_accel.choose(self)
        log.info(f"{self.name} substrate ready", extra={"fields": {"accel": self.accel, "kernel": self.guest.version}})

    def kernel_cmdline(self, accel: str, extra: str) -> str:
        return f"console=ttyS0 quiet panic=-1 {microvm_accel.clock_args(accel)} {extra}"

    def qemu_argv(self, accel: str, mem_mb: int, cpus: int, append: str, serial: str, sdir: str = "",
              layer_files: list[str] | None = None, incoming_fd: int = -1) -> list[str]:
        assert self.guest is not None
        argv = [self.qemu, "-M", self.machine,
                "-accel", f"tcg,tb-size={TB_SIZE_MB}" if accel == "tcg" else "kvm",
                "-cpu", "max" if accel == "tcg" else "host", "-m", str(mem_mb), "-smp", str(cpus),
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                "-kernel", self.guest.kernel, "-initrd", self.guest.initrd,
                "-append", append, "-serial", serial]
        if sdir:
            argv += ["-device", f"virtio-serial-{self.virtio}",
                     "-chardev", f"socket,id=agent,path={sdir}/agent.sock,server=on,wait=off",
                     "-device", "virtserialport,chardev=agent,name=corral",
                     "-qmp", f"unix:{sdir}/qmp.sock,server=on,wait=off"]
        for i, path in enumerate(layer_files or []):
            argv += ["-drive", f"id=l{i},file={path},format=raw,if=none,readonly=on,file.locking=off",
                     "-device", f"virtio-blk-{self.virtio},drive=l{i},serial=l{i}"]
        if incoming_fd >= 0:  # a saved guest's state, read from this descriptor instead of booting
            argv += ["-incoming", f"fd:{incoming_fd}"]
        return argv

    # ------------------------------------------------------------------ life cycle

    async def create(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        """Boot the guest, or, when the image is a memory snapshot, resume the saved one: QEMU
        reads its state from the loader's file of it (`-incoming`), on the same disks."""
        if spec.fork_of:
            raise InvalidRequest(f"{self.name} sandboxes cannot be forked yet (the container substrate's can)")
        sid = info.id
        files = await self.layers.files(spec.image)
        saved = files.memory
        if saved is not None:
            try:
                self._check_resumable(spec, saved)
            except BaseException:
                await self.layers.release_files(files.digests)
                raise
        sdir = f"{self.sandboxes_dir}/{sid}"
        cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
        proc: QemuProcess | None = None
        chan = GuestChannel(f"{sdir}/agent.sock")
        mem_fd = -1
        try:
            os.makedirs(sdir, mode=0o700)
            with open(f"{sdir}/layers.json", "w") as f:
                json.dump(files.digests, f)
            guest_mb = spec.memory_mb + spec.disk_mb + GUEST_BASE_MB
            await asyncio.to_thread(self._make_cgroup, cg, max(spec.cpu, BOOT_CPU), guest_mb + QEMU_OVERHEAD_MB)
            append = saved.append if saved else self.kernel_cmdline(
                self.accel, f"corral_disk={spec.disk_mb} corral_layers={len(files.paths)} corral_host={sid} corral_pids={spec.pids_max} "
                f"corral_mem={spec.memory_mb}")
            if saved:
                mem_fd = os.open(files.memory_path, os.O_RDONLY | os.O_CLOEXEC)
            argv = self.qemu_argv(self.accel, guest_mb, _vcpus(spec.cpu), append, f"file:{sdir}/console.log", sdir, files.paths, mem_fd)
            proc = await asyncio.to_thread(QemuProcess.start, argv, f"{sdir}/qemu.log", (mem_fd,) if saved else ())
            cg.add(proc.pid)
            with open(f"{sdir}/qemu.pid", "w") as f:
                f.write(str(proc.pid))
            ended = asyncio.create_task(proc.wait())
            try:
                if saved:
                    try:
                        await microvm_qmp.load(f"{sdir}/qmp.sock", ended)
                    except Internal as e:
                        raise Internal(f"{self.name} {sid} could not resume image {spec.image!r} ({e}): {self.failure_text(sdir)}") from None
                boot = asyncio.create_task(chan.connect(BOOT_TIMEOUT_S))
                await asyncio.wait({boot, ended}, return_when=asyncio.FIRST_COMPLETED)
                if not boot.done():
                    boot.cancel()
                    with contextlib.suppress(BaseException):
                        await boot
                    raise Internal(f"{self.name} {sid} stopped while booting: {self.failure_text(sdir)}")
            finally:
                ended.cancel()
                with contextlib.suppress(BaseException):
                    await ended
            try:
                boot.result()
            except Unavailable as e:
                raise Internal(f"{self.name} {sid} did not come up ({e}): {self.failure_text(sdir)}") from None
            if saved:
                await self._become(chan, info, spec)
            if spec.cpu < BOOT_CPU:
                cg.set_cpu(spec.cpu)
            sb = MicrovmSandbox(info, spec, sdir, cg, proc, chan, files, append)
            self._persist(sb)
        except BaseException:
            await asyncio.shield(chan.close())
            await asyncio.shield(self._teardown(sid, sdir, cg, proc, files.digests))
            raise
        finally:
            if mem_fd >= 0:
                os.close(mem_fd)
        return sb

    @staticmethod
    def _persist(sb: MicrovmSandbox) -> None:
        """The record a successor adopts the guest by (not a warm one's: those are cleaned up)."""
        if not sb.id.startswith(WARM_PREFIX):
            save_record(sb.sdir, microvm_adopt.GuestRecord(info=sb.info, spec=sb.spec, files=sb.files, append=sb.append))

    def _check_resumable(self, spec: SandboxSpec, saved: GuestMemory) -> None:
        """A saved guest resumes only on the machine it was saved from: the same device layout,
        guest kernel and initramfs, accelerator, RAM and vCPUs."""
        assert self.guest is not None
        image = spec.image
        if saved.substrate != self.name:
            raise InvalidRequest(f"image {image!r} is a memory snapshot of a {saved.substrate} guest; create it with substrate {saved.substrate!r}")
        asked = (spec.memory_mb, spec.disk_mb, _vcpus(spec.cpu))
        if asked != (saved.memory_mb, saved.disk_mb, saved.vcpus):
            raise InvalidRequest(f"image {image!r} is a memory snapshot of a guest with memory_mb={saved.memory_mb}, disk_mb={saved.disk_mb} "
                                 f"and {saved.vcpus} vCPU(s), which a resumed guest keeps; this create asks for memory_mb={asked[0]}, "
                                 f"disk_mb={asked[1]} and {asked[2]} vCPU(s)")
        if (saved.guest, saved.accel) != (self.guest.tag, self.accel):
            raise InvalidRequest(f"image {image!r} is a memory snapshot of a guest kernel {saved.guest} under {saved.accel}; node {self.node} "
                                 f"runs {self.guest.tag} under {self.accel}, which cannot resume it")

    @staticmethod
    async def _become(chan: GuestChannel, info: SandboxInfo, spec: SandboxSpec) -> None:
        """Inside a guest that started as another (a warm pool's, a memory snapshot's source): the
        host name, pids.max and the clock (which stood still while it was stopped) made this
        sandbox's."""
        done = await chan.exec(f"hostname {shlex.quote(info.id)} && echo {spec.pids_max} > /sys/fs/cgroup/sandbox/pids.max "
                               f"&& /bin/busybox date -s @{int(time.time())} >/dev/null\n", b"", 10, 4096)
        if done.exit_code != 0:
            raise Internal(f"the guest could not become {info.id}: {done.stderr.decode(errors='replace').strip()}")

    # ------------------------------------------------------------------ warm pool

    def warm_serves(self, spec: SandboxSpec) -> bool:
        """A warm guest was booted with the default spec's RAM (memory_mb + disk_mb) and one vCPU,
        which a running guest cannot change: it serves specs with the same."""
        return (spec.memory_mb, spec.disk_mb, _vcpus(spec.cpu)) == (WARM_SPEC.memory_mb, WARM_SPEC.disk_mb, _vcpus(WARM_SPEC.cpu))

    async def create_warm(self, image: str) -> Sandbox:
        """A guest booted under an internal id (WARM_PREFIX) and stopped (QMP `stop`: no CPU
        until a claim). A restarted node-agent cleans it up with the rest."""
        now = time.time()
        info = SandboxInfo(id=f"{WARM_PREFIX}{secrets.token_hex(6)}", node=self.node, state="paused", substrate=self.name,
                           image=image, created_at=now, expires_at=now + 365 * 86400)
        sb = await self.create(info, msgspec.structs.replace(WARM_SPEC, image=image))
        try:
            await self.pause(sb)
        except BaseException:
            await asyncio.shield(self.destroy(sb))
            raise
        return sb

    async def claim_warm(self, sb: Sandbox, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        """The warm guest becomes `info.id`: its dir and cgroup renamed, its cpu quota the spec's,
        running again, and inside it the host name, pids.max and the clock (which stood still
        while it was stopped) set by the agent."""
        assert isinstance(sb, MicrovmSandbox)
        old = sb.id
        try:
            sdir = f"{self.sandboxes_dir}/{info.id}"
            os.rename(sb.sdir, sdir)  # QEMU's sockets move with it: they are found by inode
            sb.sdir = sdir
            sb.cg = sb.cg.rename(f"{self.cgroup_parent}/{info.id}")
            sb.cg.set_cpu(spec.cpu)
            await self.resume(sb)
            await self._become(sb.chan, info, spec)
        except BaseException:
            await asyncio.shield(self.destroy(sb))
            raise
        sb.info, sb.spec, sb.warm_id = info, spec, old
        self._persist(sb)
        return sb

    @staticmethod
    def _make_cgroup(cg: cgroups.Cgroups, cpu: float, memory_mb: int) -> None:
        cg.make()
        cg.set_limits(cpu, memory_mb, QEMU_TASKS)

    @staticmethod
    def failure_text(sdir: str) -> str:
        """The end of QEMU's log and the guest's console, for an error."""
        out = []
        for name in ("qemu.log", "console.log"):
            with contextlib.suppress(OSError), open(f"{sdir}/{name}", errors="replace") as f:
                text = f.read()[-400:].strip()
                if text:
                    out.append(f"{name}: {text}")
        return "; ".join(out) or "no output"

    def watch_exit(self, sb: Sandbox, callback: Callable[[Sandbox], None]) -> None:
        assert isinstance(sb, MicrovmSandbox)

        async def watch() -> None:
            await sb.proc.wait()
            if not sb.destroying:
                callback(sb)

        sb.exit_watch = asyncio.create_task(watch())

    async def destroy(self, sb: Sandbox) -> None:
        assert isinstance(sb, MicrovmSandbox)
        sb.destroying = True
        await sb.chan.close()
        if sb.exit_watch is not None:
            sb.exit_watch.cancel()
            with contextlib.suppress(BaseException):
                await sb.exit_watch
        await self._teardown(sb.id, sb.sdir, sb.cg, sb.proc, sb.files.digests)

    async def _teardown(self, sid: str, sdir: str, cg: cgroups.Cgroups, proc: QemuProcess | None,
                        layers: list[str]) -> None:
        if proc is not None:
            proc.kill()
            await proc.wait()
            proc.close()
        await asyncio.to_thread(self._remove, sdir, cg)
        await self.layers.release_files(layers)

    @staticmethod
    def _remove(sdir: str, cg: cgroups.Cgroups) -> None:
        cg.destroy(timeout=10)
        shutil.rmtree(sdir, ignore_errors=True)

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        """A predecessor's guests that still run, with a record, are adopted (microvm_adopt.py);
        the rest (a pool's, half made, ended) are killed through their cgroups and their files
        removed, their layers given back to the loader."""
        report = AdoptReport()
        adopted: list[Sandbox] = []
        warm = 0
        for sid in sorted(os.listdir(self.sandboxes_dir)) if os.path.isdir(self.sandboxes_dir) else []:
            sdir = f"{self.sandboxes_dir}/{sid}"
            cg = cgroups.Cgroups(f"{self.cgroup_parent}/{sid}")
            rec = load_record(f"{sdir}/sandbox.json", microvm_adopt.GuestRecord)
            if rec is not None and not sid.startswith(WARM_PREFIX):
                got = await microvm_adopt.reattach(sdir, cg)
                if not isinstance(got, str):
                    sb = MicrovmSandbox(rec.info, rec.spec, sdir, cg, got.proc, got.chan, rec.files, rec.append)
                    sb.paused = got.paused
                    if sb.paused:
                        sb.info.state = "paused"
                    adopted.append(sb)
                    report.adopted.append(sid)
                    continue
                report.notes.append(f"{sid} not adopted: {got}")
            layers: list[str] = rec.files.digests if rec is not None else []
            if rec is None:
                with contextlib.suppress(OSError, ValueError), open(f"{sdir}/layers.json") as f:
                    layers = list(json.load(f))
            await asyncio.to_thread(self._remove, sdir, cg)
            if layers:
                await self.layers.release_files(layers)
            if sid.startswith(WARM_PREFIX):  # never claimed: not a user's sandbox, no event
                warm += 1
            else:
                report.cleaned.append(sid)
        if warm:
            report.notes.append(f"removed {warm} unclaimed warm-pool guest(s)")
        if adopted:  # cgroups of no guest's dir (a create cut off between the two) go
            await asyncio.to_thread(self._sweep_strays, {sb.id for sb in adopted})
        else:
            await asyncio.to_thread(cgroups.Cgroups(self.cgroup_parent).destroy, 5)
        return adopted, report

    def _sweep_strays(self, keep: set[str]) -> None:
        for d in cgroups.Cgroups(self.cgroup_parent).all_dirs():
            for sid in os.listdir(d):
                if os.path.isdir(f"{d}/{sid}") and sid not in keep:
                    cgroups.Cgroups(f"{self.cgroup_parent}/{sid}").destroy(timeout=5)

    # ------------------------------------------------------------------ operations

    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
        assert isinstance(sb, MicrovmSandbox)
        if sb.paused:
            raise Conflict(f"sandbox {sb.id} is paused; resume it before exec")
        for k in req.env:
            if not k or "=" in k or "\0" in k:
                raise InvalidRequest(f"invalid environment variable name {k!r}")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        if any("\0" in s for s in (*argv, *req.env.values(), req.cwd or "")):
            raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
        cwd = req.cwd or sb.spec.workdir or "/"
        if not cwd.startswith("/"):
            cwd = "/" + cwd
        t0 = time.perf_counter()
        if req.session:
            done = await self._session_exec(sb, req, on_chunk)
        else:
            done = await sb.chan.exec(exec_script(argv, {**DEFAULT_ENV, **sb.spec.env, **req.env}, cwd, req.harness),
                                      req.stdin.encode(), req.timeout_s, req.max_output_bytes, on_chunk)
        stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        code = 137 if done.timed_out else done.exit_code
        return ExecResult(exit_code=code, stdout=stdout, stderr=result_stderr(stderr, sb.spec, req, done.oom_killed, done.timed_out),
                          oom_killed=done.oom_killed, duration_ms=(time.perf_counter() - t0) * 1000, timed_out=done.timed_out,
                          truncated=max(done.out_size, done.err_size) > req.max_output_bytes,
                          signal=signal.SIGKILL.value if done.timed_out else (code - 128 if code > 128 else None))

    async def _session_exec(self, sb: MicrovmSandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecDone:
        """As on `container` (sessions.py): one shell per name whose cwd and exports carry over;
        the call's cwd and env applied in it before the command; a timeout kills the session,
        and the next call starts a new one."""
        shell = SHELLS[req.shell]
        if req.shell != "sh" and (await sb.chan.read_file(shell, 0)).rc != 0:
            raise InvalidRequest(f"a {req.shell} session needs {shell} in the image, and {sb.spec.image} has none")
        pre = [f"cd -- {shlex.quote(req.cwd)}"] if req.cwd else []
        pre += [f"export {k}={shlex.quote(v)}" for k, v in req.env.items()]
        call = SessionCall(name=req.session, pre=" && ".join(pre) or "true", uid=HARNESS_UID if req.harness else 0,
                           start=session_script(shell, {**DEFAULT_ENV, **sb.spec.env}, sb.spec.workdir or "/", req.harness))
        script = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
        async with sb.session_locks[req.session]:
            return await sb.chan.exec(script + "\n", req.stdin.encode(), req.timeout_s, req.max_output_bytes, on_chunk, call)

    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]:
        assert isinstance(sb, MicrovmSandbox)
        a = await sb.chan.read_file(_absolute(path), max_bytes + 1)
        if a.rc == 1:
            raise NotFound(f"no such file in the sandbox: {path}")
        if a.rc == 2:
            raise InvalidRequest(f"{path} is a directory")
        if a.rc == 4:
            raise InvalidRequest(f"{path} is not a regular file")
        if a.rc != 0:
            raise Forbidden(f"{path} cannot be read in sandbox {sb.id} (permission denied)")
        if len(a.data) > max_bytes:
            raise InvalidRequest(f"{path} is more than max_bytes={max_bytes}")
        return a.data, a.mode

    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        assert isinstance(sb, MicrovmSandbox)
        a = await sb.chan.write_file(_absolute(path), data, mode, make_parents)
        if a.rc == 1:
            raise NotFound(f"the directory of {path} does not exist in the sandbox")
        if a.rc == 4:
            raise InvalidRequest(f"{path} is not a regular file")
        if a.rc != 0:
            text = a.data.decode(errors="replace").strip()
            if "No space left" in text:
                raise InvalidRequest(f"no space left in the sandbox for {path} (disk_mb={sb.spec.disk_mb})")
            raise InvalidRequest(f"cannot write {path} in the sandbox: {text or 'failed'}")

    async def guard_paths(self, sb: Sandbox, on_open: Callable[[GuardedOpen], None],
                          activity: tuple[float, float] | None = None) -> None:
        assert isinstance(sb, MicrovmSandbox)
        sb.chan.on_guard = on_open
        if sb.paused:  # adopted stopped: the guard it has runs on, with its marks (a stopped guest could not answer)
            return
        a = await sb.chan.guard(list(sb.spec.protected_paths), list(sb.spec.canaries), activity)
        if a.rc != 0:
            raise InvalidRequest(f"the guest could not guard the protected paths and canaries: "
                                 f"{a.data.decode(errors='replace').strip() or 'failed'}")

    async def audit_barrier(self, sb: Sandbox) -> None:
        """The guard reports a guarded open before it answers it, and answers this (Q) once it
        has handed on every event it read before: all through the agent's one writer, so the
        answer comes after them."""
        assert isinstance(sb, MicrovmSandbox)
        if not sb.paused:  # (paused: nothing runs)
            await asyncio.wait_for(sb.chan.call("Q"), 30)

    # ------------------------------------------------------------------ its writable layer, on the host

    @contextlib.asynccontextmanager
    async def _upper(self, sb: Sandbox) -> AsyncIterator[str]:
        assert isinstance(sb, MicrovmSandbox)
        if sb.paused:  # QEMU stopped: its agent cannot answer, and must not run the guest to
            raise Conflict(f"sandbox {sb.id} is paused; resume it to read its files")
        async with microvm_upper.pulled(sb.chan, sb.sdir, UPPER_S + sb.spec.disk_mb / 10) as upper:
            yield upper

    @contextlib.asynccontextmanager
    async def snapshot_dir(self, sb: Sandbox) -> AsyncIterator[tuple[str, list[str]]]:
        assert isinstance(sb, MicrovmSandbox)
        async with self._upper(sb) as upper:
            yield upper, list(sb.files.layers)

    async def changes(self, sb: Sandbox, req: ChangesRequest) -> ChangesReply:
        from ..changes import list_changes

        async with sb.changes_lock, self._upper(sb) as upper:
            return await asyncio.to_thread(list_changes, upper, req)

    async def pause(self, sb: Sandbox) -> None:
        assert isinstance(sb, MicrovmSandbox)
        async with microvm_qmp.monitor(f"{sb.sdir}/qmp.sock") as q:
            await q.execute("stop")
        sb.paused = True

    async def resume(self, sb: Sandbox) -> None:
        assert isinstance(sb, MicrovmSandbox)
        async with microvm_qmp.monitor(f"{sb.sdir}/qmp.sock") as q:
            await q.execute("cont")
        sb.paused = False

    async def save_memory(self, sb: Sandbox, fd: int) -> tuple[GuestMemory, list[str]]:
        assert isinstance(sb, MicrovmSandbox) and self.guest is not None
        await microvm_qmp.save(f"{sb.sdir}/qmp.sock", fd, sb.paused)
        return GuestMemory(layer="", substrate=self.name, memory_mb=sb.spec.memory_mb, disk_mb=sb.spec.disk_mb, vcpus=_vcpus(sb.spec.cpu),
                           guest=self.guest.tag, accel=self.accel, append=sb.append), sb.files.layers

    async def usage(self, sb: Sandbox) -> Usage:
        assert isinstance(sb, MicrovmSandbox)
        return Usage(cpu_ns=sb.cg.cpu_usage_ns(), memory_bytes=sb.cg.memory_bytes(), pids=sb.cg.pids_current())

    def limit_counters(self, sb: Sandbox) -> tuple[int, int, str] | None:
        return None  # the host cgroup holds QEMU, not the guest's processes: its counters say nothing of them

    def audit_root(self, sb: Sandbox) -> str | None:
        return None


def _vcpus(cpu: float) -> int:
    return max(1, math.ceil(cpu))


def _absolute(path: str) -> str:
    if "\0" in path:
        raise InvalidRequest("path must not contain NUL bytes")
    return path if path.startswith("/") else "/" + path
