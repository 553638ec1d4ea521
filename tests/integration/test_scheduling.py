"""Scheduling decisions against simulated nodes on the real bus (real scheduler process):
overcommit by observed use, memory guard, pack/spread, quotas, fair share, lost nodes, replicas."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import nats
import pytest

from corral_common.contract import subjects
from corral_common.contract.errors import Capacity
from corral_sdk import AsyncClient

from ..conftest import running_stack
from ..simnode import SimNode


@pytest.fixture(scope="module")
async def sched():
    # a node that does not answer a create within 10 s is given up on (a late-answer test waits that long)
    async with running_stack(nodes=0, scheduler_args=["--node-timeout-s", "10"]) as s:
        yield s


@pytest.fixture
async def bus(sched):
    nc = await nats.connect(sched.url)
    nodes: list[SimNode] = []

    async def node(name: str, **kw) -> SimNode:
        n = await SimNode(nc, f"{name}-{uuid.uuid4().hex[:6]}", **kw).start()
        nodes.append(n)
        await asyncio.sleep(0.2)  # let the scheduler hear its first heartbeat
        return n

    yield nc, node
    for n in nodes:
        await n.stop()
    await nc.close()


async def create(nc, **spec) -> dict:
    body = {"image": "busybox", "cpu": 1.0, "memory_mb": 256, **spec}
    return json.loads((await nc.request(subjects.SANDBOX_CREATE, json.dumps(body).encode(), timeout=30)).data)


async def test_cpu_overcommitted_by_observed_use_until_the_node_runs_hot(bus):
    nc, node = bus
    job = f"oc-{uuid.uuid4().hex[:6]}"
    n = await node("oc", cpu=2.0, memory_mb=100_000, cpu_overcommit_max=8.0)
    # 2 cores, mostly idle sandboxes: requests may add up to 16 cpu
    for _ in range(16):
        r = await create(nc, cpu=1.0, job=job)
        assert r["ok"] and r["sandbox"]["node"] == n.name, r
    r = await create(nc, cpu=1.0, job=job)
    assert r["ok"] is False and r["error"]["code"] == "capacity" and r["error"]["retry_after_s"] > 0
    # a node that actually runs hot takes nothing more, whatever its requests say
    n2 = await node("hot", cpu=2.0, memory_mb=100_000)
    n2.observed_cpu = 1.95
    await n2.heartbeat()
    await asyncio.sleep(0.1)
    r = await create(nc, cpu=0.1, job=job)
    assert r["ok"] is False and "running hot" in r["error"]["message"] and n2.name in r["error"]["message"]
    n2.observed_cpu = 0.2
    await n2.heartbeat()
    await asyncio.sleep(0.1)
    assert (await create(nc, cpu=0.1, job=job))["sandbox"]["node"] == n2.name


async def test_memory_requests_are_hard_limits(bus):
    nc, node = bus
    n = await node("mem", cpu=64.0, memory_mb=1024)
    assert (await create(nc, cpu=0.1, memory_mb=1000))["sandbox"]["node"] == n.name
    r = await create(nc, cpu=0.1, memory_mb=100)
    assert r["ok"] is False and r["error"]["code"] == "capacity" and "memory_mb=100" in r["error"]["message"]


async def test_pack_and_spread(bus):
    nc, node = bus
    a = await node("a", cpu=4.0, memory_mb=4096)
    b = await node("b", cpu=4.0, memory_mb=4096)
    first = (await create(nc, memory_mb=1024))["sandbox"]["node"]
    other = b.name if first == a.name else a.name
    await asyncio.sleep(0.6)  # the next heartbeats carry the new request
    assert (await create(nc, memory_mb=512))["sandbox"]["node"] == other  # spread: the emptier node
    await asyncio.sleep(0.6)
    # pack: the fuller node that still fits
    assert (await create(nc, memory_mb=512, placement="pack"))["sandbox"]["node"] == first


async def test_job_quotas_and_errors(bus):
    nc, node = bus
    await node("q", cpu=64.0, memory_mb=100_000)
    job = f"quota-{uuid.uuid4().hex[:6]}"
    r = json.loads((await nc.request(subjects.QUOTA_SET, json.dumps({"job": job, "sandboxes": 3, "cpu": 10}).encode(), timeout=5)).data)
    assert r["ok"] is True
    for _ in range(3):
        assert (await create(nc, cpu=0.5, memory_mb=64, job=job))["ok"]
    r = await create(nc, cpu=0.5, memory_mb=64, job=job)
    assert r["ok"] is False and r["error"]["code"] == "capacity" and "quota of 3" in r["error"]["message"]
    assert r["error"]["retry_after_s"] > 0
    # another job is unaffected
    assert (await create(nc, cpu=0.5, memory_mb=64, job=job + "-other"))["ok"]
    r = json.loads((await nc.request(subjects.SANDBOX_CREATE_BATCH, json.dumps(
        {"spec": {"cpu": 0.1, "memory_mb": 64, "job": job}, "count": 5}).encode(), timeout=30)).data)
    assert r["ok"] is False and "quota of 3" in r["error"]["message"]
    got = json.loads((await nc.request(subjects.QUOTA_GET, json.dumps({"job": job}).encode(), timeout=5)).data)
    assert got["quota"]["sandboxes"] == 3 and got["used"]["sandboxes"] == 3
    bad = json.loads((await nc.request(subjects.QUOTA_SET, json.dumps({"job": job, "sandboxes": -1}).encode(), timeout=5)).data)
    assert bad["ok"] is False and bad["error"]["code"] == "invalid_request"


async def test_fair_share_under_contention(bus):
    nc, node = bus
    await node("fair", cpu=64.0, memory_mb=10_000)
    greedy, modest = f"greedy-{uuid.uuid4().hex[:6]}", f"modest-{uuid.uuid4().hex[:6]}"
    assert (await create(nc, cpu=0.1, memory_mb=500, job=modest))["ok"]  # both jobs are active
    made = 0
    while True:  # the greedy job takes what it can
        r = await create(nc, cpu=0.1, memory_mb=500, job=greedy)
        if not r["ok"]:
            break
        made += 1
        await asyncio.sleep(0.05)
    # without preemption, fairness acts on admission: once the cluster is contended (<10% free),
    # the job above an equal share is refused, with a retry hint, before the cluster is full
    assert 9 <= made <= 18, made
    assert "fair share" in r["error"]["message"] and r["error"]["retry_after_s"] > 0, r
    # the modest job still gets in while the greedy one holds more than an equal share
    r = await create(nc, cpu=0.1, memory_mb=500, job=modest)
    assert r["ok"], r


async def test_lost_node_is_reported_and_work_goes_elsewhere(bus):
    nc, node = bus
    events = []

    async def on(m):
        events.append((m.subject, json.loads(m.data)))

    await nc.subscribe(subjects.EVENTS_ALL, cb=on)
    dying = await node("dying", cpu=64.0, memory_mb=100_000)
    sid = (await create(nc, memory_mb=64, placement="pack"))["sandbox"]["id"]
    dying.beating = False
    live = await node("live", cpu=64.0, memory_mb=100_000)
    # the node's event follows its sandboxes' events and placement deletes: wait for both
    for _ in range(100):
        if {subjects.event(sid, "lost"), subjects.node_event(dying.name, "lost")} <= {s for s, _ in events}:
            break
        await asyncio.sleep(0.1)
    assert any(s == subjects.node_event(dying.name, "lost") for s, _ in events)
    assert any(s == subjects.event(sid, "lost") for s, _ in events)
    r = json.loads((await nc.request(subjects.sandbox_op(sid, "exec"), b'{"cmd": "true"}', timeout=5)).data)
    assert r["error"]["code"] == "not_found"
    for _ in range(5):
        assert (await create(nc, memory_mb=64))["sandbox"]["node"] == live.name


async def test_not_found_for_a_lost_node_does_not_beat_the_node_answering(bus):
    """A node declared lost that is alive after all (it was paused) answers a call to its sandbox
    itself; the scheduler, which deleted the placement, waits about one heartbeat interval and sees
    the node beating again before it would answer `not_found`, so the node's answer is the one
    the caller gets."""
    nc, node = bus
    events = []

    async def on(m):
        events.append(m.subject)

    await nc.subscribe(subjects.NODE_EVENTS_ALL, cb=on)
    sleeper = await node("sleeper", cpu=64.0, memory_mb=100_000)
    sid = (await create(nc, memory_mb=64, placement="pack"))["sandbox"]["id"]
    assert sid in sleeper.sandboxes
    sleeper.beating = False
    for _ in range(150):
        if subjects.node_event(sleeper.name, "lost") in events:
            break
        await asyncio.sleep(0.1)
    assert subjects.node_event(sleeper.name, "lost") in events

    async def answer(m):  # the woken node: its answer takes a moment (a real exec)
        await asyncio.sleep(0.3)
        await m.respond(json.dumps({"ok": True, "result": {"exit_code": 0, "stdout": "from the node"}}).encode())

    sub = await nc.subscribe(subjects.sandbox_all(sid), cb=answer)
    call = asyncio.ensure_future(nc.request(subjects.sandbox_op(sid, "exec"), b'{"cmd": "true"}', timeout=10))
    await asyncio.sleep(0.05)
    sleeper.beating = True
    await sleeper.heartbeat()
    r = json.loads((await call).data)
    assert r["ok"] and r["result"]["stdout"] == "from the node", r
    await sub.unsubscribe()
    # a node that stays silent: the answer is `not_found`, naming the lost node
    sleeper.beating = False
    for _ in range(150):
        if events.count(subjects.node_event(sleeper.name, "lost")) >= 2:
            break
        await asyncio.sleep(0.1)
    r = json.loads((await nc.request(subjects.sandbox_op(sid, "exec"), b'{"cmd": "true"}', timeout=10)).data)
    assert r["error"]["code"] == "not_found" and sleeper.name in r["error"]["message"], r


async def test_a_directly_answered_create_is_never_called_unknown(bus):
    """A node that answers the client directly (NodeCreate.reply_to) and whose answer to the
    scheduler is slow: the client's next call reaches the scheduler before the placement is
    recorded, and the scheduler waits for it instead of answering `not_found`."""
    nc, node = bus
    n = await node("direct", cpu=64.0, memory_mb=100_000)
    await n.subs.pop(0).unsubscribe()  # its plain create handler; this one answers like a real node
    to_scheduler = asyncio.Event()

    async def on_create(m):
        req = json.loads(m.data)
        now = __import__("time").time()
        info = {"id": req["sandbox_id"], "node": n.name, "state": "running", "substrate": "container", "image": "busybox",
                "created_at": now, "expires_at": now + 600, "cpu": req["spec"].get("cpu", 1.0),
                "memory_mb": req["spec"].get("memory_mb", 256)}
        assert req.get("reply_to")
        await nc.publish(req["reply_to"], json.dumps({"ok": True, "sandbox": info}).encode())
        await to_scheduler.wait()  # the scheduler hears of it only later
        await m.respond(json.dumps({"ok": True, "sandbox": info, "replied": True}).encode())

    n.subs.append(await nc.subscribe(subjects.node_create(n.name), cb=on_create))
    r = await create(nc, memory_mb=64, placement="pack")
    assert r["ok"] and r["sandbox"]["node"] == n.name, r
    sid = r["sandbox"]["id"]

    async def on_exec(m):  # the node's sandbox: its answer takes a moment
        await asyncio.sleep(0.3)
        await m.respond(json.dumps({"ok": True, "result": {"exit_code": 0, "stdout": "from the node"}}).encode())

    sub = await nc.subscribe(subjects.sandbox_all(sid), cb=on_exec)
    call = asyncio.ensure_future(nc.request(subjects.sandbox_op(sid, "exec"), b'{"cmd": "true"}', timeout=10))
    await asyncio.sleep(0.1)  # the race this is about: the call is at the scheduler before the node's answer
    to_scheduler.set()
    r = json.loads((await call).data)
    assert r["ok"] and r["result"]["stdout"] == "from the node", r
    await sub.unsubscribe()
    listed = json.loads((await nc.request(subjects.SANDBOX_LIST, json.dumps({"node": n.name}).encode(), timeout=5)).data)
    assert [s["id"] for s in listed["sandboxes"]] == [sid]


async def test_two_replicas_race_on_the_same_batch(bus, sched):
    nc, node = bus
    await node("race-a", cpu=64.0, memory_mb=100_000)
    await node("race-b", cpu=64.0, memory_mb=100_000)
    replica = subprocess.Popen([sys.executable, "-m", "corral_scheduler", "--nats", sched.url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.sleep(2.0)
        rid = f"race-{uuid.uuid4().hex[:6]}"
        body = json.dumps({"spec": {"cpu": 0.1, "memory_mb": 64, "request_id": rid, "job": rid}, "count": 20}).encode()
        # many retries of the same batch, spread over both replicas by the queue group
        replies = await asyncio.gather(*(nc.request(subjects.SANDBOX_CREATE_BATCH, body, timeout=60) for _ in range(6)))
        ids = [sorted(s["id"] for s in json.loads(r.data)["sandboxes"]) for r in replies]
        assert all(i == ids[0] for i in ids) and len(ids[0]) == 20
        listed = json.loads((await nc.request(subjects.SANDBOX_LIST, json.dumps({"job": rid}).encode(), timeout=5)).data)
        assert len(listed["sandboxes"]) == 20  # nothing placed twice
    finally:
        replica.terminate()
        replica.wait(timeout=30)


async def test_concurrent_creates_do_not_overshoot_a_node():
    """Six creates at once onto a real node-agent with room for two (as several scheduler
    replicas, each with its own view, could send them): the node counts the creates it has
    accepted and not finished, so two are made and four refused with `capacity`; the same for
    the items of a node batch, which are made a few at a time."""
    import secrets

    async with running_stack(nodes=1, monitor=False, env_builder=False, node_args=["--memory-mb", "256"]) as s:
        nc = await nats.connect(s.url)
        try:
            spec = {"image": "busybox", "cpu": 0.1, "memory_mb": 128}
            ids = [f"sb-{secrets.token_hex(6)}" for _ in range(6)]
            replies = await asyncio.gather(*(nc.request(subjects.node_create("node-1"), json.dumps(
                {"sandbox_id": sid, "spec": spec}).encode(), timeout=60) for sid in ids))
            res = [json.loads(r.data) for r in replies]
            made = [r["sandbox"]["id"] for r in res if r["ok"]]
            assert len(made) == 2, res
            assert [r["error"]["code"] for r in res if not r["ok"]] == ["capacity"] * 4, res
            for sid in made:
                r = json.loads((await nc.request(subjects.sandbox_op(sid, "destroy"), b"{}", timeout=30)).data)
                assert r["ok"], r
            items = [{"sandbox_id": f"sb-{secrets.token_hex(6)}", "spec": spec} for _ in range(6)]
            r = json.loads((await nc.request(subjects.node_create_batch("node-1"), json.dumps({"items": items}).encode(),
                                             timeout=60)).data)
            oks = [x["sandbox"]["id"] for x in r["results"] if x["ok"]]
            assert len(oks) == 2 and [x["error"]["code"] for x in r["results"] if not x["ok"]] == ["capacity"] * 4, r
            for sid in oks:
                assert json.loads((await nc.request(subjects.sandbox_op(sid, "destroy"), b"{}", timeout=30)).data)["ok"]
        finally:
            await nc.close()


async def test_creates_in_flight_are_not_counted_twice():
    """A node's room is exactly filled by creates, a few at a time, while heartbeats come every 50 ms:
    a heartbeat taken while creates are in flight must not count them on top of the scheduler's
    own reservations for them (that made a node with room look full and refuse work), and the
    create after the last one that fits is refused with `capacity`."""
    async with running_stack(nodes=1, monitor=False, env_builder=False,
                             node_args=["--cpu", "1", "--cpu-overcommit", "2", "--heartbeat-s", "0.05"]) as s:
        c = await AsyncClient.connect(s.url)
        try:
            sem = asyncio.Semaphore(4)  # a few at a time: creates are in flight while later ones are placed

            async def one():
                async with sem:
                    return await c.create(image="busybox", cpu=0.125, memory_mb=32, ttl_s=300)

            made = await asyncio.gather(*(one() for _ in range(16)))
            assert len({sb.id for sb in made}) == 16
            with pytest.raises(Capacity):
                await c.create(image="busybox", cpu=0.125, memory_mb=32, ttl_s=300)
            await asyncio.gather(*(sb.destroy() for sb in made))
        finally:
            await c.close()


async def test_a_heartbeat_taken_before_the_answer_arrives_does_not_count_a_create_twice(bus):
    """The node counts a sandbox in its heartbeats from the moment it registers it, and the
    scheduler holds a reservation for the create until a heartbeat covering it is in. Here every
    create's heartbeat (counting it) leaves the node before its answer, as a heartbeat taken while
    the answer is in transit does: a reservation dropped only by a heartbeat taken after the
    scheduler *read* the answer (its own clock) stayed on top of the node's count, so a node with
    room for 4 refused the 3rd. No periodic heartbeats: only these orderings happen."""
    nc, node = bus
    n = await node("exact", cpu=1.0, memory_mb=100_000, cpu_overcommit_max=1.0)
    n.beating = False
    n.beat_on_create = True
    job = f"exact-{uuid.uuid4().hex[:6]}"
    for k in range(4):
        r = await create(nc, cpu=0.25, memory_mb=64, job=job)
        assert r["ok"] and r["sandbox"]["node"] == n.name, (k, r)
    r = await create(nc, cpu=0.25, memory_mb=64, job=job)
    assert r["ok"] is False and r["error"]["code"] == "capacity", r
    assert n.created == 4


async def test_a_late_node_that_claimed_first_keeps_the_sandbox(bus):
    """The scheduler's create times out on a node that made the sandbox but answers late; it asks
    the next node, which finds the id claimed (compare-and-set on the placement key), undoes its
    create and answers `conflict`; the scheduler answers with the late node's sandbox: one id,
    one sandbox, and the reply names the node that holds it."""
    nc, node = bus
    slow = await node("slow", cpu=64.0, memory_mb=100_000)
    assert (await create(nc, cpu=1.0, memory_mb=64, placement="pack"))["ok"]  # the fuller node: asked first
    slow.late = asyncio.Event()
    other = await node("other", cpu=64.0, memory_mb=100_000)
    try:
        r = await create(nc, cpu=1.0, memory_mb=64, placement="pack")
    finally:
        slow.late.set()
    assert r["ok"] and r["sandbox"]["node"] == slow.name, r
    sid = r["sandbox"]["id"]
    assert sid in slow.sandboxes and sid not in other.sandboxes and other.conflicts == 1
    listed = json.loads((await nc.request(subjects.SANDBOX_LIST, b"{}", timeout=5)).data)
    assert [s["node"] for s in listed["sandboxes"] if s["id"] == sid] == [slow.name]


async def test_a_late_create_on_a_real_node_is_undone_when_another_node_holds_the_id():
    """A real node-agent that answers the scheduler late (SIGSTOPped while the create waits in
    its socket): the scheduler times out, makes the sandbox on the other node, and the late node,
    once running again, builds the sandbox, finds its placement key held by the other node,
    destroys what it built and reports the create undone. Exactly one sandbox with that id exists
    afterwards, on the node the reply names."""
    import signal

    from ..leaks import node_leftovers

    async with running_stack(nodes=2, monitor=False, env_builder=False,
                             scheduler_args=["--node-timeout-s", "2", "--stale-after-s", "120"]) as s:
        c = await AsyncClient.connect(s.url)
        nc = await nats.connect(s.url)
        try:
            first = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=300, placement="pack")
            late = first.info.node  # the fuller node, asked first under `pack`
            agent = s.proc(late).popen
            failed: dict[str, dict] = {}
            got = asyncio.Event()

            async def on_failed(m):
                ev = json.loads(m.data)
                failed[ev["sandbox_id"]] = ev
                got.set()

            await nc.subscribe(subjects.event("*", "failed"), cb=on_failed)
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                sb = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=300, placement="pack")
            finally:
                os.kill(agent.pid, signal.SIGCONT)
            assert sb.info.node != late, sb.info
            await asyncio.wait_for(got.wait(), 120)  # the late node's create, undone
            ev = failed[sb.id]
            assert ev["node"] == late and sb.info.node in ev["reason"], ev
            held = {node: node_leftovers(s.data_dir, node) for node in ("node-1", "node-2")}
            assert sb.id not in held[late]["runc"] and sb.id not in held[late]["sandbox_dirs"], held
            assert sb.id in held[sb.info.node]["runc"], held
            kv = await nc.jetstream().key_value("corral_placements")
            assert json.loads((await kv.get(sb.id)).value)["node"] == sb.info.node
            listed = json.loads((await nc.request(subjects.SANDBOX_LIST, b"{}", timeout=5)).data)
            assert [x["node"] for x in listed["sandboxes"] if x["id"] == sb.id] == [sb.info.node]
            assert (await sb.exec("echo hi")).stdout.strip() == "hi"
            await sb.destroy()
            await first.destroy()
        finally:
            await nc.close()
            await c.close()
