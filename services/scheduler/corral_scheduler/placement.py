"""Choosing nodes for a request: filter by substrate, free room and heat, then order by policy
(spread: the emptiest node first; pack: the fullest node that still fits, to keep others free),
nodes holding a warm-pool sandbox of the image before the others."""
from __future__ import annotations

import random
from collections.abc import Iterator

from corral_common import egress
from corral_common.contract import subjects
from corral_common.contract.errors import Capacity, CorralError, InvalidRequest
from corral_common.contract.messages import SandboxSpec

from .counters import REJECTIONS
from .registry import NodeState, Policy, Registry, Reservation

ONE_SHOT_SUBSTRATES = {"function"}


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
    milliseconds where a build takes ~100 ms (a guest's boot, seconds), so such nodes come first,
    under either policy. Heartbeats key a container's pool by image, another substrate's as
    `substrate:image`."""
    if spec.substrate == "function":
        return 0
    ready = st.hb.warm.get(spec.image if spec.substrate == "container" else f"{spec.substrate}:{spec.image}", 0)
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


def check_substrate(registry: Registry, spec: SandboxSpec, one_shot: bool = False) -> None:
    """Refuse, with what to use instead, a substrate no node offers or one this request cannot use."""
    if spec.fork_of and one_shot:
        raise InvalidRequest(f"fork_of is for {subjects.SANDBOX_CREATE} and {subjects.SANDBOX_CREATE_BATCH}: "
                             "a one-shot run cannot fork a sandbox")
    if spec.substrate in ONE_SHOT_SUBSTRATES and not one_shot:
        raise InvalidRequest(f"substrate {spec.substrate!r} is one-shot: send {{\"spec\", \"exec\"}} to {subjects.SANDBOX_RUN} "
                             f"(SDK client.run / client.call); for a sandbox that stays use 'container' or 'docker'")
    have = registry.substrates()
    if have and spec.substrate not in have:
        raise InvalidRequest(f"no node offers substrate {spec.substrate!r}; available: {', '.join(sorted(have))}")
    egress.check(spec.network, spec.egress)
    if spec.network == "allowlist" and (one_shot or spec.substrate != "container"):
        raise InvalidRequest('network="allowlist" is for sandboxes of the container substrate (create one); '
                             f"{'one-shot runs' if one_shot else repr(spec.substrate)} keep network \"none\"")


def attempts(alive: list[NodeState], spec: SandboxSpec, policy: Policy) -> Iterator[tuple[NodeState, Reservation]]:
    """The (up to three) best candidate nodes for spec, one at a time, each with a reservation
    held for the attempt (the caller removes it, or keeps it once placed): the room it takes
    counts against the node while the node is asked."""
    for st in candidates(alive, spec, policy)[:3]:
        res = Reservation(cpu=spec.cpu, memory_mb=spec.memory_mb)
        st.reservations.append(res)
        yield st, res


def no_room(what: str, spec: SandboxSpec, alive: list[NodeState], policy: Policy, tried: list[str], last: CorralError | None,
            retry_after_s: float) -> Capacity:
    """The `capacity` answer when no candidate node took the request: what was asked, the room
    there is, and what the nodes tried said."""
    REJECTIONS.labels("capacity").inc()
    detail = f"; tried {', '.join(tried)}: {last.message}" if last else ""
    return Capacity(f"no node has room for {what} with cpu={spec.cpu:g}, memory_mb={spec.memory_mb}, substrate={spec.substrate} "
                    f"({describe_room(alive, policy)}){detail}", retry_after_s=retry_after_s)
