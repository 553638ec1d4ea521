"""The process that makes sandboxes' user namespaces for the node-agent.

A user namespace is made by a child that becomes the range's uid and unshares (userns.make_userns),
so each one costs a fork. Forking the node-agent costs in proportion to its memory (measured: 1.9 ms
from a small Python process, 11.9 ms from one of 300 MB): this helper, started once and small,
forks instead and hands the namespaces' fds back over a socket (SCM_RIGHTS).

Protocol (SOCK_SEQPACKET): a request is "<base> <0|1>" (1: with a network namespace); the reply is
"ok" with the fds (user, then net), or "error <message>". The helper exits when the socket closes
or its parent dies."""
from __future__ import annotations

import array
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading

from . import userns

PR_SET_PDEATHSIG = 1
SOCKET_FD = 3  # the helper's end, as it is started
REPLY_TIMEOUT_S = 10.0


def serve(sock: socket.socket) -> None:
    while True:
        try:
            req = sock.recv(64)
        except InterruptedError:
            continue
        if not req:
            return
        fds: list[int] = []
        try:
            base, netns = req.decode().split()
            user_fd, net_fd = userns.make_userns(int(base), netns=netns == "1")
            fds = [user_fd] + ([net_fd] if net_fd is not None else [])
            sock.sendmsg([b"ok"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except (OSError, ValueError) as e:
            sock.send(f"error {e}".encode()[:4000])
        finally:
            for fd in fds:
                os.close(fd)


class Helper:
    """The agent's side: one helper process, asked one request at a time (a lock: creates on the
    loop and slot preparations in threads share it), started again if it has died."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def start(self) -> None:
        """Start the helper now (~50 ms of interpreter start-up) rather than in the first create."""
        with self.lock:
            if self.proc is None:
                self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__], pass_fds=[theirs.fileno()],
                                         env={**os.environ, "CORRAL_USERNS_HELPER_FD": str(theirs.fileno())},
                                         stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.settimeout(REPLY_TIMEOUT_S)  # a helper that hangs is replaced, never waited on forever
        self.sock = ours

    def make(self, base: int, netns: bool = False) -> tuple[int, int | None]:
        """userns.make_userns(base, netns), made by the helper."""
        with self.lock:
            for attempt in (1, 2):
                if self.sock is None or self.proc is None or self.proc.poll() is not None:
                    self.close_locked()
                    self._start()
                assert self.sock is not None
                try:
                    self.sock.send(f"{base} {int(netns)}".encode())
                    msg, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(2 * 4))
                except OSError:
                    if attempt == 2:
                        raise
                    self.close_locked()  # it died under us: once more with a new one
                    continue
                fds: list[int] = []
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(data[: len(data) - len(data) % a.itemsize])
                        fds += list(a)
                if msg != b"ok" or len(fds) != (2 if netns else 1):
                    for fd in fds:
                        os.close(fd)
                    if not msg:
                        if attempt == 2:
                            raise OSError("the user namespace helper went away")
                        self.close_locked()
                        continue
                    raise OSError(msg.decode(errors="replace").removeprefix("error "))
                for fd in fds:
                    os.set_inheritable(fd, False)
                return fds[0], (fds[1] if netns else None)
        raise AssertionError("unreachable")

    def close_locked(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            self.close_locked()


def main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the agent's group is the agent's to handle
    fd = int(os.environ.get("CORRAL_USERNS_HELPER_FD", SOCKET_FD))
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
