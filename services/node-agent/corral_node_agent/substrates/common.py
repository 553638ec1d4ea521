"""What the substrates whose sandboxes stay (`container`, `docker`) do alike, written once:
the sandbox record beside its state dir, exit watching through the init's pidfd, adopting exec
cgroups after a restart, the notes an exec result gets when it was OOM-killed or timed out, and
named sessions (a long-lived `/bin/sh` or `/bin/bash` per session name, sessions.py) run through scripts in the
sandbox's io dir. Each substrate supplies only how a session shell starts and ends."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from corral_common.contract.errors import Capacity, Conflict
from corral_common.contract.messages import ExecRequest, ExecResult, SandboxInfo, SandboxSpec

from .. import cgroups
from ..oci import HARNESS_ID
from ..sessions import Session
from .base import ChunkCallback, Sandbox

MAX_SESSIONS = 16  # live named sessions per sandbox: each is a shell, three pipes and a cgroup on the node
IO_MOUNT = "/.corral/io"  # where the sandbox sees its io dir (scripts and stdin of session execs)

R = TypeVar("R", bound=msgspec.Struct)


class StayingSandbox(Sandbox):
    """The state a sandbox that stays keeps for the helpers below: its io dir (host side of
    IO_MOUNT), cgroup, init's pidfd, sessions and exec cgroup naming."""

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, sdir: str, cg: cgroups.Cgroups | None):
        super().__init__(info, spec)
        self.sdir = sdir
        self.io = f"{sdir}/io"
        self.cg = cg
        self.pidfd: int | None = None
        self.sessions: dict[str, Session] = {}
        self.session_locks: dict[str, asyncio.Lock] = {}
        # exec cgroup names carry a per-agent-run prefix so an adopted sandbox's lingering
        # groups (background processes started before a restart) are never reused
        self.seq = itertools.count(1)
        self.epoch = secrets.token_hex(3)
        self.paused = False
        self.lingering: set[str] = set()
        # host uid of the sandbox's root (its user namespace's range, userns.py); 0: host root
        self.uid_base = 0

    # An exec's processes form a group the agent can kill as one (a timeout, a session's end):
    # by default a child cgroup of the sandbox's, which the exec's first process joins before
    # it runs anything. A substrate whose processes are not host processes overrides these four.

    def open_exec_group(self, name: str) -> list[int]:
        """Make group `name`; the fds its first process uses to join it."""
        assert self.cg is not None
        return self.cg.make_exec_group(name)

    def exec_started(self, name: str, pid: int) -> None:
        """Group `name`'s first process is `pid` (as the sandbox sees it)."""

    async def kill_exec_group(self, name: str) -> None:
        assert self.cg is not None
        await asyncio.to_thread(self.cg.kill_group, name)

    def close_exec_group(self, name: str) -> bool:
        """Forget group `name`; False while processes of it still run (it lingers)."""
        assert self.cg is not None
        return self.cg.remove_group(name)


def make_io_dir(path: str, uid_base: int = 0) -> None:
    """The sandbox's io dir, owned by the harness uid with mode 0711: the agent (root without
    CAP_DAC_*, so "other" here) can open a file whose name it knows but cannot list the directory,
    so session scripts and stdin files carry unguessable names, and a harness's are the harness
    uid's own (0400). `uid_base`: the host uid of the sandbox's root (its user namespace)."""
    os.makedirs(path, mode=0o711)
    os.chown(path, uid_base + HARNESS_ID, uid_base + HARNESS_ID)
    os.chmod(path, 0o711)


def write_io_file(sb: StayingSandbox, name: str, data: bytes, harness: bool) -> str:
    """Write one io file (an agent's readable by root, a harness's only by the harness uid); returns its host path."""
    path = f"{sb.io}/{name}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400 if harness else 0o444)
    try:
        if harness:
            os.fchown(fd, sb.uid_base + HARNESS_ID, sb.uid_base + HARNESS_ID)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return path


def save_record(sdir: str, record: msgspec.Struct) -> None:
    """Write `sandbox.json` atomically (a crash leaves the old record or the new, never half)."""
    tmp = f"{sdir}/sandbox.json.tmp"
    # 0600: the spec's env may hold secrets, and the state dir is traversable by sandbox roots
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(msgspec.json.encode(record))
    os.replace(tmp, f"{sdir}/sandbox.json")


def load_record(path: str, typ: type[R]) -> R | None:
    """The record at path, or None if it is missing or unreadable (the sandbox is then cleaned)."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=typ)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def watch_pidfd(sb: StayingSandbox, callback: Callable[[Any], None]) -> None:
    """Call `callback(sb)` when the process behind `sb.pidfd` exits, unless a destroy has taken
    the pidfd first (`unwatch_pidfd`)."""
    if sb.pidfd is None:
        return
    loop = asyncio.get_running_loop()
    fd = sb.pidfd

    def fired() -> None:
        loop.remove_reader(fd)
        if sb.pidfd is not None:  # not a destroy in progress
            callback(sb)

    loop.add_reader(fd, fired)


def unwatch_pidfd(sb: StayingSandbox) -> int | None:
    """Stop watching and take the pidfd from the sandbox; the caller closes it."""
    pidfd, sb.pidfd = sb.pidfd, None
    if pidfd is not None:
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(pidfd)
    return pidfd


def adopt_exec_groups(cg: cgroups.Cgroups, lingering: set[str]) -> None:
    """After a restart: empty exec cgroups go now; those with processes (a server the agent
    started must survive us) are remembered and swept on destroy."""
    for group in cg.exec_groups():
        if not cg.remove_group(group):
            lingering.add(group)


def result_stderr(stderr: str, spec: SandboxSpec, req: ExecRequest, oom: bool, timed_out: bool) -> str:
    """stderr with corral's note on why the command was killed, if it was."""
    if oom:
        stderr += f"\ncorral: killed: the sandbox ran out of memory (memory_mb={spec.memory_mb})\n"
    if timed_out:
        what = (f"session {req.session!r} was killed and will start afresh" if req.session
                else "every process of this exec was killed")
        stderr += f"\ncorral: timed out after {req.timeout_s:g}s; {what}\n"
    return stderr


async def session_exec(sb: StayingSandbox, req: ExecRequest, on_chunk: ChunkCallback | None,
                       start: Callable[[], Awaitable[Session]], end: Callable[[str], None]) -> ExecResult:
    """Run `req` in the sandbox's session `req.session`, starting it (`start()`) when it does not
    exist or has died; a session whose shell ended (exit, timeout, OOM) is ended (`end(name)`)
    and its cgroup removed, so the next exec starts it afresh."""
    if req.session not in sb.sessions and len(sb.sessions) >= MAX_SESSIONS:
        # shells that ended (exit, OOM) hold their place until their name is reused, or until here
        for name in [n for n, s in sb.sessions.items() if not s.alive]:
            lock = sb.session_locks.get(name)
            if lock is None or not lock.locked():
                end(name)
                sb.session_locks.pop(name, None)
    if req.session not in sb.sessions and len(sb.sessions) >= MAX_SESSIONS:
        raise Capacity(f"sandbox {sb.id} has {len(sb.sessions)} sessions, the most allowed; end one (`exit` in it) "
                       f"or reuse a name")
    lock = sb.session_locks.setdefault(req.session, asyncio.Lock())
    async with lock:
        t0 = time.perf_counter()
        session = sb.sessions.get(req.session)
        if session is not None and session.alive and session.shell != req.shell:
            raise Conflict(f"session {req.session!r} runs {session.shell}, not {req.shell}: end it (`exit`) or use another name")
        if session is not None and session.alive and session.harness != req.harness:
            who = "the harness" if session.harness else "the agent"
            raise Conflict(f"session {req.session!r} runs as {who}: use another name for "
                           f"{'harness' if req.harness else 'agent'} commands")
        if session is None or not session.alive:
            if session is not None:
                end(req.session)
            session = await start()
            sb.sessions[req.session] = session
        n = f"{next(sb.seq)}-{secrets.token_hex(16)}"  # unguessable: the io dir is not listable
        script = f"c{n}"
        text = req.cmd if isinstance(req.cmd, str) else " ".join(shlex.quote(a) for a in req.cmd)
        write_io_file(sb, script, (text + "\n").encode(), req.harness)
        stdin_path = None
        if req.stdin:
            write_io_file(sb, f"i{n}", req.stdin.encode(), req.harness)
            stdin_path = f"{IO_MOUNT}/i{n}"
        cg = sb.cg
        assert cg is not None
        oom_before = cg.oom_kills()

        async def kill() -> None:
            await sb.kill_exec_group(session.group)

        try:
            res = await session.run(f"{IO_MOUNT}/{script}", stdin_path, req.cwd, dict(req.env), req.timeout_s,
                                    req.max_output_bytes, on_chunk, kill)
        finally:
            for p in (f"{sb.io}/{script}", f"{sb.io}/i{n}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        oom = res.ended and cg.oom_kills() > oom_before
        if res.ended:
            end(req.session)
            sb.close_exec_group(session.group)
        stderr = result_stderr(res.stderr.decode("utf-8", errors="replace"), sb.spec, req, oom, res.timed_out)
        return ExecResult(exit_code=res.exit_code, stdout=res.stdout.decode("utf-8", errors="replace"), stderr=stderr,
                          duration_ms=(time.perf_counter() - t0) * 1000, timed_out=res.timed_out,
                          truncated=res.truncated, oom_killed=oom, signal=9 if res.timed_out or oom else None)
