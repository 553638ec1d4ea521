"""The seccomp program runc compiles for a function call's profile, taken once per node, so that
each call installs it (init/corral-exec.c) instead of runc compiling it again.

Why: runc compiles the OCI profile with libseccomp in every container it starts. A function call
is one container start, so at 16 calls at once on two cores that compiler was 13% of the machine's
CPU (perf: libseccomp in runc:[2:INIT]); a gateway call cost 72.4 ms of CPU, and 54.2 ms with the
captured program (the gateway's throughput, bench/gateway.py, is CPU-bound: 26 -> 36 calls/s).

Why this is the same filter: the program is not compiled here but read back from a container
runc started with the call's exact profile (the `linux.seccomp` section of its config): its
process is `corral-exec --hold`, and the node reads what runc installed with ptrace
(PTRACE_SECCOMP_GET_FILTER), requiring exactly one filter. (runc's output for one profile is not
byte-for-byte stable, its Go maps; tests/integration/test_function_filter.py compares programs
by what they answer.) Programs are keyed by the profile's
hash, so a call whose profile differs (another architecture list, a new policy) waits for its own
capture. corral-exec installs it as the container's process, after everything runc does and
just before the command's execve, where runc loads its own.

Until a capture has finished, and where one fails (ptrace refused, a kernel without
CONFIG_CHECKPOINT_RESTORE), calls keep runc's own seccomp: slower, never weaker."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
from typing import Any

import msgspec

from corral_common import linux

from .. import cgroups, oci
from .runc_cli import delete, log_tail, wait_pid

log = logging.getLogger("corral.node.function")

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_SECCOMP_GET_FILTER = 17, 0x4206, 0x4207, 0x420C
WALL = 0x40000000
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: where a call's container finds corral-exec (a read-only bind of the node's build)
EXEC_IN_SANDBOX = "/.corral/exec"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def profile_key(profile: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(profile, order="sorted")).hexdigest()


class CompiledFilters:
    """Captured programs by profile hash, each in a sealed memfd a call hands to corral-exec."""

    def __init__(self, runc: str, runc_root: str, sandboxes_dir: str, cgroup_parent: str, exec_path: str):
        self.where = (runc, runc_root, sandboxes_dir, cgroup_parent, exec_path)
        self.exec_path = exec_path
        self.fds: dict[str, int] = {}
        self.failed: set[str] = set()
        self.capturing: dict[str, asyncio.Task] = {}

    def lookup(self, profile: dict[str, Any], key: str = "") -> int | None:
        """The memfd holding `profile`'s program, or None (then runc compiles it) while it is
        being captured or if it cannot be. `key`: its profile_key, if the caller has it."""
        key = key or profile_key(profile)
        fd = self.fds.get(key)
        if fd is None and key not in self.failed and key not in self.capturing:
            self.capturing[key] = asyncio.create_task(self._capture(key, profile))
        return fd

    async def ready(self, profile: dict[str, Any]) -> bool:
        """Capture `profile`'s program now if it is not there yet; True once a call can use it."""
        self.lookup(profile)
        key = profile_key(profile)
        task = self.capturing.get(key)
        if task is not None:
            await asyncio.shield(task)
        return key in self.fds

    async def _capture(self, key: str, profile: dict[str, Any]) -> None:
        try:
            prog = await capture(*self.where, profile)
            fd = os.memfd_create("corral-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fd, prog)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.fds[key] = fd
            log.info("function seccomp filter captured", extra={"fields": {"profile": key[:12], "instructions": len(prog) // 8}})
        except Exception as e:  # calls keep runc's own seccomp: said once, not retried per call
            self.failed.add(key)
            log.warning("function calls keep runc's seccomp compilation: the compiled filter could not be taken",
                        extra={"fields": {"profile": key[:12], "error": str(e)}})
        finally:
            self.capturing.pop(key, None)

    async def close(self) -> None:
        """After any capture under way has finished (cancelled half-way, its container could
        outlive the node-agent)."""
        if self.capturing:
            await asyncio.wait(list(self.capturing.values()), timeout=30)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


async def capture(runc: str, runc_root: str, sandboxes_dir: str, cgroup_parent: str, exec_path: str,
                  profile: dict[str, Any]) -> bytes:
    """The one seccomp program runc installs for `profile`, read from a throwaway container (in
    the function substrate's dirs, runc root and cgroup parent under an `fn-` id, so a node-agent
    restart removes whatever a crash left of it with the calls' leftovers)."""
    sid = f"fn-filter-{secrets.token_hex(4)}"
    sdir = f"{sandboxes_dir}/{sid}"
    cg = cgroups.Cgroups(f"{cgroup_parent}/{sid}")
    os.makedirs(f"{sdir}/rootfs/.corral", mode=0o755)
    cfg = oci.config(hostname="corral-filter", init_path=exec_path, io_dir=sdir, cgroups_path="/" + cg.rel, env={},
                     cpu=1.0, memory_mb=128, pids_max=8)
    cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] != "/.corral/io"]
    cfg["process"]["args"] = ["/.corral/init", "--hold"]
    cfg["linux"]["seccomp"] = profile
    with open(f"{sdir}/config.json", "wb") as f:
        f.write(msgspec.json.encode(cfg))
    hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
    cpid = 0
    try:
        pid = os.posix_spawn(runc, [runc, "--root", runc_root, "--log", f"{sdir}/runc.log", "run", "-d",
                                    "--pid-file", f"{sdir}/pid", "--bundle", sdir, sid], os.environ,
                             file_actions=[(os.POSIX_SPAWN_DUP2, hold_r, 0),
                                           (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                                           (os.POSIX_SPAWN_OPEN, 2, f"{sdir}/runc.err", os.O_WRONLY | os.O_CREAT, 0o600)])
        os.close(hold_r)
        hold_r = -1
        if await wait_pid(pid) != 0:
            raise RuntimeError(f"runc could not start the capture container: {log_tail(f'{sdir}/runc.err')} {log_tail(f'{sdir}/runc.log')}")
        with open(f"{sdir}/pid") as f:
            cpid = int(f.read().strip())
        progs = await asyncio.to_thread(read_filters, cpid)
        if len(progs) != 1:
            raise RuntimeError(f"runc installed {len(progs)} seccomp filters, not one")
        return progs[0]
    finally:
        if hold_r >= 0:
            os.close(hold_r)
        os.close(hold_w)  # corral-exec --hold sees EOF and exits
        await asyncio.to_thread(_teardown, runc, runc_root, sid, sdir, cg, cpid)


def read_filters(pid: int) -> list[bytes]:
    """Every seccomp program of `pid`, newest first (ptrace seize, interrupt, read, detach: all
    from this one thread, the tracer)."""
    if _libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"ptrace(PTRACE_SEIZE, {pid}): {os.strerror(e)}")
    try:
        _libc.ptrace(PTRACE_INTERRUPT, pid, None, None)
        os.waitpid(pid, WALL)
        out: list[bytes] = []
        while True:
            i = ctypes.c_void_p(len(out))
            n = _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, i, None)
            if n < 0:
                e = ctypes.get_errno()
                if out and e == 2:  # ENOENT: no older filter
                    return out
                raise OSError(e, f"ptrace(PTRACE_SECCOMP_GET_FILTER, {pid}): {os.strerror(e)}")
            buf = ctypes.create_string_buffer(n * 8)
            if _libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, i, buf) != n:
                e = ctypes.get_errno()
                raise OSError(e, f"ptrace(PTRACE_SECCOMP_GET_FILTER, {pid}): {os.strerror(e)}")
            out.append(buf.raw)
    finally:
        _libc.ptrace(PTRACE_DETACH, pid, None, None)


def _teardown(runc: str, runc_root: str, sid: str, sdir: str, cg: cgroups.Cgroups, cpid: int) -> None:
    cg.destroy(timeout=10)
    if cpid:  # the node-agent is the subreaper of what runc starts detached: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(cpid, 0)
    delete(runc, runc_root, sid)
    linux.umount_all(sdir)
    cgroups.rmtree_cgroup(f"{cgroups.ROOT}/unified/{cg.rel}")
    shutil.rmtree(sdir, ignore_errors=True)
