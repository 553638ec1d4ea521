"""`corral.v1.sandbox.create`: one sandbox, placed on the best of up to three candidate nodes,
at most once per `spec.request_id`.

The node is asked to answer the client directly (one hop less on a create's path: client ->
scheduler -> node -> client); whether it did comes back in the `Placed` result, and the handler
relays the node's answer only if it did not."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract import subjects
from corral_common.contract.envelope import decode_reply
from corral_common.contract.errors import Code, CorralError, Unavailable
from corral_common.contract.messages import NodeCreate, SandboxInfo, SandboxSpec, encoder, new_id
from corral_common.contract.replies import NodeCreateReply, SandboxReply

from . import placement, tenants
from .counters import PLACEMENTS, REJECTIONS
from .placements import Placements
from .quotas import Admission
from .registry import Policy, Registry

log = logging.getLogger("corral.scheduler")


@dataclass(frozen=True)
class Placed:
    """A created sandbox, and whether its node already answered the client with it."""

    info: SandboxInfo
    replied: bool = False


class Creates:
    def __init__(self, nc: NATS, kv_requests: KeyValue, registry: Registry, policy: Policy, placements: Placements,
                 admission: Admission, node_timeout_s: float):
        self.nc = nc
        self.kv_requests = kv_requests
        self.registry = registry
        self.policy = policy
        self.placements = placements
        self.admission = admission
        self.node_timeout_s = node_timeout_s
        self._forgetting: set[asyncio.Task[None]] = set()
        self._unanswered: set[str] = set()  # ids being placed that some node did not answer for in time

    async def on_create(self, msg: Msg) -> SandboxReply | None:
        spec = tenants.stamp(msg, bus.decode(msg.data, SandboxSpec))
        placed = await self.create(spec, reply_to=msg.reply or "")
        return None if placed.replied else SandboxReply(sandbox=placed.info)

    async def create(self, spec: SandboxSpec, reply_to: str = "") -> Placed:
        """Place one sandbox. With `reply_to`, the node that makes it may answer there itself."""
        node = ""
        if spec.fork_of:
            spec, node = await self.placements.fork_source(spec)
        placement.check_substrate(self.registry, spec)
        self.admission.admit(spec, 1)
        try:
            return await self._create(spec, reply_to, node)
        finally:
            self.admission.settle(spec)

    async def _create(self, spec: SandboxSpec, reply_to: str, node: str) -> Placed:
        if not spec.request_id:
            return await self._place(new_id(), spec, reply_to, node)
        key = "r" + hashlib.sha256(spec.request_id.encode()).hexdigest()[:40]
        sid = new_id()
        try:
            await self.kv_requests.create(key, sid.encode())
        except KeyWrongLastSequenceError:
            return Placed(await self._existing(key, spec.request_id))
        except Exception as e:
            if "wrong last sequence" in str(e).lower() or "key exists" in str(e).lower():
                return Placed(await self._existing(key, spec.request_id))
            raise
        try:
            return await self._place(sid, spec, reply_to, node)
        except Exception as e:
            unanswered = sid in self._unanswered or not isinstance(e, CorralError) or e.code in (Code.TIMEOUT, Code.UNAVAILABLE)
            self._unanswered.discard(sid)
            # a node may still make `sid` (it got the create, its answer was lost): fence the id
            # first, so a retry under a new id never leaves two sandboxes for one request_id
            fenced, held = await self.placements.fence(sid) if unanswered else (True, None)
            if held is not None:
                PLACEMENTS.labels(held.node).inc()
                return Placed(held)  # it was made after all
            if not fenced:
                raise  # the bucket is failing over: the entry stays, and a retry waits for `sid`
            # let a retry try again: at once if the bucket takes the delete, else (its stream is
            # failing over) as soon as it does, while the retry waits in _existing
            try:
                await self.kv_requests.delete(key)
            except Exception as e:
                logs.kv(log, logging.WARNING, "request entry not deleted yet; retrying in the background", request=key, error=repr(e))
                task = asyncio.create_task(self._forget_request(key))
                self._forgetting.add(task)
                task.add_done_callback(self._forgetting.discard)
            raise

    async def _forget_request(self, key: str, wait_s: float = 60.0, first_pause: float = 0.5) -> None:
        deadline = time.monotonic() + wait_s
        pause = first_pause
        while True:
            await asyncio.sleep(pause)
            pause = 0.5
            try:
                await self.kv_requests.delete(key)
                return
            except Exception as e:
                if time.monotonic() > deadline:
                    logs.kv(log, logging.WARNING, "request entry not deleted: a retry waits for it to expire", request=key,
                            error=repr(e))
                    return

    async def _existing(self, key: str, request_id: str) -> SandboxInfo:
        """A retry of a request already seen: answer with the sandbox it made (or is making)."""
        deadline = time.monotonic() + self.node_timeout_s + 5
        sid = ""
        pause = 0.02  # a retry usually finds its sandbox at once; one of a slow create backs off (hedged asks)
        while time.monotonic() < deadline:
            try:
                e = await self.kv_requests.get(key)
            except KeyNotFoundError:
                e = None
            if e is None or not e.value:
                raise Unavailable(f"an earlier attempt with request_id {request_id!r} failed; retry", retry_after_s=0.1)
            sid = e.value.decode()
            info = await self.placements.lookup(sid)
            if info is not None:
                return info
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.25)
        # the attempt that took this request_id has had all its time: whatever became of it, fence
        # its id; then either its sandbox exists after all, or a retry may start afresh
        # (not while this replica still places it: that attempt ends on its own)
        fenced, held = await self.placements.fence(sid) if sid and sid not in self.placements.placing else (False, None)
        if held is not None:
            return held
        if fenced:
            await self._forget_request(key, wait_s=5.0, first_pause=0.0)
            raise Unavailable(f"an earlier attempt with request_id {request_id!r} failed; retry", retry_after_s=0.1)
        raise CorralError(f"request_id {request_id!r} is still being placed by another attempt", Code.TIMEOUT)

    async def _place(self, sid: str, spec: SandboxSpec, reply_to: str, node: str) -> Placed:
        done = self.placements.placing[sid] = asyncio.Event()
        try:
            return await self._place_on_a_node(sid, spec, reply_to, node)
        finally:
            self.placements.placing.pop(sid, None)
            done.set()

    async def _place_on_a_node(self, sid: str, spec: SandboxSpec, reply_to: str, node: str) -> Placed:
        """On the best of up to three candidate nodes; only on `node` if one is named (a fork)."""
        alive = self.registry.alive()
        what = "a sandbox"
        if node:
            alive = [st for st in alive if st.hb.node == node]
            if not alive:
                raise Unavailable(f"node {node}, which holds sandbox {spec.fork_of} (to fork), is not answering", retry_after_s=1.0)
            what = f"a fork of {spec.fork_of} (made on its node, {node})"
        tried: list[str] = []
        last: CorralError | None = None
        timed_out = full = False
        for st, res in placement.attempts(alive, spec, self.policy):
            tried.append(st.hb.node)
            try:
                r = await self._ask_node(st.hb.node, sid, spec, reply_to)
            except CorralError as e:
                st.reservations.remove(res)
                if e.code == Code.CONFLICT and (held := await self._held_elsewhere(sid, st.hb.node)) is not None:
                    return Placed(held)
                if e.code in (Code.CAPACITY, Code.UNAVAILABLE, Code.TIMEOUT):
                    timed_out = timed_out or e.code == Code.TIMEOUT
                    full = full or e.code == Code.CAPACITY
                    last = e
                    continue
                REJECTIONS.labels(e.code.value).inc()
                raise
            except BaseException:
                st.reservations.remove(res)
                raise
            info = r.sandbox
            st.settle(res, r.counted_at if r.counted_at is not None else info.created_at)
            PLACEMENTS.labels(st.hb.node).inc()
            self.placements.set(info)
            return Placed(info, replied=r.replied)
        if timed_out and (held := await self._held_elsewhere(sid, "")) is not None:
            return Placed(held)  # a node that did not answer in time made it meanwhile
        if timed_out:
            self._unanswered.add(sid)
        if tried and not full:
            # every node asked has room and failed for another reason (its bus or JetStream
            # recovering, an answer too slow): not `capacity`, which would send the caller to
            # wait for room, but a retry soon
            REJECTIONS.labels(Code.UNAVAILABLE.value).inc()
            raise Unavailable(f"no node could make the sandbox now; tried {', '.join(tried)}: {last.message if last else ''}",
                              retry_after_s=1.0)
        raise placement.no_room(what, spec, alive, self.policy, tried, last, retry_after_s=1.0)

    async def _held_elsewhere(self, sid: str, refused_by: str) -> SandboxInfo | None:
        """The sandbox `sid` as placed by a node other than `refused_by`, if one holds it: a node
        this create was sent to earlier did not answer in time, and made it after all. Nodes claim
        a create's placement key (compare-and-set) before they answer, so the one that did is the
        only one holding it; the others undo theirs and answer `conflict`."""
        info = await self.placements.lookup(sid)
        if info is None or info.node == refused_by or info.state not in ("running", "paused"):
            return None
        self.placements.set(info)
        PLACEMENTS.labels(info.node).inc()
        return info

    async def _ask_node(self, node: str, sid: str, spec: SandboxSpec, reply_to: str) -> NodeCreateReply:
        """The node's success reply to a create, or its error raised."""
        data = encoder.encode(NodeCreate(sandbox_id=sid, spec=spec, reply_to=reply_to))
        try:
            resp = await self.nc.request(subjects.node_create(node), data, timeout=self.node_timeout_s)
        except NoRespondersError:
            raise Unavailable(f"node {node} is not answering") from None
        except NatsTimeout:
            raise CorralError(f"node {node} did not answer within {self.node_timeout_s:g}s", Code.TIMEOUT) from None
        return decode_reply(resp.data, NodeCreateReply)
