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
    def __init__(self, name: str, group: str, stdin_fd: int, out_fd: int, err_fd: int, wait: Awaitable[int], shell: str = "sh",
                 harness: bool = False):
        self.name = name
        self.shell = shell
        self.harness = harness
        self.group = group
        self.stdin_fd = stdin_fd
        self.lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()
        self.bufs = {"stdout": bytearray(), "stderr": bytearray()}
        self.fds = {"stdout": out_fd, "stderr": err_fd}
        self.changed = asyncio.Event()
        self.exit_status: int | None = None
        self.running = False  # a call is reading the output
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
        elif self.running:
            self.bufs[name] += data
        # between calls, output of the session's background processes is dropped: nobody asked
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
        hold = len(nonce) + 16  # a marker split across reads stays in the buffer until whole
        code: int | None = None
        err_done = False
        timed_out = False

        def take(name: str, upto: int) -> None:
            """Move buf[:upto] into the capture (and the stream, within the cap): the buffer
            never holds more than the latest read plus `hold` bytes, and each byte is scanned
            for the marker a bounded number of times, however much the command prints."""
            buf = self.bufs[name]
            if upto > 0:
                kept = caps[name].add(bytes(buf[:upto]))
                del buf[:upto]
                if kept and on_chunk is not None:
                    on_chunk(name, kept)

        deadline = self.loop.time() + timeout
        self.running = True
        try:
            await self._write_stdin(line.encode())
            while True:
                if code is None:
                    out = self.bufs["stdout"]
                    m = out_mark.search(out)
                    if m:
                        code = int(m.group(1))
                        take("stdout", m.start())
                    else:
                        take("stdout", len(out) - hold)
                if code is not None:
                    self.bufs["stdout"].clear()  # after the marker: background output, not this call's
                if not err_done:
                    err = self.bufs["stderr"]
                    i = err.find(err_mark)
                    if i >= 0:
                        err_done = True
                        take("stderr", i)
                    else:
                        take("stderr", len(err) - hold)
                if err_done:
                    self.bufs["stderr"].clear()
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
        finally:
            self.running = False
        # what is left (the shell ended or the call timed out): its tail, marker-free
        if code is None:
            take("stdout", len(self.bufs["stdout"]))
        if not err_done:
            take("stderr", len(self.bufs["stderr"]))
        for b in self.bufs.values():
            b.clear()
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
