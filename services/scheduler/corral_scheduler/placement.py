"""Choosing nodes for a request: filter by substrate and free room, then order by policy."""
from __future__ import annotations

from corral_common.messages import SandboxSpec

from .registry import NodeState


def fits(st: NodeState, spec: SandboxSpec) -> bool:
    cpu, mem, n = st.free()
    return spec.substrate in st.hb.substrates and cpu >= spec.cpu and mem >= spec.memory_mb and n >= 1


def score(st: NodeState) -> float:
    """Spread: prefer the node with the largest free share of its scarcer resource."""
    cpu, mem, n = st.free()
    cap = st.hb.capacity
    return min(cpu / max(cap.cpu, 1e-9), mem / max(cap.memory_mb, 1), n / max(cap.sandboxes, 1))


def candidates(nodes: list[NodeState], spec: SandboxSpec) -> list[NodeState]:
    return sorted((s for s in nodes if fits(s, spec)), key=score, reverse=True)


def describe_room(nodes: list[NodeState]) -> str:
    if not nodes:
        return "no node-agent is alive"
    best = max(nodes, key=lambda s: s.free()[1])
    cpu, mem, n = best.free()
    return f"{len(nodes)} node(s) alive; most free: {best.hb.node} with {cpu:g} cpu, {mem} MiB, {n} slots"
