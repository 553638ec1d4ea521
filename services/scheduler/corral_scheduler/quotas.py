"""Per-job quotas and fair share.

Quotas live in NATS KV (`corral_quotas`, key = job, value = JobQuota JSON; key `_default` for jobs
without their own), so every scheduler replica enforces the same limits. Fair share applies under
contention: when the cluster is nearly full, a job already holding more than an equal share of
it is refused first (with a retry hint) so that other jobs can still start sandboxes."""
from __future__ import annotations

from dataclasses import dataclass

from corral_common.contract.errors import Capacity
from corral_common.contract.messages import JobQuota, SandboxInfo, SandboxSpec

KV_QUOTAS = "corral_quotas"


@dataclass
class Usage:
    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0


class JobTotals:
    """What each job holds, kept up to date as placements come and go, so admission costs the
    same with 380,000 live sandboxes as with 10."""

    def __init__(self) -> None:
        self.by_job: dict[str, Usage] = {}

    def add(self, info: SandboxInfo, sign: int = 1) -> None:
        u = self.by_job.setdefault(info.job, Usage())
        u.sandboxes += sign
        u.cpu += sign * info.cpu
        u.memory_mb += sign * info.memory_mb
        if u.sandboxes <= 0:
            self.by_job.pop(info.job, None)

    def of(self, job: str, pending: dict[str, Usage]) -> Usage:
        u = self.by_job.get(job, Usage())
        p = pending.get(job, Usage())
        return Usage(sandboxes=u.sandboxes + p.sandboxes, cpu=u.cpu + p.cpu, memory_mb=u.memory_mb + p.memory_mb)


def check_quota(job: str, quota: JobQuota | None, used: Usage, spec: SandboxSpec, count: int = 1) -> None:
    if quota is None:
        return
    label = job or "(no job)"
    if quota.sandboxes is not None and used.sandboxes + count > quota.sandboxes:
        raise Capacity(f"job {label} would hold {used.sandboxes + count} sandboxes, above its quota of {quota.sandboxes}",
                       retry_after_s=5.0)
    if quota.cpu is not None and used.cpu + spec.cpu * count > quota.cpu + 1e-9:
        raise Capacity(f"job {label} would request {used.cpu + spec.cpu * count:g} cpu, above its quota of {quota.cpu:g}",
                       retry_after_s=5.0)
    if quota.memory_mb is not None and used.memory_mb + spec.memory_mb * count > quota.memory_mb:
        raise Capacity(f"job {label} would request {used.memory_mb + spec.memory_mb * count} MiB, above its quota of "
                       f"{quota.memory_mb} MiB", retry_after_s=5.0)


def check_fair_share(job: str, totals: JobTotals, total_memory_mb: int, free_memory_mb: int,
                     spec: SandboxSpec, contention: float = 0.1) -> None:
    """Under contention (less than `contention` of memory free), refuse a job above its equal share."""
    if total_memory_mb <= 0 or free_memory_mb > total_memory_mb * contention:
        return
    jobs = set(totals.by_job) | {job}
    if len(jobs) < 2:
        return  # nobody to be fair to: plain capacity decides
    share = total_memory_mb / len(jobs)
    mine = totals.by_job.get(job, Usage()).memory_mb
    if mine + spec.memory_mb > share:
        raise Capacity(f"the cluster is contended ({free_memory_mb} of {total_memory_mb} MiB free) and job {job or '(no job)'} "
                       f"holds {mine} MiB, above its fair share of {share:.0f} MiB among {len(jobs)} jobs",
                       retry_after_s=10.0)
