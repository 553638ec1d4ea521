"""Reading a process's stdout and stderr without blocking the event loop: size caps with a
`truncated` flag (the process is never blocked by a full pipe, excess is discarded), and an
optional callback that streams chunks as they are produced, within the same caps."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from .aio import read_chunk

ChunkCallback = Callable[[str, bytes], None]


class Capture:
    def __init__(self, cap: int):
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False

    def add(self, data: bytes) -> bytes:
        """Keep what fits under the cap; returns the part kept (what may be streamed on)."""
        room = self.cap - len(self.buf)
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        self.buf += data
        return data


class PipeReader:
    """Reads fds until EOF; `done` resolves when all of them reached EOF."""

    def __init__(self, fds: dict[str, int], cap: int, on_chunk: ChunkCallback | None = None):
        self.loop = asyncio.get_running_loop()
        self.fds = dict(fds)
        self.captures = {name: Capture(cap) for name in fds}
        self.on_chunk = on_chunk
        self.done = self.loop.create_future()
        for name, fd in self.fds.items():
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._readable, name)
        if not self.fds:
            self.done.set_result(None)

    def _readable(self, name: str) -> None:
        fd = self.fds.get(name)
        if fd is None or (data := read_chunk(fd)) is None:
            return
        if not data:
            self._close(name)
            return
        self._keep(name, data)

    def _keep(self, name: str, data: bytes) -> None:
        # a stream carries no more than the reply would: max_output_bytes bounds both
        kept = self.captures[name].add(data)
        if kept and self.on_chunk is not None:
            self.on_chunk(name, kept)

    def _close(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        if fd is None:
            return
        self.loop.remove_reader(fd)
        os.close(fd)
        if not self.fds and not self.done.done():
            self.done.set_result(None)

    def drain(self) -> None:
        """Read whatever is buffered right now, then stop (for pipes a background child keeps open)."""
        for name in list(self.fds):
            fd = self.fds[name]
            while data := read_chunk(fd):
                self._keep(name, data)
            self._close(name)

    async def finish(self, grace: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.done), grace)
        except TimeoutError:
            pass
        self.drain()

    def text(self, name: str) -> str:
        return self.captures[name].buf.decode("utf-8", errors="replace")

    @property
    def truncated(self) -> bool:
        return any(c.truncated for c in self.captures.values())
