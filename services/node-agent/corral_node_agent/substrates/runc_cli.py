"""The runc command line as the `container` and `function` substrates call it, and the
pidfd/poll helpers that wait on what it starts without blocking the loop or a SIGCHLD watcher."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import select
import shutil
import subprocess

from corral_common.contract.errors import Code, CorralError, Internal


async def run_detached(runc: str, root: str, sid: str, sdir: str, fds: list[int]) -> int:
    """`runc run -d` with `fds` as init's fds 3, 4, ... (--preserve-fds)."""
    # dup2 onto its own number would keep close-on-exec set, and a later dup2 must not
    # overwrite a source not yet moved: move every source above the targets first
    top = 3 + len(fds)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) if fd < top else fd for fd in fds]
    # (long flags only, and none for no fds: runsc takes this command line too, gvisor.py)
    argv = [runc, "--root", root, "run", "--detach", *(("--preserve-fds", str(len(fds))) if fds else ()),
            "--pid-file", f"{sdir}/init.pid", "--bundle", sdir, sid]
    try:
        pid = os.posix_spawn(runc, argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, f"{sdir}/runc.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            *[(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(moved)],
        ])
    finally:
        for fd, orig in zip(moved, fds):
            if fd != orig:
                os.close(fd)
    return await wait_pid(pid)


async def simple(runc: str, root: str, verb: str, sid: str, timeout: float = 15.0) -> None:
    """`runc <verb> <sid>` (pause, resume), its failure an Internal error with runc's words."""
    p = await asyncio.create_subprocess_exec(
        runc, "--root", root, verb, sid,
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
            await simple(runc, root, "resume", sid, timeout)
        raise CorralError(f"runc {verb} {sid} did not finish within {timeout:g}s", Code.TIMEOUT) from None
    if p.returncode != 0:
        raise Internal(f"runc {verb} {sid} failed: {err.decode(errors='replace').strip()}")


def states(runc: str, root: str) -> dict[str, dict]:
    """`runc list`: each container's state by id (status, pid, ...)."""
    p = subprocess.run([runc, "--root", root, "list", "--format", "json"],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0 or not p.stdout.strip() or p.stdout.strip() == "null":
        return {}
    return {c["id"]: c for c in json.loads(p.stdout)}


def readable(fd: int, timeout_s: float) -> bool:
    """poll(2), not select(2): a node with a thousand sandboxes holds fds above FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(int(timeout_s * 1000)))


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


def log_tail(path: str, n: int = 2000) -> str:
    """The end of runc's log, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


#: a delete that takes longer is stuck (runsc waiting on a Sandbox that crashed): its state is
#: removed by the caller's rmtree of the runtime's dir for the id, processes by the cgroup sweep
DELETE_TIMEOUT_S = 20.0


def delete(runc: str, root: str, sid: str) -> None:
    """`runc delete --force`: whatever runc still keeps of `sid` (state, a stopped container)."""
    try:
        subprocess.run([runc, "--root", root, "delete", "--force", sid],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=DELETE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(f"{root}/{sid}", ignore_errors=True)
