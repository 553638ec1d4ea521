"""The node registry, fed by heartbeats: what each node offers, what it reports using, and
what this scheduler has sent it since (so two placements in one heartbeat interval don't both
count the same free room)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from corral_common.contract.messages import Heartbeat


@dataclass
class Reservation:
    cpu: float
    memory_mb: int
    n: int = 1  # sandboxes (a batch sent to one node reserves them all at once)
    # when the node started counting what it made, on the node's clock (its heartbeats' `ts` are
    # on that clock too): dropped once a heartbeat taken at or after it is in
    done_at: float | None = None


@dataclass
class Policy:
    """How far to trust requests vs observed use.

    CPU: requests may add up to `cpu_overcommit` x the node's cores (never beyond the node's own
    maximum), as long as the CPU the node actually uses stays under `hot_cpu` of its cores.
    Memory: requests are honoured as hard limits (no overcommit) and the observed use must leave
    `memory_headroom` of the node free."""

    cpu_overcommit: float = 8.0
    hot_cpu: float = 0.85
    memory_headroom: float = 0.05


@dataclass
class NodeState:
    hb: Heartbeat
    seen: float
    reservations: list[Reservation] = field(default_factory=list)
    interval: float = 1.0  # the node's heartbeat interval, as observed (smoothed)

    def settle(self, res: Reservation, counted_at: float) -> None:
        """The node answered for `res`: it counts what it made in every heartbeat taken from
        `counted_at` (node clock) on. If the latest heartbeat is one of those (it overtook the
        answer), it already counts them and the reservation goes now; otherwise the first such
        heartbeat drops it. (The scheduler's own clock at the answer, used before, is later than
        `counted_at` by the answer's transit, and on another machine than the node's: every
        heartbeat in between counted the sandbox twice, which refused creates a node had room for.)"""
        res.done_at = counted_at
        if counted_at <= self.hb.ts and res in self.reservations:
            self.reservations.remove(res)

    def reserved(self) -> tuple[float, int, int]:
        return (
            sum(r.cpu for r in self.reservations),
            sum(r.memory_mb for r in self.reservations),
            sum(r.n for r in self.reservations),
        )

    def cpu_ceiling(self, policy: Policy) -> float:
        cap = self.hb.capacity
        return cap.cpu * min(policy.cpu_overcommit, max(1.0, cap.cpu_overcommit_max))

    def free(self, policy: Policy | None = None) -> tuple[float, int, int]:
        """Room for new requests: (cpu, memory MiB, sandboxes)."""
        policy = policy or Policy()
        rc, rm, rn = self.reserved()
        cap, use = self.hb.capacity, self.hb.usage
        return (
            self.cpu_ceiling(policy) - use.requested_cpu - rc,
            cap.memory_mb - use.requested_memory_mb - rm,
            cap.sandboxes - use.sandboxes - rn,
        )

    def hot(self, policy: Policy | None = None) -> str:
        """Why this node must not take more work right now ("" if it may)."""
        policy = policy or Policy()
        cap, use = self.hb.capacity, self.hb.usage
        if use.cpu > cap.cpu * policy.hot_cpu:
            return f"CPU use {use.cpu:.2f} of {cap.cpu:g} cores{self._busiest('cpu')}"
        if use.memory_mb > cap.memory_mb * (1 - policy.memory_headroom):
            return f"memory use {use.memory_mb} of {cap.memory_mb} MiB{self._busiest('memory_mb')}"
        return ""

    def _busiest(self, field: str) -> str:
        """Name the sandbox using most of `field` (heartbeats list sandboxes one by one), so a
        pressure report says who makes the node hot."""
        rows = self.hb.usage.per_sandbox
        if not rows:
            return ""
        top = max(rows, key=lambda r: getattr(r, field))
        unit = "cores" if field == "cpu" else "MiB"
        return f"; busiest: {top.id} ({getattr(top, field):g} {unit})"


class Registry:
    def __init__(self, stale_after_s: float = 5.0):
        self.nodes: dict[str, NodeState] = {}
        self.stale_after_s = stale_after_s
        # nodes this replica declared lost (their placements deleted), until they heartbeat again:
        # a request still waiting on one stops waiting (nodes.py sets it)
        self.declared_lost: set[str] = set()
        self._alive: list[NodeState] = []
        self._alive_at = 0.0

    def heartbeat(self, hb: Heartbeat) -> None:
        st = self.nodes.get(hb.node)
        if st is None:
            self.nodes[hb.node] = NodeState(hb=hb, seen=time.monotonic())
            self._alive_at = 0.0
            return
        if hb.stopping != st.hb.stopping:
            self._alive_at = 0.0
        now = time.monotonic()
        gap = min(max(now - st.seen, 0.01), self.stale_after_s)
        st.interval = 0.8 * st.interval + 0.2 * gap
        st.hb = hb
        st.seen = now
        # reservations answered before this heartbeat was taken are now in its usage
        st.reservations = [r for r in st.reservations if r.done_at is None or r.done_at > hb.ts]

    def alive(self) -> list[NodeState]:
        """Nodes heard from recently and not stopping (recomputed at most every 0.2 s: with a
        thousand nodes this runs on every placement)."""
        now = time.monotonic()
        if now - self._alive_at > 0.2:
            self._alive = [s for s in self.nodes.values() if not s.hb.stopping and now - s.seen <= self.stale_after_s]
            self._alive_at = now
        return self._alive

    def is_alive(self, node: str) -> bool:
        """Whether `node` was heard from recently and is not stopping, as of now (not cached:
        for deciding whether a node can still answer for itself)."""
        st = self.nodes.get(node)
        return st is not None and not st.hb.stopping and time.monotonic() - st.seen <= self.stale_after_s

    def recent(self, node: str) -> bool:
        """Heard from within the stale limit, stopping or not."""
        st = self.nodes.get(node)
        return st is not None and time.monotonic() - st.seen <= self.stale_after_s

    def interval(self, node: str) -> float:
        st = self.nodes.get(node)
        return st.interval if st is not None else 1.0

    def substrates(self) -> set[str]:
        out: set[str] = set()
        for s in self.alive():
            out.update(s.hb.substrates)
        return out
