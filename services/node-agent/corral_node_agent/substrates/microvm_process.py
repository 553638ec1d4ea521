"""A guest's QEMU process, held by pidfd: the one this agent started, or, after a restart, the one
a predecessor started, found in the sandbox's cgroup.

Why not asyncio's subprocess: its transport kills a child still running when it is closed or
collected, and QEMU must outlive the agent (a successor adopts the guest), in a session of its
own so that a signal to the agent's process group does not reach it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess

from .. import cgroups
from ..aio import wait_readable


class QemuProcess:
    def __init__(self, pid: int, pidfd: int, popen: subprocess.Popen[bytes] | None = None):
        self.pid = pid
        self.pidfd = pidfd
        self.popen = popen  # ours to reap; None for a predecessor's (its parent is init now)

    @classmethod
    def start(cls, argv: list[str], log_path: str, pass_fds: tuple[int, ...] = ()) -> QemuProcess:
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                                     pass_fds=pass_fds, start_new_session=True)
        try:
            return cls(popen.pid, os.pidfd_open(popen.pid), popen)
        except OSError:
            popen.kill()
            popen.wait()
            raise

    @classmethod
    def find(cls, cg: cgroups.Cgroups, pid_file: str) -> QemuProcess | None:
        """The QEMU whose pid `pid_file` names, if it still runs in `cg` (a pid reused by another
        process is in no sandbox's cgroup)."""
        try:
            with open(pid_file) as f:
                pid = int(f.read().strip())
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return None
        if not cg.holds(pid):  # asked with the pidfd held: the pid cannot have been reused since
            os.close(pidfd)
            return None
        return cls(pid, pidfd)

    @property
    def running(self) -> bool:
        if self.pidfd < 0:
            return False
        return not select.select([self.pidfd], [], [], 0)[0]

    async def wait(self) -> None:
        """Until QEMU has ended (and is reaped, if it is our child)."""
        if self.pidfd >= 0:
            while not await wait_readable(self.pidfd, 3600):
                pass
        if self.popen is not None:
            await asyncio.to_thread(self.popen.wait)

    def kill(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
