import time

from corral_common.contract.messages import Heartbeat, NodeCapacity, NodeUsage, SandboxSpec
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


def test_a_reservation_is_settled_by_the_nodes_clock_not_the_schedulers():
    """The node counts a sandbox from `counted_at` (its clock); a heartbeat taken after that which
    arrived before the answer already counts it, so settling drops the reservation at once; one
    taken before does not, so the reservation stays until a heartbeat taken after it. (Settled by
    the scheduler's clock at the answer, the first case counted the sandbox twice.)"""
    r = Registry()
    t = 1_000_000.0
    r.heartbeat(hb("a", mem=1000, ts=t))
    st = r.nodes["a"]
    early, late = Reservation(cpu=0, memory_mb=300), Reservation(cpu=0, memory_mb=300)
    st.reservations += [early, late]
    r.heartbeat(hb("a", mem=1000, used_mem=300, ts=t + 2))  # counts `early`, made at t + 1; its answer is still on the way
    assert st.free()[1] == 100  # in flight: counted by the node and reserved (not knowable before the answer)
    st.settle(early, t + 1)
    assert st.reservations == [late] and st.free()[1] == 400
    st.settle(late, t + 3)  # made after the latest heartbeat: still reserved
    assert st.reservations == [late] and st.free()[1] == 400
    r.heartbeat(hb("a", mem=1000, used_mem=600, ts=t + 3))
    assert st.reservations == [] and st.free()[1] == 400


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


def test_batch_plan_spreads_by_free_share_within_each_nodes_room():
    from corral_scheduler.batch import plan
    from corral_scheduler.registry import Policy

    r = Registry()
    r.heartbeat(hb("empty", mem=1000))
    r.heartbeat(hb("half", mem=1000, used_mem=500))
    r.heartbeat(hb("docker", mem=1000, substrates=("docker",)))
    got = {st.hb.node: k for st, k in plan(r.alive(), SandboxSpec(memory_mb=100, cpu=0.1), 6, Policy())}
    # water-filling: the empty node until it is as full as the other, then both evenly; nothing on
    # a node without the substrate
    assert got in ({"empty": 6}, {"empty": 5, "half": 1})
    got = {st.hb.node: k for st, k in plan(r.alive(), SandboxSpec(memory_mb=100, cpu=0.1), 9, Policy())}
    assert got == {"empty": 7, "half": 2}
    got = {st.hb.node: k for st, k in plan(r.alive(), SandboxSpec(memory_mb=100, cpu=0.1), 100, Policy())}
    assert got == {"empty": 10, "half": 5}  # capped by each node's room; the caller fails the rest


def test_batch_plan_pack_fills_the_fullest_first_and_skips_hot_nodes():
    from corral_scheduler.batch import plan, slots
    from corral_scheduler.registry import Policy

    r = Registry()
    r.heartbeat(hb("empty", mem=1000))
    r.heartbeat(hb("half", mem=1000, used_mem=500))
    hot = hb("hot", mem=1000)
    hot.usage.cpu = 15.9
    r.heartbeat(hot)
    spec = SandboxSpec(memory_mb=100, cpu=0.1, placement="pack")
    assert slots(r.nodes["hot"], spec, Policy()) == 0
    got = [(st.hb.node, k) for st, k in plan(r.alive(), spec, 7, Policy())]
    assert got == [("half", 5), ("empty", 2)]
    r.nodes["half"].reservations.append(Reservation(cpu=0.3, memory_mb=300, n=3))
    assert slots(r.nodes["half"], spec, Policy()) == 2  # a batch's reservation counts all its sandboxes


def test_batch_reply_fits_the_payload_limit():
    import json

    from corral_common.contract.messages import SandboxInfo
    from corral_common.contract.replies import BatchFailure
    from corral_scheduler.batch import reply

    made = [SandboxInfo(id=f"sb-{i:012x}", node="n1", state="running", substrate="container", image="busybox", created_at=1.0,
                        expires_at=2.0, job="j", labels={"k": "v" * 50}) for i in range(1000)]
    failed = [BatchFailure(index=1000 + i, code="capacity", message="full") for i in range(10)]
    whole = json.loads(reply("b1", made, failed, limit=10_000_000))
    assert len(whole["sandboxes"]) == 1000 and whole["truncated"] == 0
    cut = reply("b1", made, failed, limit=50_000)
    r = json.loads(cut)
    assert len(cut) <= 50_000 and r["ok"] is True
    assert r["failed"] == [{"index": f.index, "code": f.code, "message": f.message} for f in failed]
    assert 0 < len(r["sandboxes"]) < 1000 and r["truncated"] == 1000 - len(r["sandboxes"])
    assert [s["id"] for s in r["sandboxes"]] == [m.id for m in made[: len(r["sandboxes"])]]


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
