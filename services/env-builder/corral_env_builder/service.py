"""The env-builder service: `corral.v1.env.build|list|get|grade|delete` as a queue group.

Builds run concurrently up to `parallel_builds`; the rest wait in a bounded backlog (see limits).
It talks to the rest of corral only over the bus, through the SDK, like any user."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

import msgspec
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics, tenancy
from corral_common.contract import subjects
from corral_common.contract.envs import (
    EnvBuildReply,
    EnvBuildRequest,
    EnvDeleteReply,
    EnvGetReply,
    EnvGradeReply,
    EnvGradeRequest,
    EnvListReply,
    EnvListRequest,
    EnvRef,
)
from corral_sdk.client import AsyncClient

from .build import BuildConfig, Builder
from .catalog import EnvCatalog
from .grade import Grader
from .limits import BuildLimits
from .progress import Progress

log = logging.getLogger("corral.env")

BUILDS = metrics.counter("corral_env_builds_total", "Environment builds by outcome", ("outcome",))
BUILD_SECONDS = metrics.histogram("corral_env_build_seconds", "Build + verification time", (),
                                  buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
BUILDS_RUNNING = metrics.gauge("corral_env_builds_running", "Builds running now")
GRADES = metrics.counter("corral_env_grades_total", "Rollouts graded by outcome", ("outcome",))
GRADE_SECONDS = metrics.histogram("corral_env_grade_seconds", "Time to grade a rollout", (),
                                  buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60))


class EnvBuilderConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    parallel_builds: int = 2
    files_roots: list[str] = []
    per_job_concurrent: int = 2
    per_job_per_minute: float = 30.0
    max_backlog: int = 64
    catalog_creds: str = ""  # credentials of the catalog's own account (auth.CATALOG_CREDS_ENV)


class EnvBuilder:
    def __init__(self, cfg: EnvBuilderConfig):
        self.cfg = cfg
        self.slots = asyncio.Semaphore(cfg.parallel_builds)
        self.limits = BuildLimits(per_job_concurrent=cfg.per_job_concurrent, per_job_per_minute=cfg.per_job_per_minute,
                                  max_backlog=cfg.max_backlog)

    async def run(self, stop: asyncio.Event) -> None:
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.nc = await bus.connect(self.cfg.nats_url, name="corral-env-builder")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        # the catalog (hidden tests, solutions) lives in an account of its own, which only this
        # service's catalog identity joins; without one (a bus without accounts) it is here
        self.catalog_nc = None
        catalog_js = self.js
        if self.cfg.catalog_creds:
            self.catalog_nc = await bus.connect(self.cfg.nats_url, name="corral-env-catalog", creds=self.cfg.catalog_creds)
            catalog_js = self.catalog_nc.jetstream()
        self.catalog = await EnvCatalog.open(catalog_js, moved_from=self.js if catalog_js is not self.js else None)
        self.client = await AsyncClient.connect(nc=self.nc)
        self.builder = Builder(self.client, self.catalog, BuildConfig(self.cfg.files_roots))
        self.grader = Grader(self.client, self.catalog)
        self.responder = bus.Responder(self.nc, "env-builder", package="corral_env_builder")
        q = subjects.ENV_QUEUE
        # the catalog is shared by every tenant: what goes in and out of it is the operator's
        await self.responder.serve(subjects.ENV_BUILD, tenancy.for_operator(self._on_build, "building environments"), "build", queue=q)
        await self.responder.serve(subjects.ENV_LIST, self._on_list, "list", queue=q)
        await self.responder.serve(subjects.ENV_GET, self._on_get, "get", queue=q)
        await self.responder.serve(subjects.ENV_GRADE, self._on_grade, "grade", queue=q)
        await self.responder.serve(subjects.ENV_DELETE, tenancy.for_operator(self._on_delete, "deleting environments"), "delete", queue=q)
        metrics.UP.labels("env-builder").set(1)
        await bus.ready(self.nc, log, "env-builder ready", metrics=self.metrics_url, parallel_builds=self.cfg.parallel_builds)
        await stop.wait()
        await self.responder.drain(timeout=60)
        await self.nc.drain()
        if self.catalog_nc is not None:
            await self.catalog_nc.drain()

    async def _on_build(self, msg: Msg) -> EnvBuildReply:
        req = bus.decode(msg.data, EnvBuildRequest)
        build_id = req.build_id or f"b-{secrets.token_hex(6)}"
        progress = Progress(self.nc, build_id, req.spec.name)
        req.spec.validate()
        self.limits.admit(req.job)
        t0 = time.perf_counter()
        outcome = "error"
        try:
            await progress("queued", 0.0, f"waiting for one of {self.cfg.parallel_builds} build slots")
            async with self.slots:
                BUILDS_RUNNING.inc()
                try:
                    res = await self.builder.build(req.spec, req.job, build_id, progress)
                finally:
                    BUILDS_RUNNING.dec()
            outcome = "cached" if res.cached else ("accepted" if res.accepted else "rejected")
            logs.kv(log, logging.INFO, "build finished", build=build_id, env=req.spec.name, outcome=outcome,
                    version=res.env.version if res.env else "", failed=[c.name for c in res.report.failed()],
                    seconds=round(time.perf_counter() - t0, 2))
            return EnvBuildReply(build=res)
        finally:
            self.limits.release(req.job)
            BUILDS.labels(outcome).inc()
            BUILD_SECONDS.observe(time.perf_counter() - t0)

    async def _on_list(self, msg: Msg) -> EnvListReply:
        req = bus.decode(msg.data, EnvListRequest)
        return EnvListReply(envs=await self.catalog.list(req.prefix))

    async def _on_get(self, msg: Msg) -> EnvGetReply:
        req = bus.decode(msg.data, EnvRef)
        env = await self.catalog.get(req.name, req.version)
        versions = [e.record.version for e in await self.catalog.versions(req.name)]
        return EnvGetReply(env=env.record, versions=versions)

    async def _on_delete(self, msg: Msg) -> EnvDeleteReply:
        req = bus.decode(msg.data, EnvRef)
        env = await self.catalog.delete(req.name, req.version)
        await self.builder._delete_image(env.record.image)
        return EnvDeleteReply(name=env.record.name, version=env.record.version)

    async def _on_grade(self, msg: Msg) -> EnvGradeReply:
        req = bus.decode(msg.data, EnvGradeRequest)
        t0 = time.perf_counter()
        outcome = "error"
        try:
            res = await self.grader.grade(req, tenancy.caller(msg))
            outcome = "flagged" if res.alerts and res.reward == 0 and res.passed else ("pass" if res.reward > 0 else "fail")
            return EnvGradeReply(grade=res)
        finally:
            GRADES.labels(outcome).inc()
            GRADE_SECONDS.observe(time.perf_counter() - t0)
