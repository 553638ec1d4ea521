"""Client side of the corral-init protocol (see init/corral-init.c): ask a sandbox's resident
helper to fork a process with the given argv, env, cwd, stdio and exec cgroups."""
from __future__ import annotations

import asyncio
import socket
import struct

from .aio import recv_exactly


class InitError(Exception):
    pass


class Spawned:
    """A process the helper started; `wait()` returns its raw wait status."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock = sock
        self.pid = pid

    async def wait(self) -> int:
        try:
            buf = await recv_exactly(self.sock, 4, "sandbox helper")
        except ConnectionError:
            raise InitError("sandbox helper went away before the process exited") from None
        finally:
            self.sock.close()
        return struct.unpack("<i", buf)[0]

    def close(self) -> None:
        self.sock.close()


def encode_request(argv: list[str], env: dict[str, str], cwd: str, ncgroups: int, harness: bool = False,
                   token: str = "") -> bytes:
    tokens = [*([token] if token else []), "3" if harness else "1", str(len(argv)), *argv, str(len(env)), *(f"{k}={v}" for k, v in env.items()), cwd, str(ncgroups)]
    for t in tokens:
        if "\0" in t:
            raise ValueError("arguments, environment and cwd must not contain NUL bytes")
    payload = b"".join(t.encode() + b"\0" for t in tokens)
    return payload


async def spawn(ctl_path: str, argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int],
                cgroup_fds: list[int], timeout: float = 10.0, harness: bool = False, token: str = "") -> Spawned:
    """Start argv in the sandbox: as its root without capabilities, or as oci.HARNESS_ID when `harness`.
    `token`: the secret an init started with --listen asks of every request (gVisor)."""
    payload = encode_request(argv, env, cwd, len(cgroup_fds), harness, token)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, ctl_path)
            header = struct.pack("<I", len(payload))
            # the fds ride on the first message; the payload follows as plain stream bytes
            await _sendmsg(loop, sock, header, [*stdio, *cgroup_fds])
            await loop.sock_sendall(sock, payload)
            buf = await recv_exactly(sock, 4, "sandbox helper")
    except (OSError, TimeoutError) as e:
        sock.close()
        raise InitError(f"cannot reach the sandbox helper: {e}") from e
    except BaseException:
        sock.close()
        raise
    pid = struct.unpack("<I", buf)[0]
    if pid == 0:
        sock.close()
        raise InitError("sandbox helper could not start the process (fork failed or bad request)")
    return Spawned(sock, pid)


async def ping(ctl_path: str, timeout: float = 30.0, token: str = "") -> None:
    """Wait until the sandbox's init has exec'd and answers (create waits for this: ready means
    ready, not merely "runc returned")."""
    await _ask(ctl_path, _authed(token, b"1\x000\x00"), [], timeout, "did not answer", "gave an unexpected ping reply")


async def kill_group(ctl_path: str, pid: int, token: str = "", timeout: float = 10.0) -> None:
    """SIGKILL the process group (session) of `pid`, a process init started: how a timeout ends an
    exec's tree where there are no exec cgroups (gVisor). InitError if it was not init's child."""
    await _ask(ctl_path, _authed(token, f"4\x00{pid}\x00".encode()), [], timeout, "did not answer", f"did not kill {pid}")


def _authed(token: str, payload: bytes) -> bytes:
    return (token.encode() + b"\x00" + payload) if token else payload


async def hold(ctl_path: str, fd: int, timeout: float = 10.0) -> None:
    """Have the sandbox's init keep `fd` (its seccomp notify fd) as fd 6, where a restarted
    node-agent takes it back from (pidfd_getfd)."""
    await _ask(ctl_path, b"2\x00", [fd], timeout, "did not take the fd", "could not keep the fd")


async def _ask(ctl_path: str, payload: bytes, fds: list[int], timeout: float, unreachable: str, refused: str) -> None:
    """One request whose answer is u32 1 (ping, hold)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, ctl_path)
            header = struct.pack("<I", len(payload))
            if fds:
                await _sendmsg(loop, sock, header, fds)
                await loop.sock_sendall(sock, payload)
            else:
                await loop.sock_sendall(sock, header + payload)
            buf = await recv_exactly(sock, 4, "sandbox helper")
    except (OSError, TimeoutError) as e:
        raise InitError(f"sandbox helper {unreachable}: {e!r}") from e
    finally:
        sock.close()
    if struct.unpack("<I", buf)[0] != 1:
        raise InitError(f"sandbox helper {refused}")


async def _sendmsg(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes, fds: list[int]) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    while True:
        try:
            sent = sock.sendmsg([data], anc)
            if sent != len(data):
                await loop.sock_sendall(sock, data[sent:])
            return
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_writer(sock.fileno(), fut.set_result, None)
            try:
                await fut
            finally:
                loop.remove_writer(sock.fileno())
