"""Fork benchmark: a fork of a running container sandbox (SandboxSpec.fork_of) against the two other
ways to get a second sandbox holding the first one's files, by how much the first one wrote.

  fork             `src.fork()`: SDK -> scheduler -> the source's node, which builds a sandbox
                   whose upper is filled, before its overlay is mounted, with a copy of the
                   (frozen) source's; returns when the fork runs and its init answers
  snapshot+create  `src.snapshot()` then `client.create(image=<snapshot>)`: the path before forks
                   (EROFS layer built and uploaded to the chunk store, registered, then a create
                   that mounts it lazily)
  plain copy       the floor of any copy: host `cp -a` of the source's upper dir into a fresh
                   tmpfs with large folios (no sandbox, no bus), as the node's copy does it

Each size: `--n` rounds, each on a fresh source that wrote SIZE MiB of random data: its first fork
(destroyed off the clock) and a plain copy; then `--snapshots` snapshot+creates, also each on a
fresh source (after the forks, see one_size for why).

Goal (#18): with 256 MiB written, the first fork ready <= 250 ms after the call, on the same node.

    .venv/bin/python -m bench.fork [--n 7] [--snapshots 2] [--sizes 0,16,64,256] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench._common import goal, log, pyplot, save, stats  # noqa: E402
from corral_sdk import AsyncClient, AsyncSandbox  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
GOAL_SIZE_MB = 256
GOAL_MS = 250.0
#: the node's option for a sandbox's upper tmpfs (container_sandbox.LARGE_FOLIOS_OPT): the copy
#: baseline writes into the same kind of tmpfs
LARGE_FOLIOS_OPT = ",huge=within_size"


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def plain_copy(upper: str, size_mb: int) -> float:
    """cp -a of `upper` into a fresh tmpfs, as the node copies a fork's upper; milliseconds."""
    mnt = tempfile.mkdtemp(prefix="crl-fork-copy-", dir="/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb + 64}m{LARGE_FOLIOS_OPT}", "tmpfs", mnt], check=True)
    try:
        t0 = time.perf_counter()
        subprocess.run(["cp", "-a", "--preserve=all", "--reflink=never", "--sparse=always", "--", f"{upper}/.", mnt], check=True)
        return ms_since(t0)
    finally:
        subprocess.run(["umount", mnt], check=True)
        os.rmdir(mnt)


def upper_of(data: str, sb: AsyncSandbox) -> str:
    """The source's upper dir as the host reaches it (through its init's clone of the tmpfs)."""
    with open(f"{data}/nodes/{sb.info.node}/sandboxes/{sb.id}/sandbox.json") as f:
        pid = json.load(f)["init_pid"]
    return f"/proc/{pid}/fd/4/upper"


async def written_source(c: AsyncClient, size_mb: int, mem: int, disk: int) -> AsyncSandbox:
    """A sandbox that wrote `size_mb` MiB of random data, and its checksum, under /data."""
    src = await c.create(image="busybox", cpu=1.0, memory_mb=mem, disk_mb=disk, ttl_s=1800)
    r = await src.exec(f"mkdir -p /data && dd if=/dev/urandom of=/data/blob bs=1M count={size_mb} 2>/dev/null;"
                       " echo note > /data/small; md5sum /data/blob > /data/blob.md5", timeout_s=300)
    assert r.exit_code == 0, r
    return src


async def one_size(c: AsyncClient, data: str, size_mb: int, n: int, snapshots: int) -> dict[str, Any]:
    """`n` fork rounds, each on a fresh source (every timed fork is a source's first, as the goal
    says) followed by a plain copy of its upper; then `snapshots` snapshot+create rounds. Not
    interleaved: in this VM a snapshot's churn of memory and page cache leaves the next large
    allocation on memory the hypervisor has taken back (free page reporting), and the fork after
    it pays the refaults (1-2 s at 256 MiB, either folio size), which is the VM's cost, not the
    fork's."""
    mem = max(256, size_mb * 2 + 128)  # tmpfs pages are charged to the sandbox that wrote them
    disk = max(64, size_mb + 64)
    fork_ms: list[float] = []
    snap_ms: list[float] = []
    copy_ms: list[float] = []
    for i in range(n + snapshots):
        src = await written_source(c, size_mb, mem, disk)
        try:
            if i < n:
                t0 = time.perf_counter()
                f = await src.fork(cpu=0.5, memory_mb=mem, disk_mb=disk)
                fork_ms.append(ms_since(t0))
                check = await f.exec("md5sum -c /data/blob.md5 >/dev/null && echo ok")  # off the clock: it holds the files
                assert check.stdout == "ok\n", check
                await f.destroy()
                copy_ms.append(await asyncio.to_thread(plain_copy, upper_of(data, src), size_mb))
            else:
                t0 = time.perf_counter()
                image = await src.snapshot(f"bench-fork-{size_mb}-{i}")
                s = await c.create(image=image, cpu=0.5, memory_mb=mem, disk_mb=disk)
                snap_ms.append(ms_since(t0))
                await s.destroy()
        finally:
            await src.destroy()
    return {"size_mb": size_mb, "fork": stats(fork_ms), "snapshot_create": stats(snap_ms), "plain_copy": stats(copy_ms)}


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = res["sizes"]
    xs = [r["size_mb"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("fork", "fork (same node)"), ("snapshot_create", "snapshot + create"), ("plain_copy", "plain cp -a of the upper")):
        ys = [r[key].get("median_ms") for r in rows]
        ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(GOAL_MS, color="grey", ls="--", lw=1, label=f"goal at {GOAL_SIZE_MB} MiB: {GOAL_MS:g} ms")
    ax.set_xlabel("MiB the source wrote")
    ax.set_ylabel("median ms until the second sandbox runs")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("A second sandbox with the first one's files")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(a: argparse.Namespace) -> None:
    data = tempfile.mkdtemp(prefix="crl-fork-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, monitor=False)
    await stack.start()
    rows = []
    try:
        c = await AsyncClient.connect(stack.url)
        try:
            warm = await c.create(image="busybox", cpu=0.5, memory_mb=64)  # warm up the path (layers, connections)
            await (await warm.fork(cpu=0.5, memory_mb=64)).destroy()
            await warm.destroy()
            for size in (int(x) for x in a.sizes.split(",")):
                log(f"size {size} MiB")
                rows.append(await one_size(c, data, size, a.n, a.snapshots))
                log(f"  fork p50 {rows[-1]['fork']['median_ms']} ms, snapshot+create p50 "
                    f"{rows[-1]['snapshot_create'].get('median_ms')} ms, plain copy p50 {rows[-1]['plain_copy']['median_ms']} ms")
        finally:
            await c.close()
    finally:
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)
    at = next((r for r in rows if r["size_mb"] == GOAL_SIZE_MB), None)
    value = at["fork"]["median_ms"] if at else None
    res: dict[str, Any] = {
        "benchmark": "fork",
        "sizes": rows,
        "notes": "forks are made on the source's node only (a fork elsewhere: snapshot, then create from it); "
                 "the fork copies what the source wrote (tmpfs has no reflinks), so its time grows with it",
    }
    goals = [goal("fork_256mib_p50_ms", GOAL_MS, value, "ms", "lower",
                  what=f"fork of a container that wrote {GOAL_SIZE_MB} MiB, call to running, p50 (same node)")]
    save(a.out, "fork", res, plot, goals)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--snapshots", type=int, default=2)
    ap.add_argument("--sizes", default="0,16,64,256")
    ap.add_argument("--out", default=f"{REPO}/bench/results")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
