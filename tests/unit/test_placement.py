import time

from corral_common.messages import Heartbeat, NodeCapacity, NodeUsage, SandboxSpec
from corral_scheduler import placement
from corral_scheduler.registry import Registry, Reservation


def hb(node, cpu=16.0, mem=1000, used_cpu=0.0, used_mem=0, n=0, substrates=("container",), ts=None):
    return Heartbeat(node=node, ts=ts or time.time(), capacity=NodeCapacity(cpu=cpu, memory_mb=mem, sandboxes=100),
                     usage=NodeUsage(requested_cpu=used_cpu, requested_memory_mb=used_mem, sandboxes=n), substrates=list(substrates))


def test_spreads_to_the_emptier_node():
    r = Registry()
    r.heartbeat(hb("a", used_mem=800))
    r.heartbeat(hb("b", used_mem=100))
    c = placement.candidates(r.alive(), SandboxSpec(memory_mb=100))
    assert [s.hb.node for s in c] == ["b", "a"]


def test_filters_by_room_and_substrate():
    r = Registry()
    r.heartbeat(hb("full", used_mem=950))
    r.heartbeat(hb("docker-only", substrates=("docker",)))
    assert placement.candidates(r.alive(), SandboxSpec(memory_mb=100)) == []


def test_reservations_count_until_a_later_heartbeat_covers_them():
    r = Registry()
    r.heartbeat(hb("a", mem=1000))
    st = r.nodes["a"]
    st.reservations.append(Reservation(cpu=1, memory_mb=600, done_at=time.time()))
    assert not placement.fits(st, SandboxSpec(memory_mb=600))
    r.heartbeat(hb("a", mem=1000, used_mem=600, ts=time.time() + 1))
    assert st.reservations == []
    assert st.free()[1] == 400


def test_stale_and_stopping_nodes_are_not_alive():
    r = Registry(stale_after_s=0.01)
    r.heartbeat(hb("a"))
    time.sleep(0.02)
    assert r.alive() == []
    r2 = Registry()
    h = hb("b")
    h.stopping = True
    r2.heartbeat(h)
    assert r2.alive() == []


def test_nodes_with_a_warm_sandbox_of_the_image_come_first():
    r = Registry()
    r.heartbeat(hb("empty", used_mem=0))
    warm = hb("warm", used_mem=500)
    warm.warm = {"busybox": 1}
    r.heartbeat(warm)
    for policy in ("spread", "pack"):
        c = placement.candidates(r.alive(), SandboxSpec(memory_mb=100, placement=policy))
        assert [s.hb.node for s in c][0] == "warm"
    assert [s.hb.node for s in placement.candidates(r.alive(), SandboxSpec(image="debian", memory_mb=100))] == ["empty", "warm"]
    # one create in flight already takes the one warm sandbox: back to plain spread
    r.nodes["warm"].reservations.append(Reservation(cpu=1, memory_mb=100))
    assert [s.hb.node for s in placement.candidates(r.alive(), SandboxSpec(memory_mb=100))] == ["empty", "warm"]
