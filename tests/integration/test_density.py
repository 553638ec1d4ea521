"""Density, modestly: a hundred idle sandboxes on one node-agent cost it at most ~2 file
descriptors each and no host mount (RLIMIT_NOFILE is 20,000 here, and a node is meant to hold thousands), all
answer, and destroying them leaves nothing (dirs, mounts, cgroups, runc state, processes).
The 2,000-sandbox run and the memory per sandbox are measured in bench/density.py."""
from __future__ import annotations

import asyncio
import os

from .. import leaks

N = 100


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _host_mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


async def test_a_hundred_idle_sandboxes_then_nothing_left(stack, client):
    agent = stack.proc("node-1").popen.pid
    fds0 = _fds(agent)
    mounts0 = _host_mounts()
    sem = asyncio.Semaphore(8)
    made = []

    async def one() -> None:
        async with sem:
            made.append(await client.create(image="busybox", cpu=0.01, memory_mb=16, disk_mb=16, ttl_s=600, labels={"t": "density"}))

    try:
        await asyncio.gather(*(one() for _ in range(N)))
        assert len({sb.id for sb in made}) == N
        fds = _fds(agent) - fds0
        assert fds <= 2.2 * N, f"{fds} more fds for {N} sandboxes"
        # no host mount per sandbox: each would be copied into every later sandbox's mount
        # namespace, making creates slower with every sandbox alive (image layers are shared)
        mounts = _host_mounts() - mounts0
        assert mounts < N / 4, f"{mounts} more host mounts for {N} sandboxes"
        listed = {i.id for i in await client.list(labels={"t": "density"})}
        assert listed == {sb.id for sb in made}
        outs = await asyncio.gather(*(sb.exec("hostname") for sb in made[::10]))
        assert [o.stdout.strip() for o in outs] == [sb.id for sb in made[::10]]
        # a tiny CPU request (0.01: 1 ms per 100 ms) is in force once the sandbox is up
        cg = leaks.cgroup_parent(stack.data_dir, "node-1")
        with open(f"/sys/fs/cgroup/cpu/{cg}/{made[0].id}/cpu.cfs_quota_us") as f:
            assert int(f.read()) == 1000
    finally:
        await asyncio.gather(*(sb.destroy() for sb in made), return_exceptions=True)
    ids = {sb.id for sb in made}
    left = leaks.node_leftovers(stack.data_dir, "node-1")
    assert not ids & set(left["sandbox_dirs"]) and not ids & set(left["runc"])
    assert not [c for c in left["cgroups"] if any(i in c for i in ids)]
    assert not [m for m in left["mounts"] if any(i in m for i in ids)]
    for pid in leaks.inits_of_node(stack.data_dir, "node-1"):  # (the function substrate keeps some ready)
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                assert not any(i in f.read() for i in ids)
        except FileNotFoundError:
            pass
    assert _fds(agent) - fds0 <= 4
