"""Warm-pool sizing: configured floors, pools learned from the create rate, capped per image and
per node, and back to the floor once demand stops."""
from collections import deque

import pytest

from corral_node_agent.substrates.container import ContainerSubstrate
from corral_node_agent.warmpool import PoolConfig, WarmPool, parse_pools


def pool(**kw) -> WarmPool:
    async def exists(image: str) -> bool:
        return True

    sub = ContainerSubstrate("n", "/nonexistent", None)  # type: ignore[arg-type]  # (sizing only: nothing is built or read)
    return WarmPool(sub, "n", PoolConfig(**kw), lambda wid: None, lambda: True, exists)


def test_parse_pools():
    assert parse_pools(["busybox=4", "debian", "microvm:busybox=2"]) == {"busybox": 4, "debian": 1, "microvm:busybox": 2}
    for bad in ("busybox=x", "=3", "busybox=-1", "teleport:busybox=1", "microvm:=1"):
        with pytest.raises(ValueError, match="IMAGE=COUNT"):
            parse_pools([bad])


def test_configured_floor_without_learning():
    p = pool(configured={"busybox": 3})
    p.demand["busybox"] = deque([0.0] * 50)
    assert p.target("busybox", 1.0) == 3 and p.target("debian", 1.0) == 0


def test_learned_from_rate_capped_and_trimmed_when_idle():
    p = pool(learn=True, learn_min=3, window_s=60, idle_s=10, max_per_image=4, max_total=5)
    p.build_s = 0.1
    p.demand["debian"] = deque([100.0, 100.5])
    assert p.target("debian", 101.0) == 0  # two creates: not hot yet
    p.demand["debian"].append(101.0)
    assert p.target("debian", 101.0) == 2  # 3 creates over 1 s: ceil(3/s * 0.1 s * 2) + 1
    p.demand["debian"] = deque([100.0 + i * 0.01 for i in range(100)])
    assert p.target("debian", 101.0) == 4  # a burst: the per-image cap
    p.demand["busybox"] = deque([100.0 + i * 0.02 for i in range(50)])
    t = p._targets(101.0)
    assert sum(t.values()) == 5 and t["debian"] == 4  # the node cap; the busiest image first
    assert p.target("debian", 111.5) == 0  # idle for longer than idle_s
