"""Answers about sandboxes as a whole: `corral.v1.sandbox.list`, and the `not_found` answer to a
call on a sandbox no node owns (or `unavailable`, to one whose node-agent is down), so a raw NATS
client gets a JSON reply instead of a bare "no responders" status or a silent timeout."""
from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from corral_common import bus, tenancy
from corral_common.contract import envelope, subjects
from corral_common.contract.envelope import decode_reply, error
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import ListRequest
from corral_common.contract.replies import DestroyReply, NodePingReply, SandboxListReply

from .placements import Placements
from .registry import Registry

ORPHAN_CONCURRENCY = 512  # decisions in flight; beyond, calls wait their turn in the queue
# when a call on a sandbox placed on a live node is looked at again, in case the sandbox was
# destroyed just before (its placement gone from the bucket, not yet from this replica's table)
RECHECK_AFTER_S = (0.5, 2.5)
OVERDUE_BEATS = 3  # heartbeat intervals without one before a node's agent is asked whether it still runs
# a node-agent stopping on request finishes the calls it holds within its drain timeout (5 s)
DRAIN_GRACE_S = 6.0
NO_AGENT_PINGS, NO_AGENT_PING_GAP_S = 4, 1.0  # "no agent" only after every ping of ~3 s went unserved


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
        # read-your-writes: a sandbox whose destroy was answered is not listed (its node deletes
        # the placement before answering; the table follows the bucket a moment later)
        await self.placements.caught_up()
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
            if msg.subject.endswith(".destroy"):
                # it was there when the call came and is gone now: what the destroy asked for,
                # whether this call (its node deletes the placement, then answers: this may come
                # second, and is dropped) or another did it
                await self.nc.publish(msg.reply, envelope.encode(DestroyReply(sandbox_id=sid)))
                return
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
        st = self.registry.nodes.get(node)
        if self.registry.is_alive(node) or (st is not None and st.hb.stopping and self.registry.recent(node)):
            # owned by a live node: it answers. Unless the sandbox was destroyed an instant ago and
            # its placement's delete is still on the way to this replica's watch: look again later
            if info is not None:
                asyncio.get_running_loop().call_later(RECHECK_AFTER_S[0], self._recheck, msg, sid, 0)
            # or its agent is down (restarting: killed, or stopping with its sandboxes kept), when
            # nothing holds the sandbox's subject and the call would go unanswered
            if st is not None:
                heard = time.monotonic()
                due = max(0.0, st.seen + OVERDUE_BEATS * st.interval - heard)
                asyncio.get_running_loop().call_later(due, self._spawn_check, msg, sid, node, st.hb.incarnation, heard)
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

    def _spawn_check(self, msg: Msg, sid: str, node: str, incarnation: str, heard: float) -> None:
        st = self.registry.nodes.get(node)
        if st is None or (st.seen > heard and st.hb.incarnation == incarnation and not st.hb.stopping):
            return  # the same agent process beat before and after the call: it held the subject throughout
        info = self.placements.get(sid)
        if info is None or info.node != node:
            return  # destroyed or moved meanwhile: the other checks answer for it
        t = asyncio.create_task(self._answer_if_agent_missed(msg, sid, node, incarnation, heard, st.hb.stopping))
        self.orphan_tasks.add(t)
        t.add_done_callback(self.orphan_tasks.discard)

    async def _answer_if_agent_missed(self, msg: Msg, sid: str, node: str, incarnation: str, heard: float, stopping: bool) -> None:
        """Answer `unavailable` for a call no node-agent process can have taken: none serves the
        node now, or the one serving began after the call was heard here (the bus routed the call
        before this replica heard it). A process that answers and was serving before stays the
        one to answer; so does a node that does not answer a ping at all (paused: its
        subscriptions stand)."""
        for attempt in range(NO_AGENT_PINGS):
            sent = time.monotonic()
            try:
                resp = await self.nc.request(subjects.node_ping(node), b"{}", timeout=1.0)
                break
            except NoRespondersError:
                if stopping:
                    # stopped on request: it finishes the calls it took before it lets go of the
                    # bus; ask again once it certainly has
                    await asyncio.sleep(DRAIN_GRACE_S)
                    return await self._answer_if_agent_missed(msg, sid, node, incarnation, heard, False)
                # or only between servers (reconnecting after a NATS server failed, its interest
                # not yet known everywhere): an agent that is gone stays silent on every ping
                await asyncio.sleep(NO_AGENT_PING_GAP_S)
            except (NatsTimeout, TimeoutError):
                return
        else:
            await self.nc.publish(msg.reply, error(
                "unavailable", f"the node-agent of node {node}, which holds sandbox {sid!r}, is not running (killed or "
                "restarting; a restarted agent adopts the sandbox): the call was not answered and, if it had begun, "
                "did not finish; call again once the node is back", retry_after_s=1.0))
            return
        try:
            ping = decode_reply(resp.data, NodePingReply)
        except CorralError:
            return
        if ping.incarnation != incarnation and sent - ping.serving_s > heard:
            await self.nc.publish(msg.reply, error(
                "unavailable", f"the node-agent of node {node} restarted while this call on sandbox {sid!r} was on its "
                "way: no agent process took it (nothing ran); call again", retry_after_s=0.1))
