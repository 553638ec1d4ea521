"""The node's heartbeats: capacity, what its sandboxes request and what they actually use.

Usage is sampled by its own task on its own thread, and a heartbeat carries the latest sample, so
heartbeats go out every heartbeat_s whatever else the node is doing. A node the scheduler
declared lost (it missed our heartbeats: paused, overloaded, restarting) has had its placements
deleted: those of the sandboxes still alive are written back here."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import logs
from corral_common.contract import subjects
from corral_common.contract.messages import Heartbeat, NodeUsage, encoder

from .audit.limits import limit_counters
from .audit.wiring import AuditWiring
from .events import Events
from .placements import Placements
from .table import SandboxTable
from .usage import Observed, UsageTracker
from .warm import Warm

log = logging.getLogger("corral.node")

WRITTEN_BACK = "placement written back after the node was declared lost"
WRITE_BACK_AGAIN_S = 3.0  # the second write-back, past a delete that was still on its way


class Heartbeats:
    def __init__(self, nc: NATS, node: str, table: SandboxTable, placements: Placements, events: Events, audit: AuditWiring,
                 pool: Callable[[], Warm | None], heartbeat_s: float, usage_top: int, metrics_url: str = ""):
        self.nc = nc
        self.node = node
        self.table = table
        self.placements = placements
        self.events = events
        self.audit = audit
        self.pool = pool  # the warm pools (their sandboxes' memory is the node's too)
        self.heartbeat_s = heartbeat_s
        self.metrics_url = metrics_url
        self.usage = UsageTracker(usage_top)
        self.usage_thread = ThreadPoolExecutor(1, thread_name_prefix="usage")  # never behind teardowns
        self.observed = Observed()
        self.observed_cpu = 0.0
        self.observed_mem_mb = 0
        self.adopted = 0  # sandboxes adopted at start (their placements are checked after the first heartbeat)
        self.write_back_lock = asyncio.Lock()
        # destroys a live sandbox whose id another node holds now (Lifecycle.safe_destroy)
        self.displaced: Callable[[str, str], Awaitable[None]] | None = None
        self.tasks: set[asyncio.Task] = set()
        self.incarnation = uuid.uuid4().hex[:12]  # this process's, in every heartbeat and ping
        self.serving_since: float | None = None  # monotonic: from here on, sandboxes' subjects are served

    def serving_s(self) -> float:
        return 0.0 if self.serving_since is None else time.monotonic() - self.serving_since

    async def listen(self) -> None:
        """Hear the scheduler declare this node lost (before sandboxes are adopted), and say it
        heard the node again after declaring it lost (`back`: a node cut off by a partition never
        heard the `lost` event, and its own connection never broke)."""
        for kind in ("lost", "back"):
            await self.nc.subscribe(subjects.node_event(self.node, kind), cb=self._on_declared_lost)

    def start(self) -> None:
        self._spawn(self._loop())

    def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self.usage_thread.shutdown(wait=False)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------------ usage

    async def _collect_usage(self) -> None:
        """Per-sandbox CPU rate and memory, read in a worker thread (cgroup files; thousands of
        sandboxes must not stall the loop). Sandboxes without a cgroup of ours (docker without
        one) are asked through their substrate and only count in the aggregate."""
        groups, others = {}, []
        for sid, sb in list(self.table.sandboxes.items()):
            cg = sb.cg
            if cg is not None:
                groups[sid] = cg
            elif sid in self.table.substrate_of:
                others.append(sb)
        pool = self.pool()
        if pool is not None:
            groups.update(pool.cgroups())  # warm sandboxes' memory is the node's too
        obs = await asyncio.get_running_loop().run_in_executor(self.usage_thread, self.usage.collect, groups, set(self.table.sandboxes))
        mem = obs.memory_bytes
        for sb in others:
            try:
                mem += (await self.table.substrate_of[sb.id].usage(sb)).memory_bytes
            except Exception:
                continue
        self.observed = obs
        self.observed_cpu = obs.cpu
        self.observed_mem_mb = mem // (1024 * 1024)

    async def _collect_usage_safe(self) -> None:
        try:
            await self._collect_usage()
        except Exception:
            log.exception("usage collection failed")
        if self.audit.enabled:  # what background processes ran into: OOM kills, pids-limit hits
            # read on the usage thread: ~4 cgroup files per sandbox, which for 2,000 sandboxes
            # held the loop for hundreds of ms per heartbeat (creates at 2,000 alive took 5x longer)
            pairs = list(self.table.live_items())
            counters = await asyncio.get_running_loop().run_in_executor(
                self.usage_thread, lambda: [limit_counters(sb, sub) for sb, sub in pairs])
            for (sb, _), now in zip(pairs, counters):
                if self.table.is_live(sb.id):
                    self.audit.limits.report(sb, now)

    # ------------------------------------------------------------------ heartbeats

    async def publish(self, stopping: bool = False) -> None:
        # creates in flight are left out: the scheduler that sent them holds a reservation for
        # each until a heartbeat taken after the node's answer covers it (counting both made a
        # node look full with room to spare); the node's own admission check counts them
        stopping = stopping or not self.table.accepting  # every heartbeat of a stopping node says so
        cpu, mem = self.table.requested(creating=False)
        pool = self.pool()
        hb = Heartbeat(
            node=self.node, ts=time.time(), capacity=self.table.capacity,
            usage=NodeUsage(cpu=round(self.observed_cpu, 3), memory_mb=self.observed_mem_mb, sandboxes=self.table.held(creating=False),
                            requested_cpu=cpu, requested_memory_mb=mem,
                            pooled=pool.count() if pool else 0, per_sandbox=self.observed.per_sandbox, per_sandbox_omitted=self.observed.omitted),
            substrates=list(self.table.substrates), metrics_url=self.metrics_url, stopping=stopping,
            warm=pool.by_image() if pool else {}, incarnation=self.incarnation,
        )
        # published, not flushed with a PING round trip: nats-py (2.16) cancels a flush's future on
        # its timeout, and the PONG arriving after that raises InvalidStateError in the client's
        # read loop, which then stops for good: the node still sent heartbeats but heard no
        # create, reply or KV ack again. The client's flusher writes the heartbeat out at once.
        try:
            await self.nc.publish(subjects.NODE_HEARTBEAT, encoder.encode(hb))
        except Exception:
            log.warning("heartbeat not sent")

    async def _loop(self) -> None:
        """Heartbeats go out every heartbeat_s whatever else the node is doing: usage is sampled
        by its own task on its own thread, and a heartbeat carries the latest sample. (When the
        sampling waited on the shared thread pool, a node destroying 2,000 sandboxes queued it
        behind their teardowns, stopped heartbeating and was declared lost.)

        After the first heartbeat of an agent that adopted sandboxes, and after a gap in our own
        heartbeats long enough for the scheduler to have declared the node lost (the process was
        stopped or starved; the lost event itself may have been missed over a reconnect), the
        placements of live sandboxes are checked and written back where they are missing (or still
        hold this node's own batch claim)."""
        collecting: asyncio.Task | None = None
        first = True
        last = time.monotonic()
        while True:
            if collecting is None or collecting.done():
                collecting = asyncio.ensure_future(self._collect_usage_safe())
            await self.publish()
            now = time.monotonic()
            if (first and self.adopted) or now - last > max(3 * self.heartbeat_s, 2.0):
                self._spawn(self._write_back())
            first, last = False, now
            await asyncio.sleep(self.heartbeat_s)

    # ------------------------------------------------------------------ declared lost

    async def _on_declared_lost(self, msg: Msg) -> None:
        logs.kv(log, logging.WARNING, "the scheduler declared this node lost; writing placements back", node=self.node,
                sandboxes=len(self.table.sandboxes))
        self._spawn(self._write_back())

    async def _write_back(self) -> None:
        """Write the placements of live sandboxes back to KV where they are missing (a scheduler
        deleted them when it declared the node lost), each announced with a `ready` event. Done
        twice, WRITE_BACK_AGAIN_S apart, in case a delete was still on its way the first time."""
        async with self.write_back_lock:
            for round_ in range(2):
                if round_:
                    await asyncio.sleep(WRITE_BACK_AGAIN_S)
                if not self.table.accepting:
                    return
                written = []
                for sb, _ in self.table.live_items():
                    await self.placements.written(sb.id)
                    try:
                        stored = await self.placements.stored(sb.id)
                    except Exception as e:
                        logs.kv(log, logging.WARNING, "placement not checked", sandbox=sb.id, error=str(e))
                        continue
                    # our own batch claim (`creating`) of a sandbox made just before a kill cut
                    # off its placement write is not a placement: it is replaced like a missing one
                    if stored is not None and stored.node == self.node and stored.state != "creating":
                        continue
                    if stored is not None and stored.node != self.node:
                        # its id was made again elsewhere (a batch asked again) or fenced while this
                        # node was declared lost: two sandboxes must not answer to one id, and the
                        # caller was told this one is lost
                        logs.kv(log, logging.WARNING, "placement names another node; sandbox destroyed", sandbox=sb.id,
                                owner=stored.node)
                        if self.displaced is not None:
                            self._spawn(self.displaced(sb.id, f"its id was placed on {stored.node or 'no node'} "
                                                              f"while node {self.node} was declared lost"))
                        continue
                    if not self.table.is_live(sb.id):
                        continue  # destroyed meanwhile: its delete must stay the last word
                    self.placements.record(sb)  # ordered with later writes and the destroy's delete
                    written.append(sb)
                for sb in written:
                    await self.placements.written(sb.id)
                    if sb.id in self.table.sandboxes:
                        await self.events.of(sb, "ready", reason=WRITTEN_BACK)
                if written:
                    logs.kv(log, logging.WARNING, "placements written back", node=self.node, sandboxes=len(written), round=round_ + 1)
