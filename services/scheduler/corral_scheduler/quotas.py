"""Per-job quotas and fair share.

Quotas live in NATS KV (`corral_quotas`, key = job, value = JobQuota JSON; key `_default` for jobs
without their own), so every scheduler replica enforces the same limits. Fair share applies under
contention: when the cluster is nearly full, a job already holding more than an equal share of
it is refused first (with a retry hint) so that other jobs can still start sandboxes."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from corral_common import bus, tenancy
from corral_common.contract import subjects
from corral_common.contract.errors import Capacity, InvalidRequest, NotFound
from corral_common.contract.messages import JobQuota, QuotaGetRequest, QuotaSetRequest, SandboxInfo, SandboxSpec
from corral_common.contract.replies import QuotaGetReply, QuotaReply, QuotaUsage

from .registry import Policy, Registry

KV_QUOTAS = "corral_quotas"
log = logging.getLogger("corral.scheduler")


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


class Admission:
    """Admits creates against the job's quota and fair share, and counts what is admitted but not
    placed yet as pending (so concurrent creates cannot all pass a quota only one fits in)."""

    def __init__(self, kv: KeyValue, registry: Registry, policy: Policy, totals: JobTotals, fair_share_below_free: float):
        self.kv = kv
        self.registry = registry
        self.policy = policy
        self.totals = totals
        self.fair_share_below_free = fair_share_below_free
        self.quotas: dict[str, JobQuota] = {}
        self.pending: dict[str, Usage] = {}
        self.watcher: bus.KVWatch | None = None

    async def start(self) -> None:
        self.watcher = bus.KVWatch(self.kv)
        await self.watcher.start()

    async def watch(self) -> None:
        """Every replica enforces the quotas any replica sets."""
        assert self.watcher is not None
        async for e in self.watcher:
            if e.operation in ("DEL", "PURGE") or not e.value:
                self.quotas.pop(e.key, None)
                continue
            try:
                self.quotas[e.key] = msgspec.json.decode(e.value, type=JobQuota)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("malformed quota ignored", extra={"fields": {"job": e.key}})

    def quota(self, job: str) -> JobQuota | None:
        return self.quotas.get(job) or self.quotas.get("_default")

    def admit(self, spec: SandboxSpec, count: int) -> None:
        """Quota and fair-share checks, then count the request as pending for its job."""
        check_quota(spec.job, self.quota(spec.job), self.totals.of(spec.job, self.pending), spec, count)
        alive = [s for s in self.registry.alive() if spec.substrate in s.hb.substrates]
        total = sum(s.hb.capacity.memory_mb for s in alive)
        free = sum(max(0, s.free(self.policy)[1]) for s in alive)
        check_fair_share(spec.job, self.totals, total, free, spec, self.fair_share_below_free)
        p = self.pending.setdefault(spec.job, Usage())
        p.sandboxes += count
        p.cpu += spec.cpu * count
        p.memory_mb += spec.memory_mb * count

    def settle(self, spec: SandboxSpec, count: int = 1) -> None:
        """`count` admitted creates are over (placed, and so in the totals, or failed)."""
        p = self.pending.get(spec.job)
        if p is None:
            return
        p.sandboxes -= count
        p.cpu -= spec.cpu * count
        p.memory_mb -= spec.memory_mb * count
        if p.sandboxes <= 0:
            self.pending.pop(spec.job, None)

    async def on_set(self, msg: Msg) -> QuotaReply:
        """`corral.v1.quota.set` (the operator's: quotas bound every tenant's jobs)."""
        tenancy.operator_only(tenancy.caller(msg), "setting quotas")
        r = bus.decode(msg.data, QuotaSetRequest)
        key = r.job or "_default"
        if not key.replace("_", "").replace("-", "").replace(".", "").replace("/", "").isalnum() or key.startswith("/"):
            raise InvalidRequest(f"job {r.job!r} cannot hold a quota: use letters, digits, '-', '_', '.' "
                                 "(and '/' after a tenant's name: alice/train)")
        for name, v in (("sandboxes", r.sandboxes), ("cpu", r.cpu), ("memory_mb", r.memory_mb)):
            if v is not None and v < 0:
                raise InvalidRequest(f"quota {name} must not be negative")
        q = JobQuota(sandboxes=r.sandboxes, cpu=r.cpu, memory_mb=r.memory_mb)
        await self.kv.put(key, msgspec.json.encode(q))
        self.quotas[key] = q
        return QuotaReply(job=key, quota=q)

    async def on_get(self, msg: Msg) -> QuotaGetReply:
        """`corral.v1.quota.get`: the job's quota and what it holds (placed and pending)."""
        r = bus.decode(msg.data, QuotaGetRequest)
        who = tenancy.caller(msg)
        if who is not None:  # a tenant asks about its own jobs (the default quota stays readable)
            r = msgspec.structs.replace(r, job=r.job if r.job == "_default" else tenancy.qualify_job(who, r.job))
        q = self.quota(r.job)
        used = self.totals.of(r.job, self.pending)
        if r.job != "_default" and r.job not in self.quotas and used.sandboxes <= 0:
            default = self.quotas.get("_default")
            raise NotFound(f"job {r.job!r} is unknown: it holds no sandboxes and has no quota of its own"
                           + (f" (the _default quota applies to it: {msgspec.json.encode(default).decode()})" if default
                              else "; no _default quota is set either") + f"; set one with {subjects.QUOTA_SET}")
        return QuotaGetReply(job=r.job, quota=q, used=QuotaUsage(sandboxes=used.sandboxes, cpu=used.cpu, memory_mb=used.memory_mb))
