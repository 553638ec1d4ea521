"""Leases, pause, and the trajectory log: replay, divergence, gaps, snapshots, restore."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from corral_sdk import AsyncClient, Conflict, InvalidRequest, NotFound

from ..conftest import running_stack

HERE = os.path.dirname(__file__)


async def test_lease_renewal_keeps_a_sandbox_alive(client):
    sb = await client.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=2)
    for _ in range(4):
        await asyncio.sleep(0.8)
        info = await sb.renew()
        assert info.expires_at > time.time() + 1
    assert (await sb.exec("echo alive")).stdout == "alive\n"  # 3.2 s > ttl: alive by its lease
    await asyncio.sleep(2.5)  # no renewal: it expires
    with pytest.raises(NotFound):
        await sb.exec("true")


async def test_paused_busy_loop_uses_no_cpu(client, stack):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=32)
    try:
        await sb.exec("sh -c 'while :; do :; done' > /dev/null 2>&1 &")
        sdir = f"{stack.data_dir}/nodes/node-1"
        with open(f"{sdir}/cgroup-parent") as f:
            acct = f"/sys/fs/cgroup/cpuacct{f.read().strip()}/{sb.id}/cpuacct.usage"

        def usage() -> int:
            with open(acct) as f:
                return int(f.read())

        u0 = usage()
        await asyncio.sleep(1.0)
        running = usage() - u0
        assert running > 0.02e9  # the loop burns up to 0.5 s of CPU per second (cpu=0.5), less on a busy host
        await sb.pause()
        await asyncio.sleep(0.2)
        p0 = usage()
        await asyncio.sleep(1.0)
        assert usage() - p0 < 0.005e9, "a paused sandbox consumed CPU"
        await sb.resume()
        r0 = usage()
        await asyncio.sleep(1.0)
        assert usage() - r0 > 0.02e9
    finally:
        await sb.destroy()


async def test_replay_divergence_gap_and_unknown(client):
    async with client.trajectory("t-basic", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=0) as t:
        r0 = await t.exec("echo one >> /log; wc -l < /log")
        r1 = await t.exec("echo two >> /log; wc -l < /log")
        assert (r0.stdout, r1.stdout, r0.replayed) == ("1\n", "2\n", False)
        sb = t.sandbox
    # a resumed rollout re-issues the same steps: answered from the log, not run again
    async with client.trajectory("t-basic", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=0) as t2:
        assert t2.resumed and t2.sandbox.id == sb.id
        a = await t2.exec("echo one >> /log; wc -l < /log")
        b = await t2.exec("echo two >> /log; wc -l < /log")
        assert a.replayed and b.replayed and (a.stdout, b.stdout) == ("1\n", "2\n")
        assert t2.fast_forwarded == 2  # answered by the SDK from the log it fetched on resume
        c = await t2.exec("echo three >> /log; wc -l < /log")
        assert not c.replayed and c.stdout == "3\n"
    assert (await sb.exec("cat /log")).stdout == "one\ntwo\nthree\n"
    # the node answers replays too (any NATS client, no SDK bookkeeping)
    r = await sb.exec("echo one >> /log; wc -l < /log", trajectory="t-basic", step=0)
    assert r.replayed and r.stdout == "1\n"
    # divergence names both commands; truncate on request
    with pytest.raises(Conflict, match="echo two >> /log.*echo TWO"):
        await sb.exec("echo TWO", trajectory="t-basic", step=1)
    r = await sb.exec("echo TWO", trajectory="t-basic", step=1, on_divergence="truncate")
    assert r.stdout == "TWO\n" and not r.replayed
    meta, recent = await client.trajectories.get("t-basic")
    assert meta.last_step == 1 and [e.step for e in recent] == [0, 1]
    with pytest.raises(InvalidRequest, match="skips steps 2..4"):
        await sb.exec("true", trajectory="t-basic", step=5)
    with pytest.raises(InvalidRequest, match="start at step 0"):
        await sb.exec("true", trajectory="t-fresh", step=3)
    with pytest.raises(InvalidRequest, match="together"):
        await sb.exec("true", trajectory="t-basic")
    with pytest.raises(NotFound, match="t-nope"):
        await client.trajectories.get("t-nope")
    with pytest.raises(NotFound):
        await client.trajectories.delete("t-nope")
    assert "t-basic" in [m.id for m in await client.trajectories.list(prefix="t-b")]
    await client.trajectories.delete("t-basic")
    await sb.destroy()


async def test_restore_from_snapshot_when_the_sandbox_is_lost(client):
    async with client.trajectory("t-restore", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=3) as t:
        for i in range(5):
            await t.exec(f"echo {i} >> /work.log", session="s")
        first = t.sandbox
    meta, _ = await client.trajectories.get("t-restore")
    assert [s.step for s in meta.snapshots] == [2] and meta.last_step == 4
    await first.destroy()  # the sandbox is lost (node died, ttl ran out, ...)
    async with client.trajectory("t-restore", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=3) as t:
        assert t.sandbox.id != first.id and t.sandbox.info.image == meta.snapshots[0].image
        assert t.rerun_steps == 2  # steps 3 and 4 were re-run for real on top of the snapshot
        for i in range(5):
            assert (await t.exec(f"echo {i} >> /work.log", session="s")).replayed
        r = await t.exec("cat /work.log")
        assert r.stdout == "0\n1\n2\n3\n4\n" and not r.replayed
        await t.finish(delete_log=True)


def _trainer(url: str, tid: str, steps: int, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "trainer.py"), url, tid, str(steps), out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def test_trainer_killed_repeatedly_resumes_exactly_once(stack, client):
    """kill -9 the trainer at random steps; every non-idempotent effect happens exactly once and
    the results match an uninterrupted run."""
    import random

    rnd = random.Random(7)
    tid = "t-chaos"
    out = f"{stack.data_dir}/chaos.json"
    kills = 0
    for attempt in range(20):
        p = _trainer(stack.url, tid, 50, out)
        if kills < 4:
            await asyncio.sleep(rnd.uniform(0.3, 1.2))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                continue
        assert p.wait(timeout=300) == 0, p.stderr.read()
        break
    assert kills >= 3
    with open(out) as f:
        results = json.load(f)
    assert [r["step"] for r in results] == list(range(50))
    # the uninterrupted reference: the same rollout under a fresh id
    p = _trainer(stack.url, "t-chaos-ref", 50, out + ".ref")
    assert p.wait(timeout=300) == 0, p.stderr.read()
    with open(out + ".ref") as f:
        ref = json.load(f)
    assert [r["stdout"] for r in results] == [r["stdout"] for r in ref]
    meta, _ = await client.trajectories.get(tid)
    sb = client.sandbox(meta.sandbox_id)
    log = (await sb.exec("cat /work/effects")).stdout.split()
    assert log == [f"s{i}" for i in range(50) if i % 2 == 0], "a non-idempotent step ran twice or not at all"
    for t in (tid, "t-chaos-ref"):
        m, _ = await client.trajectories.get(t)
        await client.sandbox(m.sandbox_id).destroy()
        await client.trajectories.delete(t)


async def test_node_agent_lost_trajectory_resumes_on_another_node():
    async with running_stack(nodes=2) as stack:
        c = await AsyncClient.connect(stack.url)
        async with c.trajectory("t-node", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=4) as t:
            for i in range(10):
                await t.exec(f"echo {i} >> /state")
            lost = t.sandbox
        node = lost.info.node
        # the node dies: its agent killed and never restarted, its sandboxes gone with it
        agent = stack.proc(node).popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        with open(f"{stack.data_dir}/nodes/{node}/sandboxes/{lost.id}/init.pid") as f:
            os.kill(int(f.read()), signal.SIGKILL)
        async with c.trajectory("t-node", image="busybox", cpu=0.1, memory_mb=32, snapshot_every=4) as t:
            assert t.sandbox.info.node != node and t.rerun_steps == 2  # snapshot after step 7; 8, 9 re-run
            for i in range(10):
                assert (await t.exec(f"echo {i} >> /state")).replayed
            assert (await t.exec("cat /state")).stdout == "".join(f"{i}\n" for i in range(10))
            await t.finish(delete_log=True)
        await c.close()
        stack.restart(node)  # let it come back and clean up what its predecessor left
        await asyncio.sleep(3)
