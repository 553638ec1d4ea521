"""Answers about sandboxes as a whole: `corral.v1.sandbox.list`, and the `not_found` answer to a
call on a sandbox no node owns, so a raw NATS client gets a JSON reply instead of a bare "no
responders" status."""
from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import bus, tenancy
from corral_common.contract.envelope import error
from corral_common.contract.messages import ListRequest
from corral_common.contract.replies import SandboxListReply

from .placements import Placements
from .registry import Registry

ORPHAN_CONCURRENCY = 512  # decisions in flight; beyond, calls wait their turn in the queue
# when a call on a sandbox placed on a live node is looked at again, in case the sandbox was
# destroyed just before (its placement gone from the bucket, not yet from this replica's table)
RECHECK_AFTER_S = (0.5, 2.5)


class Listing:
    def __init__(self, nc: NATS, registry: Registry, placements: Placements, node_timeout_s: float, stale_after_s: float):
        self.nc = nc
        self.registry = registry
        self.placements = placements
        self.node_timeout_s = node_timeout_s
        self.stale_after_s = stale_after_s
        self.orphan_tasks: set[asyncio.Task] = set()
        self.orphan_slots = asyncio.Semaphore(ORPHAN_CONCURRENCY)

    async def on_list(self, msg: Msg) -> SandboxListReply:
        req = bus.decode(msg.data, ListRequest)
        who = tenancy.caller(msg)
        job = None if req.job is None else tenancy.qualify_job(who, req.job)
        out = []
        for info in self.placements.placed.values():
            if who is not None and info.tenant != who:
                continue
            if job is not None and info.job != job:
                continue
            if req.node is not None and info.node != req.node:
                continue
            if req.labels and any(info.labels.get(k) != v for k, v in req.labels.items()):
                continue
            out.append(info)
        out.sort(key=lambda i: i.created_at)
        return SandboxListReply(sandboxes=out)

    async def on_orphan(self, msg: Msg) -> None:
        """A call on `corral.v1.sandbox.<id>.>`, heard by every replica's queue group. Each is
        decided in a task of its own: the decision waits (for a placement in flight, a node's
        next heartbeat), and one subscription's callbacks run one at a time, so a burst of calls
        on expired sandboxes would otherwise queue behind each other's waits."""
        if not msg.reply:
            return
        t = asyncio.create_task(self._orphan(msg))
        self.orphan_tasks.add(t)
        t.add_done_callback(self.orphan_tasks.discard)

    async def _orphan(self, msg: Msg) -> None:
        async with self.orphan_slots:
            await self._decide(msg)

    def _recheck(self, msg: Msg, sid: str, n: int) -> None:
        """A timer, not a task per call: calls on live sandboxes are the common case."""
        p = self.placements
        if p.get(sid) is None and sid not in p.placing and sid not in p.lost_recent:
            t = asyncio.create_task(self._answer_if_gone(msg, sid))
            self.orphan_tasks.add(t)
            t.add_done_callback(self.orphan_tasks.discard)
        elif n + 1 < len(RECHECK_AFTER_S):
            asyncio.get_running_loop().call_later(RECHECK_AFTER_S[n + 1] - RECHECK_AFTER_S[n], self._recheck, msg, sid, n + 1)

    async def _answer_if_gone(self, msg: Msg, sid: str) -> None:
        if await self.placements.in_kv(sid) is False:
            await self.nc.publish(msg.reply, error("not_found", f"no node owns sandbox {sid!r}: it was destroyed, expired, or never existed"))

    async def _decide(self, msg: Msg) -> None:
        """Answer `not_found` only once sure that no live node will answer."""
        sid = msg.subject.split(".")[3]
        p = self.placements
        info = p.get(sid)
        if info is None and sid in p.placing:
            # being placed by this replica: its node may have answered the client directly
            # before its answer to us was read; decide once it is recorded
            try:
                await asyncio.wait_for(p.placing[sid].wait(), self.node_timeout_s + 5)
            except (TimeoutError, KeyError):
                pass
            info = p.get(sid)
        if info is None and sid not in p.lost_recent:
            await asyncio.sleep(0.05)  # let a just-created placement reach the watcher
            info = p.get(sid)
        if info is not None:
            node = info.node
        elif sid in p.lost_recent:
            node = p.lost_recent[sid][0]
        else:
            for wait in (0.0, 0.25):  # another replica may have placed it, its KV write in flight
                await asyncio.sleep(wait)
                if p.get(sid) is not None:
                    return
                held = await p.in_kv(sid)
                if held is None or held:
                    return  # owned (its node answers), or the bucket is unreadable: not ours to deny
            await self.nc.publish(msg.reply, error(
                "not_found", f"no node owns sandbox {sid!r}: it was destroyed, expired, or never existed"))
            return
        if self.registry.is_alive(node):
            # owned by a live node: it answers. Unless the sandbox was destroyed an instant ago and
            # its placement's delete is still on the way to this replica's watch: look again later
            if info is not None:
                asyncio.get_running_loop().call_later(RECHECK_AFTER_S[0], self._recheck, msg, sid, 0)
            return
        # the node looks lost, but it may only have been paused or slow and be answering right
        # now, its next heartbeat on the way: give it one heartbeat interval before saying no
        await asyncio.sleep(min(max(self.registry.interval(node), 0.2), self.stale_after_s))
        if self.registry.is_alive(node):
            return
        now_info = p.get(sid)
        if now_info is not None and now_info.node != node and self.registry.is_alive(now_info.node):
            return
        await self.nc.publish(msg.reply, error("not_found", f"sandbox {sid!r} was on node {node}, which is lost (no heartbeat)"))
