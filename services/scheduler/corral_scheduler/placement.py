"""Choosing nodes for a request: filter by substrate, free room and heat, then order by policy
(spread: the emptiest node first; pack: the fullest node that still fits, to keep others free),
nodes holding a warm-pool sandbox of the image before the others."""
from __future__ import annotations

import random

from corral_common.contract.messages import SandboxSpec

from .registry import NodeState, Policy


def fits(st: NodeState, spec: SandboxSpec, policy: Policy | None = None) -> bool:
    cpu, mem, n = st.free(policy)
    return (spec.substrate in st.hb.substrates and cpu >= spec.cpu - 1e-9 and mem >= spec.memory_mb and n >= 1
            and not st.hot(policy))


def free_share(st: NodeState, policy: Policy | None = None) -> float:
    """The free share of the node's scarcest resource."""
    cpu, mem, n = st.free(policy)
    cap = st.hb.capacity
    return min(cpu / max(st.cpu_ceiling(policy or Policy()), 1e-9), mem / max(cap.memory_mb, 1), n / max(cap.sandboxes, 1))


SAMPLE = 32


def candidates(nodes: list[NodeState], spec: SandboxSpec, policy: Policy | None = None) -> list[NodeState]:
    """With many nodes, rank a random sample of those that fit (power of k choices) instead of
    all of them: placement cost stays flat at a thousand nodes, and concurrent placements do not
    all pile onto the single emptiest node."""
    if len(nodes) > SAMPLE:
        picked: list[NodeState] = []
        start = random.randrange(len(nodes))
        for k in range(len(nodes)):
            st = nodes[(start + k) % len(nodes)]
            if fits(st, spec, policy):
                picked.append(st)
                if len(picked) >= SAMPLE // 4:
                    break
        ok = picked
    else:
        ok = [s for s in nodes if fits(s, spec, policy)]
    spread = spec.placement != "pack"

    def key(s: NodeState) -> tuple[int, float]:
        share = free_share(s, policy)
        return (-has_warm(s, spec), -share if spread else share)

    return sorted(ok, key=key)


def has_warm(st: NodeState, spec: SandboxSpec) -> int:
    """1 if the node has a warm-pool sandbox of the image left for this create (its heartbeat's
    `warm` count, minus creates sent to it since that are not answered yet): a claim answers in
    milliseconds where a build takes ~100 ms, so such nodes come first, under either policy."""
    if spec.substrate != "container":
        return 0
    ready = st.hb.warm.get(spec.image, 0)
    return int(ready > 0 and sum(1 for r in st.reservations if r.done_at is None) < ready)


def describe_room(nodes: list[NodeState], policy: Policy | None = None) -> str:
    if not nodes:
        return "no node-agent is alive"
    hot = [f"{s.hb.node} ({s.hot(policy)})" for s in nodes if s.hot(policy)]
    best = max(nodes, key=lambda s: s.free(policy)[1])
    cpu, mem, n = best.free(policy)
    out = f"{len(nodes)} node(s) alive; most free: {best.hb.node} with {cpu:g} cpu, {mem} MiB, {n} slots"
    if hot:
        out += f"; running hot: {', '.join(hot)}"
    return out
