"""A node-agent stand-in that speaks the node protocol on the real bus (heartbeats, create,
placements in KV) without running sandboxes: for scheduler tests and scale benchmarks."""
from __future__ import annotations

import asyncio
import time

import msgspec

from corral_common import subjects
from corral_common.messages import (
    Heartbeat, NodeCapacity, NodeCreate, NodeUsage, SandboxInfo, encoder, error, ok,
)


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
        self.write_kv = write_kv
        self.beating = True
        self.tasks: list[asyncio.Task] = []
        self.sub = None
        self.kv = None

    async def start(self, interval: float = 0.5) -> SimNode:
        if self.write_kv:
            self.kv = await self.nc.jetstream().key_value(subjects.KV_PLACEMENTS)
        self.sub = await self.nc.subscribe(subjects.node_create(self.name), cb=self._on_create)
        self.tasks.append(asyncio.create_task(self._beat(interval)))
        await self.heartbeat()
        return self

    def usage(self) -> NodeUsage:
        return NodeUsage(cpu=self.observed_cpu, memory_mb=self.observed_mem, sandboxes=len(self.sandboxes),
                         requested_cpu=sum(i.cpu for i in self.sandboxes.values()),
                         requested_memory_mb=sum(i.memory_mb for i in self.sandboxes.values()))

    async def heartbeat(self, stopping: bool = False) -> None:
        hb = Heartbeat(node=self.name, ts=time.time(), capacity=self.capacity, usage=self.usage(), substrates=self.substrates,
                       stopping=stopping)
        await self.nc.publish(subjects.NODE_HEARTBEAT, encoder.encode(hb))

    async def _beat(self, interval: float) -> None:
        while True:
            if self.beating:
                await self.heartbeat()
            await asyncio.sleep(interval)

    async def _on_create(self, msg) -> None:
        req = msgspec.json.decode(msg.data, type=NodeCreate)
        spec = req.spec
        u = self.usage()
        if (u.requested_cpu + spec.cpu > self.capacity.cpu * self.capacity.cpu_overcommit_max + 1e-9
                or u.requested_memory_mb + spec.memory_mb > self.capacity.memory_mb or u.sandboxes >= self.capacity.sandboxes):
            await msg.respond(error("capacity", f"sim node {self.name} is full", 1.0))
            return
        now = time.time()
        info = SandboxInfo(id=req.sandbox_id, node=self.name, state="running", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=spec.labels, cpu=spec.cpu,
                           memory_mb=spec.memory_mb, request_id=spec.request_id)
        self.sandboxes[info.id] = info
        if self.kv is not None:
            await self.kv.put(info.id, encoder.encode(info))
        await msg.respond(ok(sandbox=info))

    async def stop(self, forget: bool = True) -> None:
        for t in self.tasks:
            t.cancel()
        if self.sub is not None:
            await self.sub.unsubscribe()
        if self.beating:
            await self.heartbeat(stopping=True)
        if forget and self.kv is not None:
            for sid in list(self.sandboxes):
                try:
                    await self.kv.delete(sid)
                except Exception:
                    pass
