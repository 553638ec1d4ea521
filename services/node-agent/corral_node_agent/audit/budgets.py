"""What one sandbox may spend of the node through its seccomp notifications (audit/seccomp.py):
how fast its notified calls are answered (a token bucket: a flood slows the flooder, not the
node-agent or its neighbours), and how many inotify instances it may hold (they count per uid: a
sandbox's range of its own where it has a user namespace, host root's where it has none)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("corral.node.seccomp")

NOTIFY_RATE = 1000.0  # notifications per second a sandbox is answered at, sustained
NOTIFY_BURST = 2000.0
THROTTLE_PAUSE_S = 0.1
THROTTLE_REPORT_S = 1.0
# inotify instances are counted per uid (fs.inotify.max_user_instances, 128 by default), charged up
# to the owner of the sandbox's user namespace (its own range; host root with CORRAL_USERNS=off):
# each sandbox may hold this many, and the node raises the host's limit to INOTIFY_HOST_LIMIT so
# that no sandbox (nor all of a full node's without user namespaces) can leave host root without one
INOTIFY_PER_SANDBOX = 64
INOTIFY_HOST_LIMIT = 1 << 17
INOTIFY_RECOUNT_S = 1.0


class Bucket:
    """One sandbox's notification budget (a token bucket) and what its throttling has been."""

    def __init__(self, now: float):
        self.tokens = NOTIFY_BURST
        self.at = now
        self.pauses = 0  # since the last report
        self.reported = 0.0
        self.last = ""  # the last call reported, named in the throttle report

    def take(self, now: float) -> bool:
        self.tokens = min(NOTIFY_BURST, self.tokens + (now - self.at) * NOTIFY_RATE)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def raise_inotify_limit() -> None:
    """fs.inotify.max_user_instances up to INOTIFY_HOST_LIMIT (never lowered); a node that cannot
    write it (no sysctl rights) keeps its own and says so."""
    path = "/proc/sys/fs/inotify/max_user_instances"
    try:
        with open(path) as f:
            if int(f.read().strip()) >= INOTIFY_HOST_LIMIT:
                return
        with open(path, "w") as f:
            f.write(str(INOTIFY_HOST_LIMIT))
    except (OSError, ValueError) as e:
        log.warning("cannot raise %s to %d: %s (sandboxes share root's inotify budget)", path, INOTIFY_HOST_LIMIT, e)


def count_inotify(pid: int) -> int:
    """inotify instances held by the processes of `pid`'s sandbox, from its own /proc."""
    proc = f"/proc/{pid}/root/proc"
    n = 0
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return 0
    for p in pids:
        try:
            fds = os.listdir(f"{proc}/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc}/{p}/fd/{fd}") == "anon_inode:inotify":
                    n += 1
            except OSError:
                continue
    return n
