"""Small asyncio helpers for raw file descriptors (pidfds, pipes, sockets) shared by substrates."""
from __future__ import annotations

import asyncio
import os
import socket


def read_chunk(fd: int) -> bytes | None:
    """One read from a non-blocking fd: the data; b"" at EOF or on a read error (either ends the
    stream); None when nothing is there yet."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


async def wait_readable(fd: int, timeout: float) -> bool:
    """True once fd is readable, False after timeout."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, max(0.0, timeout))
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


async def recv_exactly(sock: socket.socket, n: int, what: str) -> bytes:
    """Read exactly n bytes from a non-blocking socket; ConnectionError if the peer closes first."""
    loop = asyncio.get_running_loop()
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError(f"{what} closed the connection")
        buf += chunk
    return buf
