"""OOM kills and pids-limit hits of the node's sandboxes, as audit events.

The kernel counts both in the sandbox's cgroup; this module reports what the counters grew by.
After an exec the check is deferred by LIMITS_DELAY_S and done once for every exec that ended
meanwhile (three cgroup reads per sandbox, not per exec, and not before the exec's reply); the
heartbeat reads the counters of every sandbox on its own thread for what background processes
ran into. The first reading of a sandbox only sets its baseline."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from corral_common.contract.audit import AuditEvent

from ..substrates import Substrate
from ..substrates.base import Sandbox
from .log import AuditLog

LIMITS_DELAY_S = 0.2  # OOM kills / pids-limit hits are looked for this long after an exec ends

Counters = tuple[int, int, str]  # OOM kills, pids-limit hits, the pids limit


def limit_counters(sb: Sandbox, sub: Substrate) -> Counters | None:
    """The sandbox's counters; None if it has no cgroup (or its cgroup is gone: it is being
    destroyed)."""
    try:
        return sub.limit_counters(sb)
    except Exception:
        return None


class Limits:
    def __init__(self, log: AuditLog, base: Callable[[str], dict], is_live: Callable[[str], bool]):
        self.log = log
        self.base = base  # the common fields of a sandbox's audit events
        self.is_live = is_live
        self.seen: dict[str, tuple[int, int]] = {}  # sandbox -> (OOM kills, pids-limit hits) already reported
        # sandbox -> (sandbox, substrate, commands) of execs that ended lately, checked together later
        self.due: dict[str, tuple[Sandbox, Substrate, list[str]]] = {}
        self.timer: asyncio.TimerHandle | None = None

    def check(self, sb: Sandbox, sub: Substrate, cmd: str = "") -> None:
        """Report new OOM kills and pids-limit hits now (the first look only sets the baseline)."""
        self.report(sb, limit_counters(sb, sub), cmd)

    def report(self, sb: Sandbox, now: Counters | None, cmd: str = "") -> None:
        if now is None:
            return
        ooms, hits, limit = now
        prev = self.seen.get(sb.id)
        if prev is None:
            self.seen[sb.id] = (ooms, hits)
            return
        # the counters only grow; a reading older than the last one reported (the heartbeat poll
        # reads on its thread while a deferred check reports on the loop) must not lower the mark
        self.seen[sb.id] = (max(ooms, prev[0]), max(hits, prev[1]))
        extra = {"cmd": cmd[:200]} if cmd else {}
        if ooms > prev[0]:
            self.log.emit(AuditEvent(**self.base(sb.id), kind="oom", op="oom_kill",
                                     detail={"kills": str(ooms - prev[0]), "memory_mb": str(sb.spec.memory_mb), **extra}))
        if hits > prev[1]:
            self.log.emit(AuditEvent(**self.base(sb.id), kind="pids", op="pids_limit",
                                     detail={"hits": str(hits - prev[1]), "limit": limit, **extra}))

    def defer(self, sb: Sandbox, sub: Substrate, cmd: str) -> None:
        """Check the sandbox LIMITS_DELAY_S after this exec ended, with the others ending meanwhile."""
        due = self.due.get(sb.id)
        if due is None:
            self.due[sb.id] = (sb, sub, [cmd])
        elif len(due[2]) < 8 and cmd not in due[2]:
            due[2].append(cmd)
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(LIMITS_DELAY_S, self.check_due)

    def check_due(self) -> None:
        self.timer = None
        due, self.due = self.due, {}
        for sid, (sb, sub, cmds) in due.items():
            if self.is_live(sid):
                self.check(sb, sub, "; ".join(cmds))

    def flush(self, sid: str) -> None:
        """The deferred check of a sandbox now (about to go, or its audit record asked for)."""
        due = self.due.pop(sid, None)
        if due is not None:
            self.check(due[0], due[1], "; ".join(due[2]))

    def forget(self, sid: str) -> None:
        self.due.pop(sid, None)
        self.seen.pop(sid, None)

    def close(self) -> None:
        """Stopping with sandboxes kept: their last execs' limits, now."""
        if self.timer is not None:
            self.timer.cancel()
            self.check_due()
