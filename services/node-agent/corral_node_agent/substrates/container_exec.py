"""Exec in a `container` sandbox: corral-init (PID 1) forks every command, so it inherits the
sandbox's namespaces, cgroups, seccomp filter and empty capability sets without a ~25 ms `runc
exec`; each exec runs in its own child cgroup so that a timeout kills exactly its tree. Named
sessions are a long-lived `/bin/sh` started the same way (common.session_exec). The `function`
substrate's warm sandboxes run their call through here too."""
from __future__ import annotations

import asyncio
import os
import signal
import time

from corral_common.contract.errors import Conflict, InvalidRequest, Unavailable
from corral_common.contract.messages import ExecRequest, ExecResult

from .. import initclient
from ..output import PipeReader
from ..sessions import SHELLS, Session
from .base import ChunkCallback
from .common import result_stderr, session_exec
from .container_sandbox import DEFAULT_ENV, ContainerSandbox


async def exec_in(sb: ContainerSandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
    """`Substrate.exec` for sandboxes with a corral-init: the command, or a named session's next
    command, in its own exec cgroup."""
    if sb.paused:
        raise Conflict(f"sandbox {sb.id} is paused; resume it before exec")
    argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
    env = {**DEFAULT_ENV, **sb.spec.env, **req.env}
    for k in env:
        if not k or "=" in k or "\0" in k:
            raise InvalidRequest(f"invalid environment variable name {k!r}")
    if req.session:
        return await session_exec(sb, req, on_chunk, lambda: start_session(sb, req.session, env, req.shell, req.harness),
                                  lambda name: end_session(sb, name))
    cwd = req.cwd or sb.spec.workdir or "/"
    group = f"x{sb.epoch}-{next(sb.seq)}"
    t0 = time.perf_counter()
    oom_before = sb.cg.oom_kills()
    cg_fds = sb.open_exec_group(group)
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    child_fds = [in_r, out_w, err_w, *cg_fds]
    try:
        spawned = await initclient.spawn(sb.ctl, argv, env, cwd, (in_r, out_w, err_w), cg_fds, harness=req.harness,
                                         token=sb.init_token)
    except (initclient.InitError, ValueError) as e:
        for fd in (*child_fds, in_w, out_r, err_r):
            os.close(fd)
        sb.close_exec_group(group)
        if isinstance(e, ValueError):
            raise InvalidRequest(str(e)) from None
        raise Unavailable(f"sandbox {sb.id} is not accepting commands: {e}") from None
    for fd in child_fds:
        os.close(fd)
    sb.exec_started(group, spawned.pid)
    reader = PipeReader({"stdout": out_r, "stderr": err_r}, req.max_output_bytes, on_chunk)
    feeder = asyncio.create_task(feed(in_w, req.stdin.encode()))
    wait = asyncio.ensure_future(spawned.wait())
    timed_out = False
    try:
        status = await asyncio.wait_for(asyncio.shield(wait), req.timeout_s)
    except TimeoutError:
        timed_out = True
        await sb.kill_exec_group(group)
        try:
            status = await asyncio.wait_for(wait, 10)
        except (TimeoutError, initclient.InitError):
            status = signal.SIGKILL
    except initclient.InitError as e:
        reader.drain()
        feeder.cancel()
        if sb.cg.oom_kills() > oom_before:  # the whole sandbox ran out of memory (gvisor: the Sentry)
            status = signal.SIGKILL
        else:
            raise Unavailable(f"sandbox {sb.id} went away during exec: {e}") from None
    finally:
        if not wait.done():
            wait.cancel()
    await reader.finish(grace=0.05)
    feeder.cancel()
    if not sb.close_exec_group(group):
        sb.lingering.add(group)  # background processes still running; swept on destroy
    code, sig = exit_code(status)
    oom = sig == signal.SIGKILL and sb.cg.oom_kills() > oom_before
    stderr = result_stderr(reader.text("stderr"), sb.spec, req, oom, timed_out)
    return ExecResult(
        exit_code=code, stdout=reader.text("stdout"), stderr=stderr,
        duration_ms=(time.perf_counter() - t0) * 1000, timed_out=timed_out,
        truncated=reader.truncated, oom_killed=oom, signal=sig,
    )


async def start_session(sb: ContainerSandbox, name: str, env: dict[str, str], shell: str, harness: bool) -> Session:
    """A session's shell (`/bin/sh` or `/bin/bash`), forked by init into its own exec cgroup, stdio through pipes;
    a harness session's shell runs as oci.HARNESS_ID, out of the agent's reach."""
    group = f"s{sb.epoch}-{name}-{next(sb.seq)}"
    cg_fds = sb.open_exec_group(group)
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        spawned = await initclient.spawn(sb.ctl, [SHELLS[shell]], env, sb.spec.workdir or "/", (in_r, out_w, err_w), cg_fds,
                                         harness=harness, token=sb.init_token)
    except initclient.InitError as e:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise Unavailable(f"sandbox {sb.id} cannot start a session: {e}") from None
    finally:
        for fd in (in_r, out_w, err_w, *cg_fds):
            os.close(fd)
    sb.exec_started(group, spawned.pid)
    return Session(name, group, in_w, out_r, err_r, spawned.wait(), shell, harness)


def end_session(sb: ContainerSandbox, name: str) -> None:
    s = sb.sessions.pop(name, None)
    if s is not None:
        s.close()


async def feed(fd: int, data: bytes) -> None:
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


def exit_code(status: int) -> tuple[int, int | None]:
    """(exit code as a shell reports it, the signal that killed it) from a wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return 255, None
