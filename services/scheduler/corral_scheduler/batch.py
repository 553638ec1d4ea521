"""create_batch at scale: plan a whole batch at once, one request per node, progress on the bus.

Placing item by item costs a node choice, a node round trip and a reply per sandbox; a batch of
thousands spends its time in that overhead. Here the batch is planned in one pass (how many items
each node takes, by the request's pack/spread policy), each node gets its items in one
`corral.node.<node>.create_batch` request, and items a node refuses are planned again elsewhere.

Idempotency without a KV write per item: with a request_id, item i's sandbox id is derived from it
(`item_id`), and a node claims the placement key with a KV create before it counts an item as made,
so a retried or concurrently repeated batch finds what earlier attempts made and no item is ever
made on two nodes. One small record per batch (`BatchRecord`, written at the end) tells a later
retry which items were made, so a sandbox destroyed since is reported as gone, not made again."""
from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import time

import msgspec

from corral_common.contract import subjects
from corral_common.contract.messages import BatchProgress, SandboxInfo, SandboxSpec, encoder, ok

from .registry import NodeState, Policy

NODE_BATCH_MAX = 256  # items per node request: bounds its size and its time on a real node
SPREAD_QUANTUM = 0.01  # spread hands out items in steps of this share of a node's room


def item_id(request_id: str, index: int) -> str:
    """The sandbox id of item `index` of the batch with this request_id (same on every retry)."""
    return "sb-" + hashlib.blake2b(f"{request_id}#{index}".encode(), digest_size=6).hexdigest()


def record_key(request_id: str) -> str:
    return "b" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def default_batch_id(request_id: str) -> str:
    return "b" + hashlib.sha256(request_id.encode()).hexdigest()[:20]


class BatchRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What an attempt of a batch left (in `corral_requests`): its size, the digest of its spec
    and, once it is done, the items it could not make (every other item was made). An attempt
    writes it when it starts (`done: false`, so a concurrent or later attempt with another spec or
    count is refused) and again when it ends."""

    count: int
    failed: list[int] = []
    digest: str = ""  # spec_digest of the batch's spec ("" in records written before digests)
    done: bool = True


def spec_digest(spec: SandboxSpec) -> str:
    """A digest of what a batch asks for, independent of how the request spelt it (key order,
    defaults given or left out)."""
    body = json.dumps(msgspec.to_builtins(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def describe(spec: SandboxSpec) -> str:
    b = msgspec.to_builtins(spec)
    b.pop("request_id", None)
    return json.dumps(b, sort_keys=True)[:300]


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
        from .placement import free_share

        room.sort(key=lambda p: free_share(p[0], policy))
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


def reply(batch_id: str, made: list[SandboxInfo], failed: list[dict], limit: int) -> bytes:
    """The create_batch reply, cut to the bus's payload limit: a reply that does not fit is never
    delivered, so when every SandboxInfo does not fit (tens of thousands of sandboxes with long
    labels), the reply keeps every failure and as many sandboxes as fit, and says how many it left
    out (`truncated`); those are listed by `corral.v1.sandbox.list` (by job or labels)."""
    body = ok(batch_id=batch_id, sandboxes=made, failed=failed)
    if len(body) <= limit or not made:
        return body
    per = (len(body) - len(ok(batch_id=batch_id, sandboxes=[], failed=failed))) / len(made)
    n = max(0, int((limit - (len(body) - per * len(made)) - 64) / per))
    while n > 0:
        body = ok(batch_id=batch_id, sandboxes=made[:n], failed=failed, truncated=len(made) - n)
        if len(body) <= limit:
            return body
        n = int(n * 0.95)
    return ok(batch_id=batch_id, sandboxes=[], failed=failed[: max(0, limit // 200)], truncated=len(made))


class Progress:
    """Publishes `corral.events.batch.<id>.progress` every `every` items or `interval_s` seconds
    (whichever comes first, only when something changed) and `.done` once at the end."""

    def __init__(self, nc, batch_id: str, total: int, job: str = "", request_id: str = "",
                 every: int | None = None, interval_s: float = 1.0):
        self.nc = nc
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
        self._ticker: asyncio.Task | None = None
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
        try:
            await self.nc.publish(subjects.batch_event(self.batch_id, kind), encoder.encode(ev))
        except Exception:
            pass  # progress is advisory: never fail a batch over it

    async def done(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        await self._publish("done")
