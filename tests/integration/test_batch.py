"""create_batch at scale against simulated nodes on the real bus (real scheduler processes): one
request per node with a result per item, progress events, idempotent retries, a scheduler
replica killed mid-batch, and bad input. The real node-agent's half of a node batch is tested in
test_node_batch_request_answers_per_item (session stack)."""
from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import nats
import pytest

from corral_common.bus import kv_keys
from corral_common.contract import subjects
from corral_scheduler.batch import item_id
from corral_scheduler.batch_records import WAIT_MAX_S
from corral_sdk import AsyncClient

from ..conftest import make_stack
from ..simnode import SimNode


@pytest.fixture(scope="module")
async def sched():
    s = make_stack(nodes=0)
    await s.start()
    yield s
    await s.stop()
    shutil.rmtree(s.data_dir, ignore_errors=True)


@pytest.fixture
async def bus(sched):
    nc = await nats.connect(sched.url, pending_size=256 * 1024 * 1024)
    nodes: list[SimNode] = []

    async def node(name: str, **kw) -> SimNode:
        n = await SimNode(nc, f"{name}-{uuid.uuid4().hex[:6]}", **kw).start()
        nodes.append(n)
        return n

    yield nc, node
    for n in nodes:
        await n.stop()
    await nc.close()


async def call(nc, subject: str, body: dict, timeout: float = 60) -> dict:
    return json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=timeout)).data)


async def heard(nc) -> None:
    """Let the scheduler hear the new nodes' first heartbeats."""
    await asyncio.sleep(0.3)


def held_by(nodes: list[SimNode], job: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in nodes:
        for sid, info in n.sandboxes.items():
            if info.job == job:
                out.setdefault(sid, []).append(n.name)
    return out


async def test_batch_of_5000_over_simulated_nodes_with_progress_events(bus):
    nc, node = bus
    nodes = [await node(f"b5k{i}", cpu=64.0, memory_mb=1_000_000, sandboxes=5000) for i in range(5)]
    await heard(nc)
    job = f"b5k-{uuid.uuid4().hex[:6]}"
    bid = f"bid-{uuid.uuid4().hex[:8]}"
    events: list[tuple[str, dict]] = []

    async def on(m):
        events.append((m.subject.rsplit(".", 1)[1], json.loads(m.data)))

    await nc.subscribe(subjects.batch_event(bid, "*"), cb=on)
    body = {"spec": {"cpu": 0.01, "memory_mb": 16, "job": job, "request_id": job}, "count": 5000, "batch_id": bid}
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, body)
    assert r["ok"] and r["batch_id"] == bid and r["failed"] == [], r.get("error")
    ids = [s["id"] for s in r["sandboxes"]]
    assert len(ids) == len(set(ids)) == 5000
    assert set(ids) == {item_id(job, i) for i in range(5000)}  # ids follow from the request_id
    # one request per node share (at most 256 items each), not one per sandbox
    assert sum(n.batches for n in nodes) <= 5 * (5000 // 5 // 256 + 2)
    held = held_by(nodes, job)
    assert len(held) == 5000 and all(len(v) == 1 for v in held.values())
    assert min(len([s for s in n.sandboxes.values() if s.job == job]) for n in nodes) > 500  # spread
    # progress: several events, counts never go back, one final `done` with everything
    for _ in range(50):
        if any(k == "done" for k, _ in events):
            break
        await asyncio.sleep(0.05)
    kinds = [k for k, _ in events]
    assert kinds.count("done") == 1 and kinds[-1] == "done" and kinds.count("progress") >= 3, kinds
    done = [e for _, e in events]
    assert all(e["total"] == 5000 and e["batch_id"] == bid and e["job"] == job for e in done)
    seen = [e["placed"] + e["failed"] for e in done]
    assert seen == sorted(seen) and done[-1]["placed"] == 5000 and done[-1]["failed"] == 0 and done[-1]["done"] is True
    assert all(e["done"] is False for e in done[:-1])
    # a retry answers the same sandboxes and makes nothing
    asked = sum(n.batches for n in nodes)
    again = await call(nc, subjects.SANDBOX_CREATE_BATCH, body)
    assert sorted(s["id"] for s in again["sandboxes"]) == sorted(ids) and again["failed"] == []
    assert sum(n.batches for n in nodes) == asked and len(held_by(nodes, job)) == 5000
    listed = await call(nc, subjects.SANDBOX_LIST, {"job": job})
    assert len(listed["sandboxes"]) == 5000
    used = await call(nc, subjects.QUOTA_GET, {"job": job})
    assert used["used"]["sandboxes"] == 5000  # counted once, though seen in replies and in KV


async def test_partial_failure_per_item_and_replanning(bus):
    nc, node = bus
    job = f"part-{uuid.uuid4().hex[:6]}"
    flaky = await node("flaky", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    flaky.fail_every = 4
    small = await node("small", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    roomy = await node("roomy", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    # `small` reported room in its heartbeat but refuses beyond 10: its items are planned again
    small.beating = False
    small.capacity.sandboxes = 10
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.01, "memory_mb": 16, "job": job}, "count": 600})
    assert r["ok"] is True
    failed = r["failed"]
    assert failed and all(f["code"] == "internal" and "simulated failure" in f["message"] for f in failed)
    assert len(r["sandboxes"]) + len(failed) == 600
    assert len({f["index"] for f in failed}) == len(failed) and all(0 <= f["index"] < 600 for f in failed)
    held = held_by([flaky, small, roomy], job)
    assert len(held) == len(r["sandboxes"]) and all(len(v) == 1 for v in held.values())
    assert len([s for s in small.sandboxes.values() if s.job == job]) <= 10
    assert len([s for s in roomy.sandboxes.values() if s.job == job]) > 200
    # every item failing: an error reply naming the cause, not an empty success
    flaky.fail_every = 1
    small.fail_every = 1
    roomy.fail_every = 1
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.01, "memory_mb": 16, "job": job + "x"}, "count": 20})
    assert r["ok"] is False and r["error"]["code"] == "internal" and "none of the 20" in r["error"]["message"]


async def test_sdk_progress_callback(bus, sched):
    nc, node = bus
    await node("sdk", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    got = []
    async with await AsyncClient.connect(sched.url) as c:
        sbs = await c.create_batch(400, cpu=0.01, memory_mb=16, job=f"sdk-{uuid.uuid4().hex[:6]}", progress=got.append)
    assert len(sbs) == 400
    assert got and got[-1].done and got[-1].placed == 400 and got[-1].total == 400
    assert [g.placed for g in got] == sorted(g.placed for g in got)


async def test_bad_input_is_explained(bus):
    nc, node = bus
    await node("bad", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.1, "memory_mb": 16}, "count": 0})
    assert r["error"]["code"] == "invalid_request" and "count" in r["error"]["message"]
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.1, "memory_mb": 16}, "count": 2, "batch_id": "no spaces"})
    assert r["error"]["code"] == "invalid_request" and "batch_id" in r["error"]["message"]
    job = f"bq-{uuid.uuid4().hex[:6]}"
    await call(nc, subjects.QUOTA_SET, {"job": job, "sandboxes": 10})
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.1, "memory_mb": 16, "job": job}, "count": 11})
    assert r["error"]["code"] == "capacity" and "quota of 10" in r["error"]["message"] and r["error"]["retry_after_s"] > 0
    # a retried batch does not count its own sandboxes against the quota a second time
    body = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": job, "request_id": job}, "count": 10}
    assert len((await call(nc, subjects.SANDBOX_CREATE_BATCH, body))["sandboxes"]) == 10
    assert len((await call(nc, subjects.SANDBOX_CREATE_BATCH, body))["sandboxes"]) == 10
    # the same request_id for a different batch
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {**body, "count": 12})
    assert r["error"]["code"] == "conflict" and "batch of 10" in r["error"]["message"]
    # an unknown job
    r = await call(nc, subjects.QUOTA_GET, {"job": f"nobody-{uuid.uuid4().hex[:6]}"})
    assert r["ok"] is False and r["error"]["code"] == "not_found" and "unknown" in r["error"]["message"]
    assert (await call(nc, subjects.QUOTA_GET, {"job": job}))["used"]["sandboxes"] == 10


async def test_same_request_id_with_another_spec_is_a_conflict(bus):
    """A batch's request_id stands for one spec: a retry with the same spec (spelt differently:
    key order, defaults given) returns the same sandboxes; another spec is a `conflict` that
    says why, and makes nothing."""
    nc, node = bus
    n = await node("digest", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    rid = f"dg-{uuid.uuid4().hex[:6]}"
    body = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": rid, "request_id": rid, "labels": {"a": "1", "b": "2"}}, "count": 4}
    first = await call(nc, subjects.SANDBOX_CREATE_BATCH, body)
    ids = sorted(s["id"] for s in first["sandboxes"])
    assert len(ids) == 4
    same = {"spec": {"request_id": rid, "job": rid, "labels": {"b": "2", "a": "1"}, "memory_mb": 16, "cpu": 0.1,
                     "substrate": "container"}, "count": 4}
    again = await call(nc, subjects.SANDBOX_CREATE_BATCH, same)
    assert sorted(s["id"] for s in again["sandboxes"]) == ids and not again["failed"]
    held = len(n.sandboxes)
    for change in ({"memory_mb": 32}, {"image": "debian"}, {"labels": {"a": "1"}}):
        r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {**body["spec"], **change}, "count": 4})
        assert r["ok"] is False and r["error"]["code"] == "conflict", r
        msg = r["error"]["message"]
        assert rid in msg and "different spec" in msg and "new request_id" in msg, msg
    assert len(n.sandboxes) == held
    # a batch whose first attempt never finished (its replica died) is refused with another spec too
    rid2 = f"dg2-{uuid.uuid4().hex[:6]}"
    n.hold = asyncio.Event()
    body2 = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": rid2, "request_id": rid2}, "count": 3}
    pending = asyncio.ensure_future(call(nc, subjects.SANDBOX_CREATE_BATCH, body2))
    for _ in range(100):
        if n.held:
            break
        await asyncio.sleep(0.05)
    assert n.held
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {**body2["spec"], "memory_mb": 64}, "count": 3})
    assert r["ok"] is False and r["error"]["code"] == "conflict" and "different spec" in r["error"]["message"], r
    n.hold.set()
    assert len((await pending)["sandboxes"]) == 3


async def test_a_repeat_while_the_batch_is_placed_waits_for_it(bus, sched):
    """The SDK hedges a slow batch (asks again with its request_id) and callers retry after a
    timeout: a repeat that comes while an attempt is still placing the batch waits for that
    attempt (it renews a lease on the batch's record) and answers what it made, instead of
    placing the same items beside it and taking half-made ones for made; past WAIT_MAX_S it is
    answered `unavailable` with a retry hint (the SDK asks again)."""
    nc, node = bus
    n = await node("repeat", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    rid = f"rp-{uuid.uuid4().hex[:6]}"
    body = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": rid, "request_id": rid}, "count": 6}
    n.hold = asyncio.Event()
    first = asyncio.ensure_future(call(nc, subjects.SANDBOX_CREATE_BATCH, body))
    repeats: list[asyncio.Future] = []
    try:
        for _ in range(100):
            if n.held:
                break
            await asyncio.sleep(0.05)
        assert n.held == 1
        repeats = [asyncio.ensure_future(call(nc, subjects.SANDBOX_CREATE_BATCH, body)) for _ in range(2)]
        # and through the SDK, which asks again after an `unavailable` with a hint while its timeout lasts
        c = await AsyncClient.connect(sched.url)
        settled = asyncio.ensure_future(c.create_batch_reply(6, cpu=0.1, memory_mb=16, job=rid, request_id=rid, timeout=90))
        await asyncio.sleep(8)  # longer than a lease lasts unrenewed: the placing attempt keeps renewing it
        assert not any(r.done() for r in repeats) and n.held == 1, "a repeat placed the batch beside its first attempt"
        # past WAIT_MAX_S a repeat is told the batch is still being placed (not left to its
        # caller's timeout), and nothing is placed beside the first attempt
        for r in repeats:
            a = await asyncio.wait_for(r, WAIT_MAX_S + 5)
            assert a["ok"] is False and a["error"]["code"] == "unavailable" and a["error"]["retry_after_s"] > 0, a
            assert "still being placed by another attempt" in a["error"]["message"], a
        assert n.held == 1 and not first.done() and not settled.done()
        n.hold.set()  # (before the node's timeout, 30 s, would end the first attempt)
        answers = [await first, msgspec.to_builtins(await settled)]
        await c.close()
    finally:
        n.hold.set()
        await asyncio.gather(first, *repeats, return_exceptions=True)
    assert answers[0]["ok"], answers[0]
    ids = sorted(s["id"] for s in answers[0]["sandboxes"])
    assert ids == sorted(item_id(rid, i) for i in range(6))
    for a in answers[1:]:
        assert sorted(s["id"] for s in a["sandboxes"]) == ids and not a["failed"], a
    assert sorted(held_by([n], rid)) == ids and n.batches == 1


async def test_a_node_lost_mid_batch_is_not_waited_for(bus):
    """A node that dies while it makes its share (no answer, no more heartbeats) is declared lost
    after stale_after_s (5 s); the batch stops waiting for it then, long before the node timeout
    (30 s and more), and makes its share on the nodes still up under the same ids."""
    nc, node = bus
    job = f"lostmid-{uuid.uuid4().hex[:6]}"
    # small nodes: spread hands out items in quanta of 1% of a node's room (here 1 item)
    up = await node("up", cpu=8.0, memory_mb=100_000, sandboxes=500)
    dies = await node("dies", cpu=8.0, memory_mb=100_000, sandboxes=500)
    await heard(nc)
    dies.hold = asyncio.Event()
    body = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": job, "placement": "spread"}, "count": 40}
    pending = asyncio.ensure_future(call(nc, subjects.SANDBOX_CREATE_BATCH, body, timeout=25))
    try:
        for _ in range(100):
            if dies.held:
                break
            await asyncio.sleep(0.05)
        assert dies.held, "spread placement gave the second node no share"
        dies.beating = False
        r = await pending
    finally:
        dies.hold.set()
        await asyncio.gather(pending, return_exceptions=True)
    assert r["ok"] is True and not r["failed"] and len(r["sandboxes"]) == 40, r.get("failed", r)[:3]
    assert {s["node"] for s in r["sandboxes"]} == {up.name}
    assert sorted(held_by([up], job)) == sorted(s["id"] for s in r["sandboxes"])


async def test_destroyed_items_are_not_made_again_on_retry(bus):
    nc, node = bus
    n = await node("gone", cpu=64.0, memory_mb=1_000_000, sandboxes=5000)
    await heard(nc)
    rid = f"gone-{uuid.uuid4().hex[:6]}"
    body = {"spec": {"cpu": 0.1, "memory_mb": 16, "job": rid, "request_id": rid}, "count": 5}
    r = await call(nc, subjects.SANDBOX_CREATE_BATCH, body)
    victim = r["sandboxes"][0]["id"]
    n.sandboxes.pop(victim)
    await n.kv.delete(victim)  # as a destroy would
    await asyncio.sleep(0.2)
    again = await call(nc, subjects.SANDBOX_CREATE_BATCH, body)
    assert len(again["sandboxes"]) == 4 and victim not in {s["id"] for s in again["sandboxes"]}
    assert len(again["failed"]) == 1 and again["failed"][0]["code"] == "not_found" and "gone" in again["failed"][0]["message"]
    assert victim not in n.sandboxes


def _replica(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "corral_scheduler", "--nats", url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


async def _ready(p: subprocess.Popen) -> None:
    def wait() -> None:
        for line in p.stderr:
            if "scheduler ready" in line:
                return
        raise RuntimeError("scheduler replica exited before it was ready")

    await asyncio.wait_for(asyncio.to_thread(wait), 60)
    # drain the rest of its log in the background so it never blocks on a full pipe
    asyncio.get_running_loop().run_in_executor(None, lambda: [None for _ in p.stderr])


async def _teardown(stack, nc, nodes: list[SimNode], replica: subprocess.Popen | None) -> None:
    """What a test with its own stack and a scheduler replica leaves: nothing."""
    for n in nodes:
        await n.stop()
    await nc.close()
    if replica is not None:
        replica.terminate()
        try:
            replica.wait(timeout=30)
        except subprocess.TimeoutExpired:
            replica.kill()
    await stack.stop()
    shutil.rmtree(stack.data_dir, ignore_errors=True)


async def test_replica_killed_mid_batch_loses_nothing_and_doubles_nothing():
    """Two scheduler processes; the one serving a large batch is SIGKILLed while nodes hold part
    of it; the client retries with the same request_id and gets exactly the requested count, each
    sandbox on one node, counted once in KV, on the nodes and in the surviving scheduler."""
    stack = make_stack(nodes=0)
    await stack.start()
    nc = await nats.connect(stack.url, pending_size=256 * 1024 * 1024)
    nodes: list[SimNode] = []
    replica = None
    # every request task is awaited: an exception never retrieved surfaces in whichever later test
    # of this worker collects the task (on CPython 3.11.7 once as an AST SystemError, in a parse
    # the garbage collector interrupted to log it)
    requests: list[asyncio.Task] = []
    try:
        for i in range(4):
            nodes.append(await SimNode(nc, f"kill{i}-{secrets.token_hex(3)}", cpu=64.0, memory_mb=1_000_000, sandboxes=5000).start())
        gate = asyncio.Event()
        for n in nodes[2:]:  # these two sit on the first attempt's requests until the gate opens
            n.hold = gate
        await asyncio.sleep(0.5)
        victim = stack.proc("scheduler").popen
        rid = f"kill-{secrets.token_hex(4)}"
        count = 2000
        body = json.dumps({"spec": {"cpu": 0.01, "memory_mb": 16, "job": rid, "request_id": rid}, "count": count}).encode()
        # only the victim serves the queue group now, so it takes the first attempt
        first = asyncio.create_task(nc.request(subjects.SANDBOX_CREATE_BATCH, body, timeout=20))
        requests.append(first)
        for _ in range(200):
            if all(n.held for n in nodes[2:]) and len(held_by(nodes[:2], rid)) > 0:
                break
            await asyncio.sleep(0.05)
        made_before = len(held_by(nodes, rid))
        assert made_before > 0 and all(n.held for n in nodes[2:])
        replica = _replica(stack.url)
        await _ready(replica)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        # the retry (same request_id) reaches the survivor; the held requests of the dead replica
        # are let go while it runs, so both race for the same items on the nodes
        retry = asyncio.create_task(nc.request(subjects.SANDBOX_CREATE_BATCH, body, timeout=120))
        requests.append(retry)
        await asyncio.sleep(0.3)
        gate.set()
        r = json.loads((await retry).data)
        # its scheduler died: no reply came (waiting out its timeout would prove no more)
        assert not first.done() or first.exception() is not None, first.result()
        first.cancel()
        assert r["ok"] is True and r["failed"] == [], r
        ids = sorted(s["id"] for s in r["sandboxes"])
        assert ids == sorted(item_id(rid, i) for i in range(count))
        await asyncio.sleep(0.5)  # late answers to the dead replica's requests
        held = held_by(nodes, rid)
        assert len(held) == count and all(len(v) == 1 for v in held.values()), \
            [k for k, v in held.items() if len(v) > 1][:5]
        for n in nodes:  # node-side capacity: what each node counts is what it holds
            mine = [s for s in n.sandboxes.values()]
            assert abs(n.req_cpu - sum(s.cpu for s in mine)) < 1e-6 and n.req_mem == sum(s.memory_mb for s in mine)
        kv = await nc.jetstream().key_value(subjects.KV_PLACEMENTS)
        keys = set(await kv_keys(kv))
        assert set(ids) <= keys
        listed = await call(nc, subjects.SANDBOX_LIST, {"job": rid})
        assert sorted(s["id"] for s in listed["sandboxes"]) == ids
        used = await call(nc, subjects.QUOTA_GET, {"job": rid})
        assert used["used"]["sandboxes"] == count
        # and once more, now that everything is settled: the same answer, nothing new
        again = json.loads((await nc.request(subjects.SANDBOX_CREATE_BATCH, body, timeout=60)).data)
        assert sorted(s["id"] for s in again["sandboxes"]) == ids and len(held_by(nodes, rid)) == count
    finally:
        for t in requests:
            t.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await _teardown(stack, nc, nodes, replica)


async def test_a_new_replica_places_on_nodes_whose_bucket_entries_have_aged():
    """A replica starting while no other scheduler runs finds the nodes bucket only as fresh as the
    last refresh of the replica before it (every few seconds while one ran, all nodes that started
    together in one phase; then aging alike for as long as none ran): it must place on those nodes
    at once, not answer `capacity` until their next heartbeats happen to arrive."""
    from corral_common.contract.messages import Heartbeat, encoder
    from corral_scheduler.nodes import KV_REFRESH_S

    stack = make_stack(nodes=0)
    await stack.start()
    nc = await nats.connect(stack.url)
    nodes: list[SimNode] = []
    replica = None
    try:
        for i in range(3):  # heartbeats every 2 s: a replica answering before it hears them fails
            nodes.append(await SimNode(nc, f"aged{i}-{secrets.token_hex(3)}", cpu=8.0, memory_mb=65536).start(interval=2.0))
        old = stack.proc("scheduler").popen
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=10)
        kv = await nc.jetstream().key_value(subjects.KV_NODES)
        # as the bucket stands when no scheduler ran for a minute, with a node that had died long
        # before: its entry is older than the others by more than a refresh interval and a timeout
        dead = SimNode(nc, f"aged-dead-{secrets.token_hex(3)}", cpu=64.0, memory_mb=1_000_000)
        for n, age in [*((n, 60.0) for n in nodes), (dead, 60.0 + 5.0 + KV_REFRESH_S + 1.0)]:
            hb = Heartbeat(node=n.name, ts=time.time() - age, capacity=n.capacity, usage=n.usage(), substrates=n.substrates)
            await kv.put(n.name, encoder.encode(hb))
        replica = _replica(stack.url)
        await _ready(replica)
        job = f"aged-{secrets.token_hex(3)}"
        # no retry on "no responders": the ready line promises the server has its subscriptions
        r = await call(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"cpu": 0.5, "memory_mb": 64, "job": job}, "count": 6})
        assert r["ok"] is True and r["failed"] == [], r
        assert len(held_by(nodes, job)) == 6
    finally:
        await _teardown(stack, nc, nodes, replica)


async def test_node_batch_request_answers_per_item(nc):
    """The real node-agent (session stack, node-1): made, refused and already-held items in one
    request, each answered on its own; a repeat makes nothing new."""
    kv = await nc.jetstream().key_value(subjects.KV_PLACEMENTS)
    ids = [f"sb-{secrets.token_hex(6)}" for _ in range(4)]
    foreign = json.dumps({"id": ids[3], "node": "elsewhere", "state": "running", "substrate": "container", "image": "busybox",
                          "created_at": 1.0, "expires_at": 2.0}).encode()
    await kv.create(ids[3], foreign)  # held by another node
    spec = {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "job": "node-batch"}
    items = [{"sandbox_id": ids[0], "spec": spec}, {"sandbox_id": ids[1], "spec": {**spec, "image": "no-such-image"}},
             {"sandbox_id": ids[2], "spec": spec}, {"sandbox_id": ids[3], "spec": spec}]
    try:
        r = await call(nc, subjects.node_create_batch("node-1"), {"items": items})
        res = r["results"]
        assert r["ok"] and len(res) == 4
        assert res[0]["ok"] and res[0]["sandbox"]["id"] == ids[0] and res[0]["sandbox"]["state"] == "running"
        assert res[1]["ok"] is False and res[1]["error"]["code"] == "not_found" and "no-such-image" in res[1]["error"]["message"]
        assert res[2]["ok"] and res[2]["sandbox"]["id"] == ids[2]
        assert res[3]["ok"] is False and res[3]["error"]["code"] == "conflict"
        assert (await kv.get(ids[3])).value == foreign  # left alone
        with pytest.raises(Exception):
            await kv.get(ids[1])  # the refused item's claim is gone
        for sid in (ids[0], ids[2]):
            e = await call(nc, subjects.sandbox_op(sid, "exec"), {"cmd": "echo hi"})
            assert e["result"]["stdout"] == "hi\n"
        again = await call(nc, subjects.node_create_batch("node-1"), {"items": [items[0], items[2]]})
        assert [x["sandbox"]["created_at"] for x in again["results"]] == [res[0]["sandbox"]["created_at"], res[2]["sandbox"]["created_at"]]
        bad = await call(nc, subjects.node_create_batch("node-1"), {"items": []})
        assert bad["ok"] is False and bad["error"]["code"] == "invalid_request"
    finally:
        for sid in (ids[0], ids[2]):
            await call(nc, subjects.sandbox_op(sid, "destroy"), {})
        await kv.delete(ids[3])


async def test_a_placement_on_a_node_that_is_not_alive_is_not_taken_as_made(stack, client):
    """A placement its lost node left behind (its delete did not land while the bucket failed over
    with the host that died) names an item of a batch asked again: the batch must not answer that
    item as made on a node that is not there (cc59: a settled batch named a sandbox nothing listed)."""
    from corral_common.contract.messages import SandboxInfo, encoder

    rid = f"ghost-{secrets.token_hex(4)}"
    sid = item_id(rid, 0)
    kv = await client.nc.jetstream().key_value(subjects.KV_PLACEMENTS)
    now = time.time()
    await kv.put(sid, encoder.encode(SandboxInfo(id=sid, node="ghost-node", state="running", substrate="container",
                                                 image="busybox", created_at=now, expires_at=now + 600)))
    try:
        for _ in range(100):  # the scheduler's table has it (its watch of the bucket)
            if sid in {s.id for s in await client.list()}:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the planted placement never reached the scheduler's table")
        r = await client.create_batch_reply(3, request_id=rid, image="busybox", cpu=0.05, memory_mb=16)
        try:
            assert all(s.node != "ghost-node" for s in r.sandboxes), r.sandboxes
            # its id is held by that placement: refused (never made twice), the other items made
            assert [(f.index, f.code) for f in r.failed] == [(0, "conflict")], r.failed
            assert len(r.sandboxes) == 2
        finally:
            for s in r.sandboxes:
                await client.sandbox(s.id).destroy()
    finally:
        await kv.delete(sid)
