"""The node registry, fed by heartbeats: what each node offers, what it reports using, and
what this scheduler has sent it since (so two placements in one heartbeat interval don't both
count the same free room)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from corral_common.messages import Heartbeat


@dataclass
class Reservation:
    cpu: float
    memory_mb: int
    done_at: float | None = None  # when the node answered; dropped once a later heartbeat covers it


@dataclass
class NodeState:
    hb: Heartbeat
    seen: float
    reservations: list[Reservation] = field(default_factory=list)

    def reserved(self) -> tuple[float, int, int]:
        return (
            sum(r.cpu for r in self.reservations),
            sum(r.memory_mb for r in self.reservations),
            len(self.reservations),
        )

    def free(self) -> tuple[float, int, int]:
        rc, rm, rn = self.reserved()
        cap, use = self.hb.capacity, self.hb.usage
        return (
            cap.cpu - use.requested_cpu - rc,
            cap.memory_mb - use.requested_memory_mb - rm,
            cap.sandboxes - use.sandboxes - rn,
        )


class Registry:
    def __init__(self, stale_after_s: float = 5.0):
        self.nodes: dict[str, NodeState] = {}
        self.stale_after_s = stale_after_s

    def heartbeat(self, hb: Heartbeat) -> None:
        st = self.nodes.get(hb.node)
        if st is None:
            self.nodes[hb.node] = NodeState(hb=hb, seen=time.monotonic())
            return
        st.hb = hb
        st.seen = time.monotonic()
        # reservations answered before this heartbeat was taken are now in its usage
        st.reservations = [r for r in st.reservations if r.done_at is None or r.done_at > hb.ts]

    def alive(self) -> list[NodeState]:
        now = time.monotonic()
        return [s for s in self.nodes.values() if not s.hb.stopping and now - s.seen <= self.stale_after_s]

    def substrates(self) -> set[str]:
        out: set[str] = set()
        for s in self.alive():
            out.update(s.hb.substrates)
        return out
