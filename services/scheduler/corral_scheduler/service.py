"""The scheduler service: serves create, create_batch, run, list and the quotas as a queue
group, so several replicas can run. Its state is in NATS KV: the node registry (from
heartbeats), placements (written by the owning node-agent) and request ids (for idempotent
retries).

This module is the composition root: it connects, builds the parts over the shared state (the
registry of nodes, the placements, the admission counts) and subscribes their handlers. What each
request does is in the part's own module: creates.py, batch.py, runs.py, quotas.py, listing.py,
nodes.py."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import msgspec

from corral_common import bus, logs, metrics
from corral_common.contract import subjects

from .batch import Batches
from .creates import Creates
from .listing import Listing
from .nodes import Nodes
from .placements import Placements
from .quotas import KV_QUOTAS, Admission
from .registry import Policy, Registry
from .runs import Runs

log = logging.getLogger("corral.scheduler")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    node_timeout_s: float = 30.0
    batch_parallelism: int = 64
    stale_after_s: float = 5.0
    cpu_overcommit: float = 8.0
    hot_cpu: float = 0.85
    memory_headroom: float = 0.05
    fair_share_below_free: float = 0.1


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.registry = Registry(cfg.stale_after_s)
        self.policy = Policy(cpu_overcommit=cfg.cpu_overcommit, hot_cpu=cfg.hot_cpu, memory_headroom=cfg.memory_headroom)
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        self.metrics_url = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        nc = self.nc = await bus.connect(cfg.nats_url, name="corral-scheduler")
        js = nc.jetstream()
        await bus.ensure_streams(js)
        kv_nodes = await bus.ensure_kv(js, subjects.KV_NODES)
        kv_placements = await bus.ensure_kv(js, subjects.KV_PLACEMENTS)
        kv_requests = await bus.ensure_kv(js, subjects.KV_REQUESTS, ttl=24 * 3600)
        kv_quotas = await bus.ensure_kv(js, KV_QUOTAS)

        placements = Placements(kv_placements)
        admission = Admission(kv_quotas, self.registry, self.policy, placements.totals, cfg.fair_share_below_free)
        nodes = Nodes(nc, kv_nodes, self.registry, placements, cfg.stale_after_s)
        scatter = await bus.Scatter(nc).start()
        creates = Creates(nc, kv_requests, self.registry, self.policy, placements, admission, cfg.node_timeout_s)
        batches = Batches(nc, scatter, kv_requests, self.registry, self.policy, placements, admission, cfg.node_timeout_s)
        runs = Runs(nc, kv_requests, self.registry, self.policy)
        listing = Listing(nc, self.registry, placements, cfg.node_timeout_s, cfg.stale_after_s)

        await admission.start()
        self._spawn(admission.watch())
        await nc.subscribe(subjects.NODE_HEARTBEAT, cb=nodes.on_heartbeat)
        recent = await nodes.load()
        await placements.start()
        self._spawn(placements.watch())
        heard = await nodes.hear(recent, cfg.stale_after_s / 2)
        if heard < len(recent):
            logs.kv(log, logging.WARNING, "nodes in the bucket not heard at start", missing=len(recent) - heard)
        self._spawn(nodes.lost_loop())
        responder = bus.Responder(nc, "scheduler", package="corral_scheduler")
        q = subjects.SCHEDULER_QUEUE
        await responder.serve(subjects.SANDBOX_CREATE, creates.on_create, "create", queue=q)
        await responder.serve(subjects.SANDBOX_CREATE_BATCH, batches.on_create_batch, "create_batch", queue=q)
        await responder.serve(subjects.SANDBOX_LIST, listing.on_list, "list", queue=q)
        await responder.serve(subjects.QUOTA_SET, admission.on_set, "quota.set", queue=q)
        await responder.serve(subjects.QUOTA_GET, admission.on_get, "quota.get", queue=q)
        await responder.serve(subjects.SANDBOX_RUN, runs.on_run, "run", queue=q)
        # answers `not_found` for sandboxes no node owns, so raw NATS clients get a JSON reply
        # instead of a bare "no responders" status: every operation, however many tokens its
        # name has (files.read, port.open) or an unknown one
        await nc.subscribe(subjects.sandbox_all("*"), queue=q + "-orphans", cb=listing.on_orphan)
        metrics.UP.labels("scheduler").set(1)
        await bus.ready(self.nc, log, "scheduler ready", metrics=self.metrics_url)
        await stop.wait()
        await responder.drain()
        for t in list(self.tasks):
            t.cancel()
        await placements.stop()
        await nc.drain()
        logs.kv(log, logging.INFO, "scheduler stopped")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
