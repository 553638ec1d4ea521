"""A function call in a slot (function_slots.py): one `runc run -d` whose process is the command
itself, its stdin, stdout and stderr the call's pipes (runc passes them through). When the
command exits its pid namespace goes with it, so nothing it started outlives the call; a timeout
freezes and kills the sandbox's cgroup. Isolation is the `container` substrate's OCI config
(`oci.config`), less what a one-shot call has no use for (init, the io mount)."""
from __future__ import annotations

import asyncio
import errno
import functools
import os
import platform
import signal
import time
from typing import Any

import msgspec

from corral_common import linux, metrics
from corral_common.contract.errors import Internal, Unavailable
from corral_common.contract.messages import ExecRequest, ExecResult, SandboxSpec

from .. import cgroups, confine, oci, userns
from ..aio import wait_readable as _wait_readable
from ..output import PipeReader
from .base import ChunkCallback
from .common import result_stderr
from .container import ContainerSubstrate
from .container_exec import feed
from .function_filter import EXEC_IN_SANDBOX, CompiledFilters, profile_key
from .function_slots import Slot
from .runc_cli import wait_pid

SECCOMP = metrics.counter("corral_function_seccomp_total", "Function calls in slots by who gave them their seccomp filter: "
                          "compiled (corral-exec, the program captured from runc) or runc (compiling the profile)", ("node", "how"))
MS_REMOUNT = 32
NATIVE_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


@functools.cache
def seccomp_profile() -> dict[str, Any]:
    """A call's seccomp policy: the container substrate's without a listener, for only the
    architectures this kernel can present (the filter, and runc's work compiling it, shrinks;
    nothing is allowed that was denied: a foreign arch never matches here). Made once (it is
    the same for every call), and not to be changed."""
    profile = oci.seccomp_profile()
    profile["architectures"] = NATIVE_ARCHES.get(platform.machine(), profile["architectures"])
    return profile


@functools.cache
def seccomp_profile_key() -> str:
    return profile_key(seccomp_profile())


async def run_in_slot(sub: ContainerSubstrate, slot: Slot, spec: SandboxSpec, req: ExecRequest, argv: list[str],
                      env: dict[str, str], cwd: str, on_chunk: ChunkCallback | None,
                      filters: CompiledFilters | None = None) -> ExecResult:
    """The call's command as the container's process in `slot`, under `sub`'s runc, runc root,
    cgroup parent and init binary; its result once it exits (or its cgroup is killed at the
    timeout). With `filters` holding the policy's compiled program, corral-exec installs it and
    execs the command (function_filter.py). The slot is the caller's to release."""
    sid, sdir = slot.sid, slot.sdir
    t0 = time.perf_counter()
    if spec.disk_mb != slot.disk_mb:
        await asyncio.to_thread(linux.mount, "tmpfs", f"{sdir}/rw", "tmpfs",
                                MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV, f"size={spec.disk_mb}m")
        slot.disk_mb = spec.disk_mb
    if spec.workdir not in ("", "/"):
        await asyncio.to_thread(_mkdirs, slot, spec.workdir)
    if cwd != "/":
        problem = dir_problem(slot.rootfs, cwd)
        if problem:  # what the container substrate's init answers, instead of runc creating it
            return ExecResult(exit_code=126, stderr=f"corral: cannot change directory to {cwd}: {problem}\n",
                              duration_ms=(time.perf_counter() - t0) * 1000)
    cg = cgroups.Cgroups(f"{sub.cgroup_parent}/{sid}")
    cfg = oci.config(hostname=sid, init_path=sub.init_path, io_dir=f"{sdir}/io",
                     cgroups_path="/" + cg.rel, env=env, cpu=spec.cpu, memory_mb=spec.memory_mb, pids_max=spec.pids_max,
                     userns=(f"{sdir}/userns", slot.uid_base) if slot.uid_base else None)
    cfg["process"]["args"] = argv
    cfg["process"]["cwd"] = cwd
    if req.harness:
        cfg["process"]["user"] = {"uid": oci.HARNESS_ID, "gid": oci.HARNESS_ID}
    cfg["mounts"] = [m for m in cfg["mounts"] if not m["destination"].startswith("/.corral")]
    for ns in cfg["linux"]["namespaces"]:
        if ns["type"] == "network":
            ns["path"] = f"{sdir}/netns"
    cfg["linux"]["seccomp"] = profile = seccomp_profile()
    filter_fd = None
    if filters is not None and (filter_fd := filters.lookup(profile, seccomp_profile_key())) is not None:
        del cfg["linux"]["seccomp"]
        cfg["mounts"].append({"destination": EXEC_IN_SANDBOX, "type": "bind", "source": filters.exec_path,
                              "options": ["bind", "ro", "nosuid", "nodev"]})
        cfg["process"]["args"] = [EXEC_IN_SANDBOX, "--", *argv]
    SECCOMP.labels(sub.node, "runc" if filter_fd is None else "compiled").inc()
    with open(f"{sdir}/config.json", "wb") as f:
        f.write(msgspec.json.encode(cfg))
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    deadline = time.monotonic() + req.timeout_s
    try:
        pid = os.posix_spawn(sub.runc, [
            sub.runc, "--root", sub.runc_root, "--log", f"{sdir}/runc.log", "run", "-d",
            *(("--preserve-fds", "1") if filter_fd is not None else ()), "--pid-file", f"{sdir}/pid", "--bundle", sdir, sid,
        ], os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2),
            *([(os.POSIX_SPAWN_DUP2, filter_fd, 3)] if filter_fd is not None else []),
        ])
    except OSError:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    reader = PipeReader({"stdout": out_r, "stderr": err_r}, req.max_output_bytes, on_chunk)
    feeder = asyncio.create_task(feed(in_w, req.stdin.encode()))
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


def dir_problem(root: str, path: str) -> str:
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


def _mkdirs(slot: Slot, path: str) -> None:
    with userns.acting_as(slot.uid_base):  # owned by the sandbox's root
        confine.mkdirs(slot.rootfs, path)
