"""Named sessions: one persistent shell (`/bin/sh`, or `/bin/bash` when asked) per (sandbox, name) whose cwd and exported variables
carry over between exec calls, as an agent's terminal would.

Each call writes the command to a file in the sandbox's read-only /.corral/io and sources it in
the shell, followed by markers carrying a random nonce and the exit status. A call that times out
kills the shell's whole process tree (its exec cgroup) and the session starts afresh next time."""
from __future__ import annotations

import asyncio
import os
import re
import secrets
import shlex
from collections.abc import Awaitable, Callable

from .aio import read_chunk
from .output import Capture, ChunkCallback


class SessionResult:
    def __init__(self, exit_code: int, stdout: bytes, stderr: bytes, truncated: bool, timed_out: bool, ended: bool):
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.truncated = truncated
        self.timed_out = timed_out
        self.ended = ended


SHELLS = {"sh": "/bin/sh", "bash": "/bin/bash"}


class Session:
    def __init__(self, name: str, group: str, stdin_fd: int, out_fd: int, err_fd: int, wait: Awaitable[int], shell: str = "sh"):
        self.name = name
        self.shell = shell
        self.group = group
        self.stdin_fd = stdin_fd
        self.lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()
        self.bufs = {"stdout": bytearray(), "stderr": bytearray()}
        self.fds = {"stdout": out_fd, "stderr": err_fd}
        self.changed = asyncio.Event()
        self.exit_status: int | None = None
        self.wait_task = asyncio.ensure_future(wait)
        self.wait_task.add_done_callback(self._exited)
        for name_, fd in self.fds.items():
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._readable, name_)
        os.set_blocking(stdin_fd, False)

    @property
    def alive(self) -> bool:
        return self.exit_status is None

    def _exited(self, t: asyncio.Future) -> None:
        try:
            self.exit_status = t.result()
        except BaseException:
            self.exit_status = 255 << 8
        self.changed.set()

    def _readable(self, name: str) -> None:
        fd = self.fds.get(name)
        if fd is None or (data := read_chunk(fd)) is None:
            return
        if not data:
            self.loop.remove_reader(fd)
            os.close(fd)
            self.fds.pop(name, None)
        else:
            self.bufs[name] += data
        self.changed.set()

    async def _write_stdin(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.stdin_fd, view)
                view = view[n:]
            except BlockingIOError:
                await asyncio.sleep(0.001)

    async def run(
        self,
        script: str,
        stdin_path: str | None,
        cwd: str | None,
        env: dict[str, str],
        timeout: float,
        cap: int,
        on_chunk: ChunkCallback | None,
        kill: Callable[[], Awaitable[None]],
    ) -> SessionResult:
        nonce = secrets.token_hex(8)
        out_mark = re.compile(rb"\x1e" + nonce.encode() + rb":(\d+)\n")
        err_mark = b"\x1e" + nonce.encode() + b"\n"
        pre = []
        if cwd:
            pre.append(f"cd -- {shlex.quote(cwd)}")
        pre += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        pre.append(f". {shlex.quote(script)}")
        redirect = shlex.quote(stdin_path) if stdin_path else "/dev/null"
        line = (
            "{ " + " && ".join(pre) + f"; }} < {redirect}; "
            f"printf '\\036%s:%d\\n' {nonce} \"$?\"; printf '\\036%s\\n' {nonce} >&2\n"
        )
        for b in self.bufs.values():
            b.clear()
        caps = {"stdout": Capture(cap), "stderr": Capture(cap)}
        emitted = {"stdout": 0, "stderr": 0}
        hold = len(nonce) + 16
        code: int | None = None
        err_done = False
        timed_out = False
        deadline = self.loop.time() + timeout
        await self._write_stdin(line.encode())
        while True:
            out = self.bufs["stdout"]
            m = out_mark.search(out)
            if m and code is None:
                code = int(m.group(1))
            err = self.bufs["stderr"]
            if not err_done and err_mark in err:
                err_done = True
            if on_chunk is not None:
                for name, buf in (("stdout", out), ("stderr", err)):
                    end = (m.start() if name == "stdout" and m else None)
                    if name == "stderr" and err_done:
                        end = err.index(err_mark)
                    limit = end if end is not None else max(0, len(buf) - hold)
                    if limit > emitted[name]:
                        on_chunk(name, bytes(buf[emitted[name]:limit]))
                        emitted[name] = limit
            if (code is not None and err_done) or not self.alive:
                break
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                timed_out = True
                break
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                pass
        out, err = self.bufs["stdout"], self.bufs["stderr"]
        m = out_mark.search(out)
        caps["stdout"].add(bytes(out[: m.start()] if m else out))
        caps["stderr"].add(bytes(err[: err.index(err_mark)] if err_mark in err else err))
        ended = False
        if timed_out:
            await kill()
            ended = True
            code = 137
        elif code is None:
            # the shell itself ended (the command ran `exit`): report its status
            await asyncio.wait([self.wait_task], timeout=5)
            status = self.exit_status or 0
            code = os.waitstatus_to_exitcode(status) if status >= 0 else 255
            code = 128 - code if code < 0 else code
            ended = True
        return SessionResult(
            code, bytes(caps["stdout"].buf), bytes(caps["stderr"].buf),
            caps["stdout"].truncated or caps["stderr"].truncated, timed_out, ended,
        )

    def close(self) -> None:
        for fd in list(self.fds.values()):
            self.loop.remove_reader(fd)
            os.close(fd)
        self.fds.clear()
        try:
            os.close(self.stdin_fd)
        except OSError:
            pass
        self.stdin_fd = -1
