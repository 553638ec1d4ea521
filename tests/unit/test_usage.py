"""Per-sandbox usage in heartbeats: bounded size, busiest first, and named in pressure reports."""
import time

import msgspec

from corral_common.contract.messages import Heartbeat, NodeCapacity, NodeUsage, SandboxUsage
from corral_scheduler.registry import Registry


def test_heartbeat_with_2000_sandboxes_stays_small():
    rows = [SandboxUsage(id=f"sb-{i:012x}", cpu=0.0012, memory_mb=1.25) for i in range(2000)]
    hb = Heartbeat(node="n", ts=time.time(), capacity=NodeCapacity(cpu=2, memory_mb=20000, sandboxes=4096),
                   usage=NodeUsage(sandboxes=2000, per_sandbox=rows))
    raw = msgspec.json.encode(hb)
    assert len(raw) < 100_000  # even listing all 2,000 (the node lists at most --usage-top)
    assert msgspec.json.decode(raw, type=Heartbeat).usage.per_sandbox[1999].id == rows[1999].id


def test_hot_node_names_its_busiest_sandbox():
    r = Registry()
    usage = NodeUsage(cpu=1.9, per_sandbox=[SandboxUsage(id="sb-a", cpu=0.1, memory_mb=5),
                                            SandboxUsage(id="sb-b", cpu=1.7, memory_mb=3)])
    r.heartbeat(Heartbeat(node="n", ts=time.time(), capacity=NodeCapacity(cpu=2, memory_mb=1000, sandboxes=10), usage=usage))
    why = r.nodes["n"].hot()
    assert "CPU use 1.90" in why and "busiest: sb-b" in why


def test_tracker_lists_the_top_n_and_counts_everything():
    from corral_node_agent.cgroups import Cgroups
    from corral_node_agent.usage import UsageTracker

    t = UsageTracker(top=1)
    host = Cgroups("")  # the root cgroup: real, always busy with something
    groups = {"sb-a": host, "sb-b": host, "pool-c": host}
    t.collect(groups, {"sb-a", "sb-b"})
    sum(range(2_000_000))  # burn some CPU between the samples
    obs = t.collect(groups, {"sb-a", "sb-b"})
    assert len(obs.per_sandbox) == 1 and obs.omitted == 1
    assert obs.per_sandbox[0].id in ("sb-a", "sb-b")
    assert obs.cpu > 0 and obs.memory_bytes >= 3 * host.memory_bytes() // 2
    t.collect({"sb-a": host}, {"sb-a"})
    assert set(t.last) == {"sb-a"}  # samples of gone sandboxes are dropped
