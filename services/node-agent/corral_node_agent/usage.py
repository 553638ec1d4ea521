"""Observed use per sandbox, for heartbeats: CPU as a rate (cpuacct/cpu.stat usage deltas over
the real time between two samples) and memory (memcg usage).

The reads run in one worker thread per heartbeat (two small cgroup files per sandbox; at 2,000
sandboxes that is ~4,000 reads, which must not stall the event loop). The heartbeat carries the
busiest `top` sandboxes individually and everything in the node's aggregate, so its size is
bounded whatever the node's density."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from corral_common.contract.messages import SandboxUsage

from .cgroups import Cgroups

MiB = 1024 * 1024


@dataclass
class Sample:
    cpu_ns: int
    at: float


@dataclass
class Observed:
    cpu: float = 0.0  # cores, every sampled sandbox
    memory_bytes: int = 0
    per_sandbox: list[SandboxUsage] = field(default_factory=list)  # the `top` busiest
    omitted: int = 0


class UsageTracker:
    def __init__(self, top: int = 256):
        self.top = top
        self.last: dict[str, Sample] = {}

    def collect(self, groups: dict[str, Cgroups], report: set[str]) -> Observed:
        """Sample every cgroup in `groups` (sandbox id -> its cgroups); all of them count in the
        aggregate, only ids in `report` (user sandboxes, not the warm pool) are listed."""
        out = Observed()
        rows: list[SandboxUsage] = []
        now = time.monotonic()
        for sid, cg in groups.items():
            cpu_ns, mem = cg.cpu_usage_ns(), cg.memory_bytes()
            prev = self.last.get(sid)
            rate = 0.0
            if prev is not None and cpu_ns >= prev.cpu_ns and now > prev.at:
                rate = (cpu_ns - prev.cpu_ns) / 1e9 / (now - prev.at)
            self.last[sid] = Sample(cpu_ns, now)
            out.cpu += rate
            out.memory_bytes += mem
            if sid in report:
                rows.append(SandboxUsage(id=sid, cpu=round(rate, 4), memory_mb=round(mem / MiB, 2)))
        for sid in [s for s in self.last if s not in groups]:
            del self.last[sid]
        if len(rows) > self.top:
            rows.sort(key=lambda r: (r.cpu, r.memory_mb), reverse=True)
            out.omitted = len(rows) - self.top
            rows = rows[: self.top]
        out.per_sandbox = rows
        return out

    def forget(self, sid: str) -> None:
        self.last.pop(sid, None)
