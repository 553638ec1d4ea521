"""A node-agent stand-in that speaks the node protocol on the real bus (heartbeats, create,
create_batch, placements in KV) without running sandboxes: for scheduler tests and scale benchmarks.

Like the real node-agent, a create (single or a batch item) claims its placement key with a KV
create (compare-and-set) before it counts as made, so an id that another node already holds is
answered `conflict` instead of being made twice. `late`, when set up, holds the answer to a single
create (made and claimed already) until it is set: a node whose answer reaches the scheduler after
its timeout."""
from __future__ import annotations

import asyncio
import time

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from corral_common import bus
from corral_common.contract import subjects
from corral_common.contract.envelope import encode, error
from corral_common.contract.messages import (
    ErrorBody,
    Heartbeat,
    NodeCapacity,
    NodeCreate,
    NodeCreateBatch,
    NodeItemResult,
    NodeUsage,
    SandboxInfo,
    encoder,
)
from corral_common.contract.replies import NodeBatchReply, NodeCreateReply

_batch_decoder = msgspec.json.Decoder(NodeCreateBatch)
_create_decoder = msgspec.json.Decoder(NodeCreate)


class SimNode:
    def __init__(self, nc, name: str, cpu: float = 2.0, memory_mb: int = 8192, sandboxes: int = 1000,
                 cpu_overcommit_max: float = 8.0, substrates: tuple[str, ...] = ("container",), write_kv: bool = True):
        self.nc = nc
        self.name = name
        self.capacity = NodeCapacity(cpu=cpu, memory_mb=memory_mb, sandboxes=sandboxes, cpu_overcommit_max=cpu_overcommit_max)
        self.observed_cpu = 0.0
        self.observed_mem = 0
        self.substrates = list(substrates)
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.req_cpu = 0.0
        self.req_mem = 0
        self.write_kv = write_kv
        self.beating = True
        self.tasks: list[asyncio.Task] = []
        self.subs: list = []
        self.kv = None
        self.scatter = None
        self.batches = 0  # create_batch requests served
        self.hold: asyncio.Event | None = None  # when set up: batch requests wait for it before making anything
        self.held = 0  # batch requests that arrived while held
        self.fail_every = 0  # > 0: every n-th batch item this node sees fails with `internal`
        self._seen = 0
        self.conflicts = 0  # creates and batch items refused because another node holds them
        self.late: asyncio.Event | None = None  # when set up: single-create answers wait for it
        self.created = 0  # single creates this node made (claimed)
        self.beat_on_create = False  # a heartbeat (counting the new sandbox) goes out before the create's answer

    async def start(self, interval: float = 0.5) -> SimNode:
        if self.write_kv:
            self.kv = await self.nc.jetstream().key_value(subjects.KV_PLACEMENTS)
        self.subs.append(await self.nc.subscribe(subjects.node_create(self.name), cb=self._on_create))
        self.subs.append(await self.nc.subscribe(subjects.node_create_batch(self.name), cb=self._on_create_batch))
        self.tasks.append(asyncio.create_task(self._beat(interval)))
        await self.heartbeat()
        return self

    def add(self, info: SandboxInfo) -> None:
        """Hold a sandbox (also used by benchmarks to preload live sandboxes)."""
        self.sandboxes[info.id] = info
        self.req_cpu += info.cpu
        self.req_mem += info.memory_mb

    def usage(self) -> NodeUsage:
        return NodeUsage(cpu=self.observed_cpu, memory_mb=self.observed_mem, sandboxes=len(self.sandboxes),
                         requested_cpu=self.req_cpu, requested_memory_mb=self.req_mem)

    async def heartbeat(self, stopping: bool = False) -> None:
        hb = Heartbeat(node=self.name, ts=time.time(), capacity=self.capacity, usage=self.usage(), substrates=self.substrates,
                       stopping=stopping)
        await self.nc.publish(subjects.NODE_HEARTBEAT, encoder.encode(hb))

    async def _beat(self, interval: float) -> None:
        while True:
            if self.beating:
                await self.heartbeat()
            await asyncio.sleep(interval)

    def _full(self, cpu: float, memory_mb: int) -> bool:
        cap = self.capacity
        return (self.req_cpu + cpu > cap.cpu * cap.cpu_overcommit_max + 1e-9 or self.req_mem + memory_mb > cap.memory_mb
                or len(self.sandboxes) >= cap.sandboxes)

    def _info(self, req: NodeCreate, now: float) -> SandboxInfo:
        spec = req.spec
        return SandboxInfo(id=req.sandbox_id, node=self.name, state="running", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=spec.labels, cpu=spec.cpu,
                           memory_mb=spec.memory_mb, request_id=spec.request_id)

    async def _on_create(self, msg) -> None:
        req = _create_decoder.decode(msg.data)
        if req.sandbox_id in self.sandboxes:
            await msg.respond(encode(NodeCreateReply(sandbox=self.sandboxes[req.sandbox_id])))
            return
        if self._full(req.spec.cpu, req.spec.memory_mb):
            await msg.respond(error("capacity", f"sim node {self.name} is full", 1.0))
            return
        info = self._info(req, time.time())
        self.add(info)
        # from here on its heartbeats count it (no await in between, as in the node-agent): taken
        # after the claim's round trip, a heartbeat sent during it counted the sandbox and the
        # scheduler's reservation for it both, and a full node refused a create it had room for
        counted_at = time.time()
        if self.kv is not None:
            (done,) = await self._claim([info])
            if done is not None:
                self._drop(info)
                if isinstance(done, KeyWrongLastSequenceError):
                    self.conflicts += 1
                    await msg.respond(error("conflict", f"sandbox {info.id} is already placed on another node"))
                else:
                    await msg.respond(error("unavailable", f"placement not recorded: {done}"))
                return
        self.created += 1
        if self.beat_on_create:
            await self.heartbeat()
        if self.late is not None:
            await self.late.wait()
        await msg.respond(encode(NodeCreateReply(sandbox=info, counted_at=counted_at)))

    def _drop(self, info: SandboxInfo) -> None:
        self.sandboxes.pop(info.id, None)
        self.req_cpu -= info.cpu
        self.req_mem -= info.memory_mb

    async def _on_create_batch(self, msg) -> None:
        self.batches += 1
        if self.hold is not None and not self.hold.is_set():
            self.held += 1
            await self.hold.wait()
        try:
            req = _batch_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await msg.respond(error("invalid_request", f"invalid request: {e}"))
            return
        now = time.time()
        results: list[NodeItemResult | None] = [None] * len(req.items)
        claims: list[tuple[int, SandboxInfo]] = []
        for k, item in enumerate(req.items):
            have = self.sandboxes.get(item.sandbox_id)
            self._seen += 1
            if have is not None:
                results[k] = NodeItemResult(ok=True, sandbox=have)
            elif item.spec.substrate not in self.substrates:
                results[k] = NodeItemResult(ok=False, error=ErrorBody(code="invalid_request", message=f"substrate {item.spec.substrate!r} is not on {self.name}"))
            elif self.fail_every and self._seen % self.fail_every == 0:
                results[k] = NodeItemResult(ok=False, error=ErrorBody(code="internal", message=f"simulated failure on {self.name}"))
            elif self._full(item.spec.cpu, item.spec.memory_mb):
                results[k] = NodeItemResult(ok=False, error=ErrorBody(code="capacity", message=f"sim node {self.name} is full", retry_after_s=1.0))
            else:
                info = self._info(item, now)
                self.add(info)  # counted at once, so the next item sees it
                claims.append((k, info))
        done = await self._claim([info for _, info in claims]) if self.kv is not None and claims else [None] * len(claims)
        for (k, info), d in zip(claims, done):
            if isinstance(d, BaseException):
                self._drop(info)
                if isinstance(d, KeyWrongLastSequenceError):
                    self.conflicts += 1
                    results[k] = NodeItemResult(ok=False, error=ErrorBody(code="conflict", message=f"sandbox {info.id} is already placed on another node"))
                else:
                    results[k] = NodeItemResult(ok=False, error=ErrorBody(code="unavailable", message=f"placement not recorded: {d}"))
            else:
                results[k] = NodeItemResult(ok=True, sandbox=info)
        await msg.respond(encode(NodeBatchReply(results=results)))

    async def _claim(self, infos: list[SandboxInfo]) -> list[BaseException | None]:
        """KV create (compare-and-set on "no such key") for every placement at once: one pipelined
        publish each, acks gathered on a shared inbox; a refused one is tried once more through
        kv.create, which also takes over a key whose last entry is a delete."""
        if self.scatter is None:
            self.scatter = await bus.Scatter(self.nc).start()
        hdr = {"Nats-Expected-Last-Subject-Sequence": "0"}
        reqs = [(subjects.kv_key(subjects.KV_PLACEMENTS, i.id), encoder.encode(i), hdr) for i in infos]
        out: list[BaseException | None] = [None] * len(infos)
        again = []
        async for k, msg in self.scatter.requests(reqs, timeout=10.0):
            if msg is None or bus.no_responders(msg):
                out[k] = TimeoutError("no ack for the placement")
            elif b'"error"' in msg.data:
                again.append(k)
        for k in again:
            try:
                await self.kv.create(infos[k].id, reqs[k][1])
            except BaseException as e:
                out[k] = e
        return out

    async def stop(self, forget: bool = True) -> None:
        for t in self.tasks:
            t.cancel()
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if self.beating:
            await self.heartbeat(stopping=True)
        if forget and self.kv is not None:
            for sid in list(self.sandboxes):
                try:
                    await self.kv.delete(sid)
                except Exception:
                    pass
