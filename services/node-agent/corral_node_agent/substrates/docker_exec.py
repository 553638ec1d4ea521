"""Exec in a `docker` sandbox: `docker exec` with a small `/bin/sh` wrapper that waits for one
line on stdin before it `exec`s the command: in that moment the node-agent moves it into a fresh
child cgroup of the container's (pids + freezer, like the container substrate's per-exec groups),
so a timeout freezes and kills exactly that exec's processes, daemonised or not. Then the
caller's stdin follows and is closed. The exec ends when its process exits (a pidfd on its host
pid), not when Docker closes the stream, so a background child that keeps stdout open does not
hold it. Sessions reuse sessions.py over one such exec running `/bin/sh`, its stdio bridged
through pipes (Bridge); scripts reach it through a host directory bind-mounted read-only at
/.corral/io."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from corral_common.contract.errors import Conflict, Internal, InvalidRequest, Unavailable
from corral_common.contract.messages import ExecRequest, ExecResult

from .. import cgroups
from ..aio import wait_readable as _wait_readable
from ..oci import HARNESS_ID
from ..output import Capture
from ..sessions import SHELLS, Session
from .base import ChunkCallback
from .common import result_stderr, session_exec
from .docker_sandbox import DockerSandbox, docker_error

# what an exec may take beyond its timeout_s before it is answered whatever Docker says (the SDK
# waits timeout_s + 15 s for the reply)
REPLY_MARGIN_S = 10.0
START_TIMEOUT_S = 30.0

# waits for the go-ahead line (sent once the node-agent has moved it into its exec cgroup), then
# becomes the command; a missing command gets the container substrate's message and code
WRAPPER = ('read -r _ || exit 125; command -v -- "$1" >/dev/null 2>&1 || '
           '{ printf "corral: cannot run %s: No such file or directory\\n" "$1" >&2; exit 127; }; exec "$@"')


async def _start(sb: DockerSandbox, argv: list[str], env: dict[str, str], cwd: str | None, harness: bool = False):
    """Start the wrapped command (as oci.HARNESS_ID when `harness`); returns (exec, stream, host
    pid) with the wrapper waiting for its go-ahead line, or (exec, stream, 0) when Docker could not
    start it at all."""
    from aiodocker.exceptions import DockerError

    stream = None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):  # Docker answers each call, or the exec fails clearly
            ex = await sb.container.exec(["/bin/sh", "-c", WRAPPER, "corral-exec", *argv], stdin=True, stdout=True, stderr=True,
                                         environment=env, workdir=cwd,
                                         user=f"{HARNESS_ID}:{HARNESS_ID}" if harness else "")
            stream = ex.start(detach=False)
            await stream._init()
            delay = 0.001
            while True:
                info = await ex.inspect()
                if info.get("Pid"):
                    return ex, stream, int(info["Pid"])
                if not info.get("Running") and info.get("ExitCode") is not None:
                    return ex, stream, 0
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
    except TimeoutError:
        if stream is not None:
            await stream.close()
        raise Unavailable(f"docker exec in {sb.id} did not start within {START_TIMEOUT_S:g}s") from None
    except DockerError as e:
        raise docker_error(e, f"exec in {sb.id}") from None


async def exec_in(sb: DockerSandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult:
    """`Substrate.exec` for a docker sandbox: the command, or a named session's next command, in
    its own exec cgroup."""
    if sb.paused:
        raise Conflict(f"sandbox {sb.id} is paused; resume it before exec")
    argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
    for k in req.env:
        if not k or "=" in k or "\0" in k:
            raise InvalidRequest(f"invalid environment variable name {k!r}")
    if any("\0" in s for s in (*argv, *req.env.values(), req.cwd or "")):
        raise InvalidRequest("arguments, environment and cwd must not contain NUL bytes")
    if req.session:
        return await session_exec(sb, req, on_chunk, lambda: _start_session(sb, req.session, req.shell, req.harness),
                                  lambda name: close_session(sb, name))
    assert sb.cg is not None
    t0 = time.perf_counter()
    cwd = req.cwd or sb.spec.workdir or "/"
    if not cwd.startswith("/"):
        cwd = "/" + cwd
    group = f"x{sb.epoch}-{next(sb.seq)}"
    ex, stream, pid = await _start(sb, argv, req.env, cwd, req.harness)
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
    # the go-ahead line and the caller's stdin go in beside the wait, never before it: a command
    # that does not read its stdin must not hold the exec past its timeout on a full socket
    feeder = asyncio.create_task(_feed(stream, b"\n" + req.stdin.encode()))
    deadline = time.monotonic() + req.timeout_s + REPLY_MARGIN_S
    timed_out = False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = None
    try:
        if pidfd is not None and not await _wait_readable(pidfd, req.timeout_s):
            timed_out = True
            await asyncio.to_thread(sb.cg.kill_group, group)
            await _wait_readable(pidfd, 5)
        elif pidfd is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), req.timeout_s)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    feeder.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(reader), 0.05)
    except Exception:  # a background child keeps the stream open, or it broke: what we have is the output
        pass
    reader.cancel()
    await stream.close()
    code = await _exit_code(ex, timed_out, max(1.0, deadline - time.monotonic()))
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


async def _start_session(sb: DockerSandbox, name: str, shell: str, harness: bool) -> Session:
    assert sb.cg is not None
    group = f"s{sb.epoch}-{name}-{next(sb.seq)}"
    ex, stream, pid = await _start(sb, [SHELLS[shell]], {}, sb.spec.workdir or "/", harness)
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
    bridge = Bridge(ex, stream, pid)
    session = Session(name, group, bridge.stdin_w, bridge.out_r, bridge.err_r, bridge.wait(), shell, harness)
    sb.sessions[name] = session
    sb.session_links[name] = bridge
    return session


def close_session(sb: DockerSandbox, name: str) -> None:
    """End session `name`: its shell's pipes and the exec stream behind them."""
    s = sb.sessions.pop(name, None)
    if s is not None:
        s.close()
    b = sb.session_links.pop(name, None)
    if b is not None:
        b.close()


class Bridge:
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


def _join_group(cg: cgroups.Cgroups, group: str, pid: int) -> None:
    fds = cg.make_exec_group(group)
    try:
        for fd in fds:
            os.write(fd, str(pid).encode())
    finally:
        for fd in fds:
            os.close(fd)


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


async def _feed(stream, data: bytes) -> None:
    """Write `data` to the exec's stdin, then close it (the output keeps flowing)."""
    with contextlib.suppress(ConnectionError, RuntimeError):  # the command ended before reading it all
        await stream.write_in(data)
        _write_eof(stream)


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
