"""The nodes as the scheduler hears them: heartbeats feed the registry (and, every few seconds,
the nodes KV bucket for other replicas and operators), and a node that stops heartbeating is
declared lost."""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract import subjects
from corral_common.contract.messages import Event, Heartbeat, encoder

from .counters import NODES_ALIVE
from .placements import Placements
from .registry import Registry

log = logging.getLogger("corral.scheduler")
LOST_MEMORY_S = 600.0  # how long a lost node's sandboxes are remembered (for orphan answers)
KV_REFRESH_S = 5.0  # how often a node's entry in the nodes bucket is rewritten


class Nodes:
    def __init__(self, nc: NATS, kv: KeyValue, registry: Registry, placements: Placements, stale_after_s: float):
        self.nc = nc
        self.kv = kv
        self.registry = registry
        self.placements = placements
        self.stale_after_s = stale_after_s
        self.kv_put_at: dict[str, float] = {}  # node -> when its bucket entry was last written (monotonic)

    async def load(self) -> set[str]:
        """The nodes other replicas heard recently: a restarted replica places at once instead of
        waiting a heartbeat interval for every node. Returns every node that was probably alive
        when the bucket was last written: an entry is rewritten only every KV_REFRESH_S, so a live
        node's is up to stale_after_s + KV_REFRESH_S older than the newest entry, and when no
        replica ran for a while every entry has aged alike. Only those younger than
        stale_after_s are placed on before they are heard."""
        try:
            keys = await bus.kv_keys(self.kv)
        except Exception:
            return set()
        beats: list[Heartbeat] = []
        for k in keys:
            try:
                e = await self.kv.get(k)
                if e is None or not e.value:
                    continue
                hb = msgspec.json.decode(e.value, type=Heartbeat)
            except Exception:  # a node's entry deleted meanwhile, or unreadable: its next heartbeat counts
                continue
            if not hb.stopping:
                beats.append(hb)
        if not beats:
            return set()
        newest = max(hb.ts for hb in beats)
        recent: set[str] = set()
        for hb in beats:
            if newest - hb.ts >= self.stale_after_s + KV_REFRESH_S:
                continue  # it had stopped heartbeating while a replica was still writing
            recent.add(hb.node)
            if time.time() - hb.ts < self.stale_after_s and hb.node not in self.registry.nodes:  # not over a live one
                self.registry.heartbeat(hb)
        return recent

    async def hear(self, names: set[str], timeout_s: float) -> int:
        """Wait (at most timeout_s) until each of `names` has heartbeated to this replica; returns
        how many were heard. A replica that answered before hearing the nodes whose bucket entries
        had aged would refuse work for want of capacity it has (all nodes that started together
        share one refresh phase, so they age out of the bucket together)."""
        since = time.monotonic()
        deadline = since + timeout_s

        def heard() -> int:
            return sum(1 for n in names if (st := self.registry.nodes.get(n)) is not None and st.seen >= since)

        while heard() < len(names) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return heard()

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = msgspec.json.decode(msg.data, type=Heartbeat)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("malformed heartbeat ignored")
            return
        self.registry.heartbeat(hb)
        NODES_ALIVE.set(len(self.registry.alive()))
        # the registry in KV is for replicas and operators, not the hot path: refresh it every few
        # seconds per node rather than on every heartbeat (a thousand nodes beat every second)
        now = time.monotonic()
        if now - self.kv_put_at.get(hb.node, 0.0) >= KV_REFRESH_S or hb.stopping:
            self.kv_put_at[hb.node] = now
            try:  # a plain publish into the bucket's stream: waiting for each ack here would queue
                # the heartbeats behind KV round trips until nodes looked stale (and were declared lost)
                await self.nc.publish(subjects.kv_key(subjects.KV_NODES, hb.node), msg.data)
            except Exception:  # the node heartbeats again in 50 ms, and that publish writes the entry
                pass

    async def lost_loop(self) -> None:
        """A node that stops heartbeating is lost: its sandboxes are reported lost and dropped from
        the placements, so calls to them get `not_found` and new work goes elsewhere.

        `corral.events.node.<node>.lost` goes out only after the placements are deleted: a node
        that was alive all along (paused, overloaded, its agent restarting) hears it and writes
        its live sandboxes' placements back, and no delete of ours can land after that."""
        lost: set[str] = set()
        lost_recent = self.placements.lost_recent
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for sid in [s for s, (_, t) in lost_recent.items() if now - t > LOST_MEMORY_S]:
                del lost_recent[sid]
            alive = {s.hb.node for s in self.registry.alive()}
            for node, st in list(self.registry.nodes.items()):
                if node in alive:
                    if node in lost:
                        lost.discard(node)
                        self.registry.declared_lost.discard(node)
                        await self._tell_heard_again(node)
                    continue
                if st.hb.stopping:
                    continue
                if node in lost:
                    # placements of a lost node that reached this replica after it was declared
                    # lost (its last writes still on their way through the KV watch, or claims
                    # of a batch it died making): lost as well, or they were listed forever
                    if self.placements.on_node(node):
                        await self._declare_lost(node, now)
                    continue
                lost.add(node)
                await self._declare_lost(node, now)
                self.registry.declared_lost.add(node)

    async def _tell_heard_again(self, node: str) -> None:
        """A node declared lost heartbeats again. It may never have heard that it was declared
        lost: a partition (its link cut) leaves its own connection to its nats-server up, so
        neither a reconnect nor a gap in its heartbeats tells it, and the event went out while
        nothing reached it. Tell it now that it is heard (`back`): it writes its live sandboxes'
        placements back (a node that already did finds nothing missing)."""
        logs.kv(log, logging.WARNING, "node heard again after it was declared lost", node=node)
        await self.nc.publish(subjects.node_event(node, "back"), encoder.encode(
            Event(kind="back", ts=time.time(), node=node, reason="heartbeating again after it was declared lost")))

    async def _declare_lost(self, node: str, now: float) -> None:
        victims = self.placements.on_node(node)
        logs.kv(log, logging.WARNING, "node lost", node=node, sandboxes=len(victims))
        for info in victims:
            self.placements.lost_recent[info.id] = (node, now)
            await self.nc.publish(subjects.event(info.id, "lost"), encoder.encode(
                Event(kind="lost", ts=time.time(), sandbox_id=info.id, node=node, job=info.job,
                      reason=f"node {node} stopped heartbeating")))
            try:
                await self.placements.delete_lost(info.id, node)
            except Exception as e:
                logs.kv(log, logging.WARNING, "placement not deleted", sandbox=info.id, error=repr(e))
        await self.nc.publish(subjects.node_event(node, "lost"), encoder.encode(
            Event(kind="lost", ts=time.time(), node=node, reason="stopped heartbeating", detail={"sandboxes": [v.id for v in victims]})))
