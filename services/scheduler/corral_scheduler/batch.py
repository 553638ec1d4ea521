"""create_batch at scale: plan a whole batch at once, one request per node, progress on the bus.

Placing item by item costs a node choice, a node round trip and a reply per sandbox; a batch of
thousands spends its time in that overhead. Here the batch is planned in one pass (how many items
each node takes, by the request's pack/spread policy), each node gets its items in one
`corral.node.<node>.create_batch` request, and items a node refuses are planned again elsewhere.

Idempotency without a KV write per item: with a request_id, item i's sandbox id is derived from it
(`item_id`), and a node claims the placement key with a KV create before it counts an item as made,
so a retried or concurrently repeated batch finds what earlier attempts made and no item is ever
made on two nodes. One small record per batch (`batch_records.py`, written at its start and end) tells a later
retry which items were made, so a sandbox destroyed since is reported as gone, not made again."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import json
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract import envelope, subjects
from corral_common.contract.envelope import ErrorBody
from corral_common.contract.errors import Capacity, Code, CorralError, NotFound, Unavailable, from_code
from corral_common.contract.messages import (
    BatchProgress,
    CreateBatchRequest,
    NodeCreate,
    NodeCreateBatch,
    SandboxInfo,
    SandboxSpec,
    encoder,
    new_id,
)
from corral_common.contract.replies import BatchFailure, CreateBatchReply, NodeBatchReply

from . import placement, tenants
from .batch_records import Records, check_same_batch
from .counters import BATCH_SECONDS, PLACEMENTS, REJECTIONS
from .placements import Placements
from .quotas import Admission
from .registry import NodeState, Policy, Registry, Reservation

log = logging.getLogger("corral.scheduler")

NODE_BATCH_MAX = 256  # items per node request: bounds its size and its time on a real node
SPREAD_QUANTUM = 0.01  # spread hands out items in steps of this share of a node's room


def item_id(request_id: str, index: int) -> str:
    """The sandbox id of item `index` of the batch with this request_id (same on every retry)."""
    return "sb-" + hashlib.blake2b(f"{request_id}#{index}".encode(), digest_size=6).hexdigest()


def record_key(request_id: str) -> str:
    return "b" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def default_batch_id(request_id: str) -> str:
    return "b" + hashlib.sha256(request_id.encode()).hexdigest()[:20]


def spec_digest(spec: SandboxSpec) -> str:
    """A digest of what a batch asks for, independent of how the request spelt it (key order,
    defaults given or left out)."""
    body = json.dumps(msgspec.to_builtins(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def slots(st: NodeState, spec: SandboxSpec, policy: Policy) -> int:
    """How many sandboxes of `spec` fit on the node now."""
    if spec.substrate not in st.hb.substrates or st.hot(policy):
        return 0
    cpu, mem, n = st.free(policy)
    return max(0, min(int((cpu + 1e-9) // spec.cpu), mem // spec.memory_mb, n))


def plan(nodes: list[NodeState], spec: SandboxSpec, count: int, policy: Policy) -> list[tuple[NodeState, int]]:
    """Spread items over nodes: `spread` gives the next items to the node with the largest free
    share of its scarcest resource after what it was already given (water-filling, so a batch
    lands evenly), in quanta of 1% of the node's whole room for this spec (so nodes end within 1%
    of each other, and a batch of 5,000 on a thousand big nodes is ~50 node requests, not 1,000);
    `pack` fills the fullest nodes that fit first. Returns (node, items) pairs whose items add up
    to at most `count` (less when the cluster has less room)."""
    room = [(st, k) for st in nodes if (k := slots(st, spec, policy)) > 0]
    if not room or count <= 0:
        return []
    if spec.placement == "pack":
        room.sort(key=lambda p: placement.free_share(p[0], policy))
        out = []
        left = count
        for st, k in room:
            take = min(k, left)
            out.append((st, take))
            left -= take
            if not left:
                break
        return out
    # spread: a heap on the free share each node would have after one more item
    cpu_c, mem_c = spec.cpu, spec.memory_mb
    base = []
    heap = []
    for idx, (st, k) in enumerate(room):
        cpu, mem, n = st.free(policy)
        cap = st.hb.capacity
        dc, dm, dn = max(st.cpu_ceiling(policy), 1e-9), max(cap.memory_mb, 1), max(cap.sandboxes, 1)
        quantum = max(1, int(SPREAD_QUANTUM * min(dc / cpu_c, dm / mem_c, dn)))
        base.append((cpu, mem, n, dc, dm, dn, k, quantum))
        heap.append((-min(cpu / dc, mem / dm, n / dn), idx))
    heapq.heapify(heap)
    given = [0] * len(room)
    left = count
    while left and heap:
        _, idx = heapq.heappop(heap)
        cpu, mem, n, dc, dm, dn, k, quantum = base[idx]
        take = min(quantum, left, k - given[idx])
        given[idx] += take
        left -= take
        g = given[idx]
        if g < k:
            heapq.heappush(heap, (-min((cpu - g * cpu_c) / dc, (mem - g * mem_c) / dm, (n - g) / dn), idx))
    return [(room[i][0], g) for i, g in enumerate(given) if g]


def reply(batch_id: str, made: list[SandboxInfo], failed: list[BatchFailure], limit: int) -> bytes:
    """The create_batch reply (encoded: its size decides what goes in), cut to the bus's payload
    limit: a reply that does not fit is never delivered, so when every SandboxInfo does not fit
    (tens of thousands of sandboxes with long labels), the reply keeps every failure and as many
    sandboxes as fit, and says how many it left out (`truncated`); those are listed by
    `corral.v1.sandbox.list` (by job or labels)."""
    def body(sandboxes: list[SandboxInfo], failures: list[BatchFailure], truncated: int = 0) -> bytes:
        return envelope.encode(CreateBatchReply(batch_id=batch_id, sandboxes=sandboxes, failed=failures, truncated=truncated))

    whole = body(made, failed)
    if len(whole) <= limit or not made:
        return whole
    per = (len(whole) - len(body([], failed))) / len(made)
    n = max(0, int((limit - (len(whole) - per * len(made)) - 64) / per))
    while n > 0:
        cut = body(made[:n], failed, len(made) - n)
        if len(cut) <= limit:
            return cut
        n = int(n * 0.95)
    return body([], failed[: max(0, limit // 200)], len(made))


class Progress:
    """Publishes `corral.events.batch.<id>.progress` every `every` items or `interval_s` seconds
    (whichever comes first, only when something changed) and `.done` once at the end; each also to
    `reply` (the request's reply subject, when it asked for progress there)."""

    def __init__(self, nc: NATS, batch_id: str, total: int, job: str = "", request_id: str = "",
                 every: int | None = None, interval_s: float = 1.0, reply: str = ""):
        self.nc = nc
        self.reply = reply
        self.batch_id = batch_id
        self.total = total
        self.job = job
        self.request_id = request_id
        self.every = every or max(1, min(1000, total // 20))
        self.interval_s = interval_s
        self.placed = 0
        self.failed = 0
        self._sent = -1  # placed + failed at the last event
        self._sent_at = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None
        self.events = 0

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.placed + self.failed != self._sent:
                await self._publish("progress")

    async def add(self, placed: int = 0, failed: int = 0) -> None:
        self.placed += placed
        self.failed += failed
        n = self.placed + self.failed
        if n - max(self._sent, 0) >= self.every or time.monotonic() - self._sent_at >= self.interval_s:
            await self._publish("progress")

    async def _publish(self, kind: str) -> None:
        self._sent = self.placed + self.failed
        self._sent_at = time.monotonic()
        ev = BatchProgress(batch_id=self.batch_id, total=self.total, placed=self.placed, failed=self.failed, done=kind == "done",
                           ts=time.time(), job=self.job, request_id=self.request_id)
        self.events += 1
        body = encoder.encode(ev)
        try:
            await self.nc.publish(subjects.batch_event(self.batch_id, kind), body)
            if self.reply:
                await self.nc.publish(self.reply, body)
        except Exception:
            pass  # progress is advisory: never fail a batch over it

    async def done(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        await self._publish("done")


Item = tuple[int, str]  # (index in the batch, sandbox id)


class Batches:
    """`corral.v1.sandbox.create_batch`: plan the batch, one request per node, partial success
    per item, progress events, idempotent with `spec.request_id`."""

    def __init__(self, nc: NATS, scatter: bus.Scatter, kv_requests: KeyValue, registry: Registry, policy: Policy,
                 placements: Placements, admission: Admission, node_timeout_s: float):
        self.nc = nc
        self.scatter = scatter
        self.records = Records(kv_requests)
        self.registry = registry
        self.policy = policy
        self.placements = placements
        self.admission = admission
        self.node_timeout_s = node_timeout_s

    async def on_create_batch(self, msg: Msg) -> bytes:
        req = bus.decode(msg.data, CreateBatchRequest)
        spec = req.spec = tenants.stamp(msg, req.spec)
        placement.check_substrate(self.registry, spec)
        rid = spec.request_id
        batch_id = req.batch_id or (default_batch_id(rid) if rid else new_id("batch"))
        ids = [item_id(rid, i) for i in range(req.count)] if rid else [new_id() for _ in range(req.count)]
        results: list[SandboxInfo | CorralError | None] = [None] * req.count
        digest = spec_digest(spec) if rid else ""
        key = record_key(rid) if rid else ""
        record = await self.records.get(key) if rid else None
        if record is not None:
            check_same_batch(rid, record, req.count, digest, spec)
            record = await self.records.settled(key, rid, record, req.count, digest, spec)
        failed_before = set(record.failed) if record is not None else set()
        # a placement on a node that is not alive is not taken as made: its node may be lost with
        # it, and its placement not deleted yet (the bucket failing over with the host that died:
        # the lost loop deletes it again every second), or deleted already on the replica that
        # declared the node lost while this one's table still shows it
        alive = {s.hb.node for s in self.registry.alive()}
        todo: list[Item] = []
        for i, sid in enumerate(ids):
            info = self.placements.get(sid)
            if info is not None and info.node in alive:
                results[i] = info
            elif record is not None and i not in failed_before:
                results[i] = await self._gone_or_placed(sid, i, alive)
            else:
                todo.append((i, sid))
        node = ""  # a batch of forks is made on its source's node (resolved only if there is work to do:
        # a retry of a finished one answers from its record even once the source is gone)
        if todo and spec.fork_of:
            spec, node = await self.placements.fork_source(spec)
        if todo:
            self._check_room(spec, len(todo), node)
            if rid:
                await self.records.start(key, rid, req.count, digest, spec)
            self.admission.admit(spec, len(todo))
        progress = Progress(self.nc, batch_id, req.count, job=spec.job, request_id=rid,
                            reply=(msg.reply or "") if req.stream_progress else "")
        progress.placed = sum(1 for r in results if isinstance(r, SandboxInfo))
        progress.failed = sum(1 for r in results if isinstance(r, CorralError))
        progress.start()
        t0 = time.perf_counter()
        try:
            if todo:
                async with self.records.lease(key, rid, req.count, digest) if rid else contextlib.nullcontext():
                    await _Placing(self, spec, results, progress, node).run(todo)
        finally:
            await progress.done()
        BATCH_SECONDS.observe(time.perf_counter() - t0)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [BatchFailure(index=i, code=r.code.value, message=r.message) for i, r in enumerate(results) if isinstance(r, CorralError)]
        if rid:
            await self.records.finish(key, rid, req.count, [f.index for f in failed], digest)
        logs.kv(log, logging.INFO, "batch placed", batch_id=batch_id, request_id=rid, count=req.count, placed=len(made), failed=len(failed),
                seconds=round(time.perf_counter() - t0, 3))
        if not made:
            first = failed[0]
            raise from_code(first.code, f"none of the {req.count} sandboxes could be created: {first.message}")
        return reply(batch_id, made, failed, limit=max(64 * 1024, (self.nc.max_payload or 1 << 20) - 1024))

    async def _gone_or_placed(self, sid: str, index: int, alive: set[str]) -> SandboxInfo | CorralError:
        """An item an earlier attempt made that this replica does not see placed (yet) on a live node."""
        info = await self.placements.lookup(sid)
        if info is not None and info.node in alive:
            return info
        return NotFound(f"item {index} (sandbox {sid}) was made by an earlier attempt of this batch and is gone "
                        f"(destroyed, expired or its node lost); it is not made again")

    def _check_room(self, spec: SandboxSpec, count: int, node: str) -> None:
        """Refuse at once a batch the live nodes (`node` only, if named) cannot hold, before
        anything is admitted or sent."""
        alive = [s for s in self.registry.alive() if not node or s.hb.node == node]
        usable = [s for s in alive if spec.substrate in s.hb.substrates and not s.hot(self.policy)]
        free = [s.free(self.policy) for s in usable]
        free_cpu = sum(max(0.0, f[0]) for f in free)
        free_mem = sum(max(0, f[1]) for f in free)
        free_n = sum(max(0, f[2]) for f in free)
        if spec.cpu * count > free_cpu + 1e-9 or spec.memory_mb * count > free_mem or count > free_n:
            REJECTIONS.labels("capacity").inc()
            raise Capacity(
                f"a batch of {count} x (cpu={spec.cpu:g}, memory_mb={spec.memory_mb}) does not fit: "
                f"free {free_cpu:g} cpu, {free_mem} MiB, {free_n} slots across {len(alive)} node(s)", retry_after_s=5.0,
            )


class _Placing:
    """One batch's items on their way to nodes, over up to three rounds: each round plans the
    items left over the live nodes that have not refused for room, sends each node its share in
    one request, and keeps what nodes refused for room for the next round. Every item ends as a
    SandboxInfo or an error in `results`, and the job's pending admission is settled item by item."""

    ROUNDS = 3

    def __init__(self, batches: Batches, spec: SandboxSpec, results: list[SandboxInfo | CorralError | None], progress: Progress,
                 node: str = ""):
        self.b = batches
        self.spec = spec
        self.node = node  # the only node it may go to ("": any; a batch of forks: its source's)
        self.results = results
        self.progress = progress
        self.refused: set[str] = set()  # nodes that said they have no room: not planned again
        self.last: dict[int, CorralError] = {}  # why an item was refused last (its error if no round places it)

    def _resolve(self, i: int, value: SandboxInfo | CorralError) -> None:
        self.results[i] = value
        self.b.admission.settle(self.spec)

    async def run(self, todo: list[Item]) -> None:
        spec = self.spec
        pending = todo
        try:
            for _round in range(self.ROUNDS):
                if not pending:
                    break
                pending = await self._round(pending)
            for i, _ in pending:
                self._resolve(i, self.last.get(i) or Capacity("no node took this item after three rounds", retry_after_s=1.0))
            if pending:
                await self.progress.add(failed=len(pending))
        finally:
            for i, _ in todo:  # cancelled: release what is still counted as pending
                if self.results[i] is None:
                    self.b.admission.settle(spec)

    async def _round(self, pending: list[Item]) -> list[Item]:
        """Plan and send `pending`; the items to plan again."""
        spec, b = self.spec, self.b
        alive = [s for s in b.registry.alive() if s.hb.node not in self.refused and (not self.node or s.hb.node == self.node)]
        groups: list[tuple[NodeState, list[Item]]] = []
        pos = 0
        for st, k in plan(alive, spec, len(pending), b.policy):
            for j in range(pos, pos + k, NODE_BATCH_MAX):
                groups.append((st, pending[j:min(pos + k, j + NODE_BATCH_MAX)]))
            pos += k
        overflow = pending[pos:]
        if overflow:
            err = Capacity(f"no node has room for more sandboxes with cpu={spec.cpu:g}, memory_mb={spec.memory_mb}, "
                           f"substrate={spec.substrate} ({placement.describe_room(b.registry.alive(), b.policy)})",
                           retry_after_s=1.0)
            for i, _ in overflow:
                self._resolve(i, self.last.get(i, err))
            await self.progress.add(failed=len(overflow))
        retry: list[Item] = []
        reqs: list[tuple[str, bytes, dict[str, str] | None]] = []
        sent: list[tuple[NodeState, list[Item], Reservation]] = []
        rid = spec.request_id
        for st, chunk in groups:
            k = len(chunk)
            res = Reservation(cpu=spec.cpu * k, memory_mb=spec.memory_mb * k, n=k)
            st.reservations.append(res)
            items = [NodeCreate(sandbox_id=sid, spec=msgspec.structs.replace(spec, request_id=f"{rid}#{i}") if rid else spec)
                     for i, sid in chunk]
            reqs.append((subjects.node_create_batch(st.hb.node), encoder.encode(NodeCreateBatch(items=items)), None))
            sent.append((st, chunk, res))
        timeout = b.node_timeout_s + 0.25 * max((len(c) for _, c in groups), default=0)
        lost = b.registry.declared_lost
        async for j, msg in b.scatter.requests(reqs, timeout, give_up=lambda j: sent[j][0].hb.node in lost):
            st, chunk, res = sent[j]
            retry += await self._node_reply(st, chunk, res, msg, timeout)
        return retry

    async def _node_reply(self, st: NodeState, chunk: list[Item], res: Reservation, msg: Msg | None, timeout: float) -> list[Item]:
        """One node's answer to its share of a batch: record what it made, fail what cannot be
        made, and return what to plan again: what it refused for room (`capacity`, `unavailable`,
        or `conflict` for an item held elsewhere that is not visible yet)."""
        spec = self.spec
        node, k = st.hb.node, len(chunk)
        whole: CorralError | None = None
        reply: NodeBatchReply | None = None
        if msg is None and node in self.b.registry.declared_lost:
            # its placements are deleted: planned again elsewhere under the same ids (were it
            # alive after all, it finds them taken when it is heard again and destroys its copies)
            whole = Unavailable(f"node {node} was lost while it made its share of the batch")
        elif msg is None:
            # the node may still make them: with a request_id a retry of the batch finds them
            whole = CorralError(f"node {node} did not answer within {timeout:g}s", Code.TIMEOUT)
        elif bus.no_responders(msg):
            whole = Unavailable(f"node {node} is not answering")
        else:
            try:
                reply = envelope.decode_reply(msg.data, NodeBatchReply)
            except CorralError as e:  # the node's error, or `internal` naming what did not match
                whole = e
            else:
                if len(reply.results) != k:
                    whole = CorralError(f"node {node} answered a batch of {k} with {len(reply.results)} results", Code.INTERNAL)
        if whole is not None:
            logs.kv(log, logging.WARNING, "batch share not made", request_id=spec.request_id, node=node, items=k,
                    code=whole.code.value, error=whole.message)
            st.reservations.remove(res)
            if whole.code in (Code.CAPACITY, Code.UNAVAILABLE):
                self.refused.add(node)
                for i, _ in chunk:
                    self.last[i] = whole
                return chunk
            REJECTIONS.labels(whole.code.value).inc()
            for i, _ in chunk:
                self._resolve(i, whole)
            await self.progress.add(failed=k)
            return []
        assert reply is not None
        alive = {s.hb.node for s in self.b.registry.alive()}
        made = failed = 0
        retry: list[Item] = []
        for (i, sid), r in zip(chunk, reply.results):
            if r.ok and r.sandbox is not None:
                self.b.placements.set(r.sandbox)
                self._resolve(i, r.sandbox)
                made += 1
                continue
            why = r.error or ErrorBody(code="internal", message="node gave no reason")
            err = from_code(why.code, why.message, why.retry_after_s)
            if err.code == Code.CONFLICT:  # another attempt of this batch made it elsewhere
                # made, that is: not a claim whose sandbox may never come, nor a placement its lost
                # node left (deleted soon; the item is planned again then)
                info = await self.b.placements.lookup(sid)
                if info is not None and info.state in ("running", "paused") and info.node in alive:
                    self._resolve(i, info)
                    made += 1
                    continue
                if info is not None and info.node in self.b.registry.declared_lost:
                    # left by its lost node (the lost loop's delete did not land yet): the next
                    # round makes the item here or elsewhere
                    with contextlib.suppress(Exception):  # the lost loop deletes it again within a second
                        await self.b.placements.delete_lost(sid, info.node)
            if err.code in (Code.CAPACITY, Code.UNAVAILABLE, Code.CONFLICT):
                if err.code == Code.CAPACITY:
                    self.refused.add(node)
                self.last[i] = err
                retry.append((i, sid))
                continue
            REJECTIONS.labels(err.code.value).inc()
            self._resolve(i, err)
            failed += 1
        res.n, res.cpu, res.memory_mb = made, spec.cpu * made, spec.memory_mb * made
        st.settle(res, reply.counted_at if reply.counted_at is not None else time.time())
        if made:
            PLACEMENTS.labels(node).inc(made)
        await self.progress.add(placed=made, failed=failed)
        logs.kv(log, logging.INFO, "batch share answered", request_id=spec.request_id, node=node, items=k, made=made,
                failed=failed, again=len(retry))
        return retry
