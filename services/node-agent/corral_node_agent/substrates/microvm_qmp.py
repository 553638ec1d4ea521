"""A guest's QEMU monitor (QMP, JSON lines on a unix socket), and the two long operations done
through it: saving a guest's memory and device state into a descriptor (a memory snapshot), and
waiting for a guest started with `-incoming` to have loaded one.

A raw socket rather than asyncio streams: `getfd` hands QEMU a descriptor as SCM_RIGHTS."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

from corral_common.contract.errors import Internal

#: QEMU 7.2 caps a migration at 128 MiB/s by default; a stopped guest's save is not live traffic
SAVE_BANDWIDTH = 1 << 40
SAVE_POLL_S = 0.005
SAVE_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 120.0


class Qmp:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    async def _line(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buf:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                raise Internal("QEMU closed its monitor")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        answer = json.loads(line)
        return answer if isinstance(answer, dict) else {}

    async def execute(self, command: str, fd: int = -1, **arguments: Any) -> Any:
        """One command's return value (events in between are skipped); `fd` goes along as
        SCM_RIGHTS (for `getfd`)."""
        msg = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})}).encode() + b"\n"
        if fd >= 0:  # a few bytes on an idle socket: sent whole at once
            socket.send_fds(self.sock, [msg], [fd])
        else:
            await asyncio.get_running_loop().sock_sendall(self.sock, msg)
        while True:
            answer = await self._line()
            if "return" in answer:
                return answer["return"]
            if "error" in answer:
                raise Internal(f"QEMU refused {command}: {answer['error'].get('desc', answer['error'])}")


@contextlib.asynccontextmanager
async def monitor(path: str, timeout: float = 10.0) -> AsyncIterator[Qmp]:
    """Connected to the monitor (waiting for its socket to appear: QEMU may have just started)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await asyncio.get_running_loop().sock_connect(s, path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.01)
            q = Qmp(s)
            await q._line()  # the greeting
            await q.execute("qmp_capabilities")
    except BaseException as e:
        s.close()
        if isinstance(e, TimeoutError):
            raise Internal(f"QEMU's monitor {path} did not answer in {timeout:g}s") from None
        raise
    try:
        yield q
    finally:
        s.close()


async def save(path: str, fd: int, paused: bool) -> None:
    """QEMU writes the guest's RAM and device state into `fd` (the caller drains its other end
    meanwhile). The guest is stopped for it and runs again after, unless it was `paused`; a save
    that fails is cancelled (the guest goes on as it was)."""
    async with monitor(path) as q:
        if not paused:
            await q.execute("stop")
        try:
            async with asyncio.timeout(SAVE_TIMEOUT_S):
                await q.execute("migrate-set-parameters", **{"max-bandwidth": SAVE_BANDWIDTH})
                await q.execute("getfd", fd=fd, fdname="corral-memory")
                await q.execute("migrate", uri="fd:corral-memory")
                while True:
                    state = await q.execute("query-migrate")
                    status = state.get("status", "")
                    if status == "completed":
                        break
                    if status in ("failed", "cancelled"):
                        raise Internal(f"QEMU could not save the guest: {state.get('error-desc', status)}")
                    await asyncio.sleep(SAVE_POLL_S)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(q.execute("migrate_cancel"))
            raise
        finally:
            if not paused:  # after a save the guest is "postmigrate": cont takes its disks back and runs it
                await asyncio.shield(q.execute("cont"))


async def load(path: str, ended: asyncio.Future[Any]) -> None:
    """Wait until a guest started with `-incoming` has read its saved state, then run it. QEMU
    ending meanwhile (`ended` done) means the stream did not fit this machine."""
    async with monitor(path) as q, asyncio.timeout(LOAD_TIMEOUT_S):
        while True:
            if ended.done():
                raise Internal("QEMU ended while loading the saved guest")
            status = (await q.execute("query-status")).get("status", "")
            if status not in ("inmigrate", "prelaunch"):
                break
            await asyncio.sleep(SAVE_POLL_S)
        if status != "running":
            await q.execute("cont")
