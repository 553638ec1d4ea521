"""Per-job admission for builds, which agents may submit in a loop: a bounded number running per
job, a token-bucket rate per job, and a bounded total backlog. Refusals are `capacity` errors with
a retry hint, never an unbounded queue. State is per replica (each replica admits its share)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from corral_common.contract.errors import Capacity


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class BuildLimits:
    per_job_concurrent: int = 2
    per_job_per_minute: float = 30.0
    burst: int = 10
    max_backlog: int = 64
    running: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    total: int = 0

    def admit(self, job: str) -> None:
        """Take a slot for `job` or raise Capacity; pair with release()."""
        job = job or "_anonymous"
        if self.total >= self.max_backlog:
            raise Capacity(f"the env-builder has {self.total} builds in flight (limit {self.max_backlog}); retry later",
                           retry_after_s=10.0)
        if self.running.get(job, 0) >= self.per_job_concurrent:
            raise Capacity(f"job {job!r} already has {self.running[job]} builds running (limit {self.per_job_concurrent} per job)",
                           retry_after_s=5.0)
        now = time.monotonic()
        b = self.buckets.get(job) or _Bucket(tokens=float(self.burst), at=now)
        rate = self.per_job_per_minute / 60.0
        b.tokens = min(float(self.burst), b.tokens + (now - b.at) * rate)
        b.at = now
        if b.tokens < 1.0:
            self.buckets[job] = b
            wait = (1.0 - b.tokens) / rate if rate > 0 else 60.0
            raise Capacity(f"job {job!r} is over its build rate ({self.per_job_per_minute:g} per minute, burst {self.burst})",
                           retry_after_s=round(wait, 2))
        b.tokens -= 1.0
        self.buckets[job] = b
        self.running[job] = self.running.get(job, 0) + 1
        self.total += 1

    def release(self, job: str) -> None:
        job = job or "_anonymous"
        self.running[job] = max(0, self.running.get(job, 0) - 1)
        if not self.running[job]:
            del self.running[job]
        self.total = max(0, self.total - 1)
