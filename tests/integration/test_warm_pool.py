"""Warm pools: a create for a hot image claims a pre-created, frozen sandbox, which must be
indistinguishable from a fresh one: the claimed id everywhere (cgroups, runc, state dir, host
name, events, audit), the request's env, labels, workdir and limits, an empty upper, no process
but init, nothing of the pool era; the pool refills, grows with demand and shrinks when it
drops; warm sandboxes are neither listed nor counted as user sandboxes."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import msgspec
import nats
import pytest

from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch
from corral_common.contract.messages import Event, Heartbeat
from corral_sdk import AsyncClient

from .. import hostview, leaks
from ..conftest import ensure_builtin_images, make_stack

NODE = "node-1"


@pytest.fixture(scope="module")
async def pooled():
    await asyncio.to_thread(ensure_builtin_images)
    s = make_stack(nodes=1, node_args=["--warm-pool", "busybox=2", "--warm-pool-learn", "--warm-pool-idle-s", "6",
                                       "--warm-pool-max", "3", "--heartbeat-s", "0.3"])
    await s.start()
    c = await AsyncClient.connect(s.url)
    nc = await nats.connect(s.url)
    yield s, c, nc
    await nc.close()
    await c.close()
    await s.stop()
    leaks.assert_clean(s.data_dir, NODE)  # warm sandboxes included
    shutil.rmtree(s.data_dir, ignore_errors=True)


class Heartbeats:
    def __init__(self, nc):
        self.nc = nc
        self.last: Heartbeat | None = None

    async def until(self, pred, timeout: float = 60.0, what: str = "") -> Heartbeat:
        got: asyncio.Queue[Heartbeat] = asyncio.Queue()
        async def on(m) -> None:
            got.put_nowait(msgspec.json.decode(m.data, type=Heartbeat))

        sub = await self.nc.subscribe(subjects.NODE_HEARTBEAT, cb=on)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    self.last = await asyncio.wait_for(got.get(), max(0.05, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if pred(self.last):
                    return self.last
        finally:
            await sub.unsubscribe()
        raise AssertionError(f"timed out waiting for {what}; last heartbeat usage={self.last and self.last.usage} warm={self.last and self.last.warm}")


def warm_ids(s) -> list[str]:
    return sorted(d for d in os.listdir(f"{s.data_dir}/nodes/{NODE}/sandboxes") if d.startswith("wp-"))




async def settle_dirs(s, n: int, timeout: float = 20) -> list[str]:
    """Warm sandbox dirs on the node once the count settles at `n` (a trimmed one is removed
    just after the heartbeat stops counting it)."""
    deadline = time.monotonic() + timeout
    while len(warm_ids(s)) != n and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return warm_ids(s)


def host_files(root: str) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.relpath(f"{dirpath}/{f}", root) for f in files]
    return out


async def test_claim_is_indistinguishable_from_a_fresh_sandbox(pooled):
    s, c, nc = pooled
    hbs = Heartbeats(nc)
    await hbs.until(lambda hb: hb.warm.get("busybox") == 2, what="two warm busybox sandboxes")
    before = warm_ids(s)
    assert len(before) == 2
    cg_parent = leaks.cgroup_parent(s.data_dir, NODE)
    # warm sandboxes are frozen and only run init
    for wid in before:
        with open(f"/sys/fs/cgroup/freezer/{cg_parent}/{wid}/freezer.state") as f:
            assert f.read().strip() == "FROZEN"
        with open(f"/sys/fs/cgroup/pids/{cg_parent}/{wid}/cgroup.procs") as f:
            assert len(f.read().split()) == 1

    events: list[Event] = []

    async def on_event(m) -> None:
        events.append(msgspec.json.decode(m.data, type=Event))

    esub = await nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_event)
    sb = await c.create(image="busybox", cpu=0.5, memory_mb=200, pids_max=77, disk_mb=64, ttl_s=600,
                        env={"FOO": "bar"}, labels={"team": "pool"}, workdir="/work/dir", job="warm-test")
    try:
        sid = sb.id
        assert sid.startswith("sb-")
        await asyncio.sleep(0.3)
        created = [e for e in events if e.kind == "created" and e.sandbox_id == sid]
        assert created and created[0].reason == "claimed from the warm pool", events
        assert created[0].info.labels == {"team": "pool"} and created[0].job == "warm-test"
        claimed = [w for w in before if w not in warm_ids(s)]
        assert len(claimed) == 1
        old = claimed[0]

        # inside: host name, env, workdir, processes, mounts, init's environment
        r = await sb.exec("hostname; echo $FOO; pwd; ps -o pid,args; cat /proc/1/environ | tr '\\0' '\\n'")
        lines = r.stdout.splitlines()
        assert lines[:3] == [sid, "bar", "/work/dir"], r
        procs = [line.split(None, 1) for line in lines[4:] if line.strip() and line.split()[0].isdigit()]
        assert procs[0] == ["1", "/.corral/init"], procs
        assert all(p[1].startswith(("/bin/sh -c", "{ps}", "ps", "tr", "cat")) for p in procs[1:]), procs
        assert "FOO=bar" not in r.stdout.split("/.corral/init", 1)[1], r.stdout  # init's env is the defaults only
        r = await sb.exec("cat /proc/self/mountinfo /proc/mounts /proc/self/cgroup /etc/hostname 2>/dev/null; uname -n")
        assert old not in r.stdout and "wp-" not in r.stdout, r.stdout
        assert r.stdout.rstrip().endswith(sid)

        # host: every name carries the claimed id, none the warm one
        state = f"{s.data_dir}/nodes/{NODE}"
        assert os.path.isdir(f"{state}/sandboxes/{sid}") and not os.path.exists(f"{state}/sandboxes/{old}")
        # (but the controller-less v2 "unified" tracking cgroup of a hybrid host: v2 cannot
        # rename, and inside the sandbox it is the cgroup namespace root, shown as "/")
        assert not [p for p in leaks.cgroups_under(cg_parent) if old in p and "/unified/" not in p]
        assert os.path.isdir(f"/sys/fs/cgroup/memory/{cg_parent}/{sid}")
        runc = leaks.runc_containers(f"{state}/runc")
        assert sid in runc and old not in runc
        st = subprocess.run(["runc", "--root", f"{state}/runc", "state", sid], capture_output=True, text=True)
        assert st.returncode == 0 and '"running"' in st.stdout and old not in st.stdout, st
        assert not [m for m in leaks.mounts_under(f"{state}/sandboxes/{old}")]

        # limits as requested, disk size as requested
        def cg(h, f):
            with open(f"/sys/fs/cgroup/{h}/{cg_parent}/{sid}/{f}") as fh:
                return int(fh.read())
        assert cg("memory", "memory.limit_in_bytes") == 200 * 1024 * 1024
        assert cg("cpu", "cpu.cfs_quota_us") == 50_000 and cg("cpu", "cpu.cfs_period_us") == 100_000
        assert cg("pids", "pids.max") == 77
        # and no host mount for it (its init holds its filesystems)
        assert not [m for m in leaks.mounts_under(f"{state}/sandboxes/{sid}")]
        vfs = os.statvfs(hostview.rw(f"{state}/sandboxes/{sid}"))
        assert vfs.f_blocks * vfs.f_frsize == 64 * 1024 * 1024

        # a fresh upper: nothing but mount points (runc's, as in a cold sandbox) and the workdir
        upper = f"{hostview.rw(f'{state}/sandboxes/{sid}')}/upper"
        assert host_files(upper) == [".corral/init"], host_files(upper)
        assert os.path.getsize(f"{upper}/.corral/init") == 0
        assert os.path.isdir(f"{upper}/work/dir")

        # denied syscalls are audited under the claimed id
        js = nc.jetstream()
        audit: list = []
        async def on_audit(m) -> None:
            audit.extend(msgspec.json.decode(m.data, type=AuditBatch).events)

        asub = await js.subscribe(subjects.audit(NODE, sid), cb=on_audit, ordered_consumer=True)
        r = await sb.exec("unshare -n true; echo rc=$?")
        assert "rc=1" in r.stdout
        deadline = time.monotonic() + 15
        while not [e for e in audit if e.kind == "syscall"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        syscalls = [e for e in audit if e.kind == "syscall"]
        assert syscalls and all(e.sandbox == sid and e.job == "warm-test" and e.labels == {"team": "pool"} for e in syscalls), audit
        await asub.unsubscribe()

        # pause and resume go through runc under the new id
        await sb.pause()
        assert (await sb.refresh()).state == "paused"
        await sb.resume()
        assert (await sb.exec("echo up")).stdout == "up\n"

        # listed as a user sandbox; warm ones are not listed and not counted
        listed = {i.id for i in await c.list()}
        assert sid in listed and not any(i.startswith("wp-") for i in listed)
        hb = await hbs.until(lambda hb: hb.warm.get("busybox") == 2, what="the pool refilled")
        assert hb.usage.sandboxes == 1 and hb.usage.pooled == 2
        assert hb.usage.requested_memory_mb == 200
        assert sid in {u.id for u in hb.usage.per_sandbox} and not any(u.id.startswith("wp-") for u in hb.usage.per_sandbox)
    finally:
        await esub.unsubscribe()
        await sb.destroy()
    state = f"{s.data_dir}/nodes/{NODE}"
    assert not os.path.exists(f"{state}/sandboxes/{sid}")
    assert not [p for p in leaks.cgroups_under(cg_parent) if sid in p or old in p]
    assert not [m for m in leaks.mounts_under(f"{state}/sandboxes/{sid}")]
    assert sid not in leaks.runc_containers(f"{state}/runc")


async def test_pool_learns_from_demand_and_gives_memory_back(pooled):
    s, c, nc = pooled
    hbs = Heartbeats(nc)
    # debian has no configured pool: a few creates in a row make it hot
    made = []
    try:
        for _ in range(3):
            made.append(await c.create(image="debian", cpu=0.25, memory_mb=64, ttl_s=600))
        hb = await hbs.until(lambda hb: hb.warm.get("debian", 0) >= 1, what="a learned debian pool")
        assert hb.warm["debian"] <= 3  # --warm-pool-max
        assert hb.usage.sandboxes == 3 and hb.usage.pooled >= 3  # busybox 2 + debian
        hit = await c.create(image="debian", cpu=0.25, memory_mb=64, ttl_s=600)
        made.append(hit)
        assert (await hit.exec("hostname")).stdout.strip() == hit.id
        # no debian create for --warm-pool-idle-s: its pool is destroyed; busybox keeps its floor
        hb = await hbs.until(lambda hb: "debian" not in hb.warm, timeout=60, what="the debian pool trimmed")
        assert hb.warm.get("busybox") == 2
        assert len(await settle_dirs(s, 2)) == 2
    finally:
        for sb in made:
            await sb.destroy()


async def test_pool_grows_with_the_request_rate_and_shrinks_back(pooled):
    s, c, nc = pooled
    hbs = Heartbeats(nc)
    await hbs.until(lambda hb: hb.warm.get("busybox") == 2, what="the busybox floor")
    # A burst, not a loop: the pool is sized to the create rate times one warm build (x2, +1),
    # so creates one after another over a loaded bus rightly never need more than the floor
    # (each waits longer than a refill). Twelve at once on one node take about six builds'
    # time on two cores, a rate the floor cannot serve on a fast machine or a slow one.
    made: list = []
    try:
        got = await asyncio.gather(*(c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=600) for _ in range(12)),
                                   return_exceptions=True)
        made = [sb for sb in got if not isinstance(sb, BaseException)]
        assert len(made) == 12, [e for e in got if isinstance(e, BaseException)]
        await hbs.until(lambda hb: hb.warm.get("busybox") == 3, what="the busybox pool at its max (3)")
    finally:
        await asyncio.gather(*(sb.destroy() for sb in made))
    await hbs.until(lambda hb: hb.warm.get("busybox") == 2, timeout=60, what="the busybox pool back at its floor")
    assert len(await settle_dirs(s, 2)) == 2


async def test_specs_with_canaries_or_protected_paths_are_never_claimed(pooled):
    """A warm sandbox was built without the spec's decoys and masks: using it would leave a
    canary unplanted and a protected path unmasked, so such creates are built cold."""
    s, c, nc = pooled
    hbs = Heartbeats(nc)
    await hbs.until(lambda hb: hb.warm.get("busybox", 0) >= 1, what="a warm busybox sandbox")
    before = set(warm_ids(s))
    events: list[Event] = []

    async def on_event(m) -> None:
        events.append(msgspec.json.decode(m.data, type=Event))

    esub = await nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_event)
    try:
        sb1 = await c.create(image="busybox", memory_mb=64, canaries={"/srv/answers.json": "42"})
        sb2 = await c.create(image="busybox", memory_mb=64, protected_paths=["/etc/hostname"])
        await asyncio.sleep(0.3)
        for sb in (sb1, sb2):
            created = [e for e in events if e.kind == "created" and e.sandbox_id == sb.id]
            assert created and created[0].reason != "claimed from the warm pool", created
        assert (await sb1.exec("cat /srv/answers.json")).stdout == "42"
        assert (await sb2.exec("cat /etc/hostname")).stdout == ""  # masked by an empty decoy
        assert before <= set(warm_ids(s))  # no warm sandbox was taken
        for sb in (sb1, sb2):
            await sb.destroy()
    finally:
        await esub.unsubscribe()
