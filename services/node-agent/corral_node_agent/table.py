"""The node's sandbox table: which sandboxes live here, on which substrate, and admission.

Admission counts what is live, what is being created and the one-shot runs in flight against
the node's capacity. Each check and its booking happen with no await in between, so concurrent
creates each see the ones accepted before them (six concurrent creates onto room for two make
two)."""
from __future__ import annotations

import os
from collections.abc import Iterator

from corral_common import egress, metrics
from corral_common.contract.errors import Capacity, InvalidRequest, NotFound, Unavailable
from corral_common.contract.messages import NodeCapacity, SandboxSpec

from .substrates import Substrate
from .substrates.base import Sandbox

SANDBOXES = metrics.gauge("corral_sandboxes", "Live sandboxes on this node", ("node", "substrate"))


def mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def node_capacity(cpu: float, memory_mb: int, max_sandboxes: int, cpu_overcommit: float) -> NodeCapacity:
    """What the node offers: the configured numbers, or the machine's cores and 90% of its memory."""
    return NodeCapacity(cpu=cpu or float(os.cpu_count() or 1), memory_mb=memory_mb or int(mem_total_mb() * 0.9),
                        sandboxes=max_sandboxes, cpu_overcommit_max=cpu_overcommit)


class SandboxTable:
    def __init__(self, node: str, capacity: NodeCapacity):
        self.node = node
        self.capacity = capacity
        self.substrates: dict[str, Substrate] = {}  # the node's substrates, by name
        self.sandboxes: dict[str, Sandbox] = {}
        self.substrate_of: dict[str, Substrate] = {}
        self.destroying: set[str] = set()
        # creates accepted and not finished: they count against the node's room like its sandboxes
        self.creating: dict[str, SandboxSpec] = {}
        self.runs: dict[object, SandboxSpec] = {}  # one-shot runs in flight
        self.accepting = True  # False once the agent is stopping: no new creates or runs

    # ------------------------------------------------------------------ lookups

    def live(self, sid: str) -> tuple[Sandbox, Substrate]:
        """The sandbox and its substrate, unless it is gone or going."""
        sb = self.sandboxes.get(sid)
        if sb is None or sid in self.destroying:
            raise NotFound(f"sandbox {sid} is being destroyed or no longer exists")
        return sb, self.substrate_of[sid]

    def is_live(self, sid: str) -> bool:
        return sid in self.sandboxes and sid not in self.destroying

    def live_items(self) -> Iterator[tuple[Sandbox, Substrate]]:
        """A snapshot of the live sandboxes with their substrates (safe to await while iterating)."""
        for sid, sb in list(self.sandboxes.items()):
            sub = self.substrate_of.get(sid)
            if sub is not None and sid not in self.destroying:
                yield sb, sub

    def add(self, sb: Sandbox, sub: Substrate) -> None:
        self.sandboxes[sb.id] = sb
        self.substrate_of[sb.id] = sub
        self._count(sub)

    def remove(self, sid: str) -> None:
        self.sandboxes.pop(sid, None)
        sub = self.substrate_of.pop(sid, None)
        self.destroying.discard(sid)
        if sub is not None:
            self._count(sub)

    def _count(self, sub: Substrate) -> None:
        SANDBOXES.labels(self.node, sub.name).set(sum(1 for s in self.substrate_of.values() if s is sub))

    # ------------------------------------------------------------------ admission

    def requested(self, creating: bool = True) -> tuple[float, int]:
        """CPU and memory requested by the node's sandboxes and (with `creating`) the creates it
        has accepted."""
        pending = self.creating.values() if creating else ()
        cpu = sum(sb.spec.cpu for sb in self.sandboxes.values()) + sum(s.cpu for s in pending)
        mem = sum(sb.spec.memory_mb for sb in self.sandboxes.values()) + sum(s.memory_mb for s in pending)
        return cpu, mem

    def held(self, creating: bool = True) -> int:
        return len(self.sandboxes) + (len(self.creating) if creating else 0)

    def substrate_for(self, spec: SandboxSpec, one_shot: bool = False) -> Substrate:
        """The substrate a create or run asks for, if the node is accepting and has it, and can
        keep the spec's promises: protected paths and canaries are refused where they would not
        be enforced (a one-shot run, a substrate without a host-visible root), never ignored."""
        if not self.accepting:
            raise Unavailable(f"node {self.node} is shutting down", retry_after_s=1)
        sub = self.substrates.get(spec.substrate)
        if sub is None:
            raise InvalidRequest(f"substrate {spec.substrate!r} is not available on node {self.node}; available: {', '.join(self.substrates)}")
        if spec.protected_paths or spec.canaries:
            what = "protected_paths and canaries" if spec.protected_paths and spec.canaries else (
                "protected_paths" if spec.protected_paths else "canaries")
            if one_shot:
                raise InvalidRequest(f"{what} are not enforced on a one-shot run; create a sandbox for them")
            if not sub.protects_paths:
                raise InvalidRequest(f"{what} are not enforced on the {sub.name!r} substrate; use 'container'")
        egress.check(spec.network, spec.egress)
        if spec.network != "none" and (one_shot or sub.name != "container"):
            raise InvalidRequest('network="allowlist" is enforced for sandboxes of the container substrate only')
        return sub

    def admit_create(self, sid: str, spec: SandboxSpec) -> None:
        """Book room for a create (released by `created` or `done_creating`), or raise Capacity."""
        if sid in self.creating:
            raise Unavailable(f"sandbox {sid} is already being created on node {self.node}", retry_after_s=0.5)
        cpu, mem = self.requested()
        n = self.held()
        cpu_cap = self.capacity.cpu * self.capacity.cpu_overcommit_max
        if n >= self.capacity.sandboxes or cpu + spec.cpu > cpu_cap + 1e-9 or mem + spec.memory_mb > self.capacity.memory_mb:
            raise Capacity(f"node {self.node} is full ({len(self.sandboxes)} sandboxes and {len(self.creating)} being created, "
                           f"{cpu:g}/{cpu_cap:g} cpu, {mem}/{self.capacity.memory_mb} MiB requested)", retry_after_s=1)
        self.creating[sid] = spec

    def done_creating(self, sid: str) -> None:
        self.creating.pop(sid, None)

    def admit_run(self, token: object, spec: SandboxSpec) -> None:
        """Book room for a one-shot run (released by `done_running`), or raise Capacity."""
        cpu, mem = self.requested()
        cpu += sum(s.cpu for s in self.runs.values())
        mem += sum(s.memory_mb for s in self.runs.values())
        n = self.held() + len(self.runs)
        cpu_cap = self.capacity.cpu * self.capacity.cpu_overcommit_max
        if n >= self.capacity.sandboxes or cpu + spec.cpu > cpu_cap + 1e-9 or mem + spec.memory_mb > self.capacity.memory_mb:
            raise Capacity(f"node {self.node} is full ({n} sandboxes and calls, {cpu:g}/{cpu_cap:g} cpu, "
                           f"{mem}/{self.capacity.memory_mb} MiB requested)", retry_after_s=0.2)
        self.runs[token] = spec

    def done_running(self, token: object) -> None:
        self.runs.pop(token, None)
