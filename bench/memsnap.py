"""Memory snapshots of microvm and vm guests: save and resume time by how much the guest holds,
against a cold create of the same guest, in one run.

  cold      `client.create(image="busybox", substrate=S, memory_mb=128, disk_mb=D)` (a boot),
            until the guest's agent answers
  snapshot  `sb.snapshot(memory=True)` of that guest after it wrote W MiB of random data into its
            writable layer (a tmpfs in its RAM): stop, QEMU's migration into a pipe, chunks
            uploaded to the object store, image registered, guest running again
  restore   `client.create(image=<the snapshot>, substrate=S, same sizes)`: QEMU started with
            `-incoming` on the loader's file of the stream, run, host name and clock set, until
            the agent answers
  stream    the saved stream's size (MiB): what the guest's RAM held

W is 0 and 128 MiB (disk_mb = W + 32); rounds alternate substrates. The accelerator (KVM or TCG)
is the one the node settled on, recorded with the results.

    .venv/bin/python -m bench.memsnap [--n 3] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._common import goal, log, machine, pyplot, save, stats  # noqa: E402
from corral_common.contract import subjects  # noqa: E402
from corral_common.contract.images import ImageDeleteReply, NameRequest  # noqa: E402
from corral_common.contract.messages import SnapshotRequest  # noqa: E402
from corral_common.contract.replies import SnapshotReply  # noqa: E402
from corral_node_agent.substrates.microvm_guest import GUEST_CACHE  # noqa: E402
from corral_sdk import AsyncClient  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
SUBSTRATES = ("microvm", "vm")
WRITTEN_MB = (0, 128)
MEMORY_MB = 128
GOAL_RESTORE_RATIO = 0.5  # resuming a saved guest at most half a cold boot of it


async def one(c: AsyncClient, substrate: str, written: int) -> tuple[str, dict[str, float]]:
    sizes = {"memory_mb": MEMORY_MB, "disk_mb": written + 32}
    t0 = time.perf_counter()
    src = await c.create(image="busybox", substrate=substrate, **sizes)
    cold = (time.perf_counter() - t0) * 1000
    copy = None
    try:
        if written:
            r = await src.exec(f"dd if=/dev/urandom of=/data bs=1M count={written} 2>/dev/null; echo $?", timeout_s=300)
            assert r.stdout == "0\n", r
        t0 = time.perf_counter()
        reply = await c.request(subjects.sandbox_op(src.id, "snapshot"), SnapshotRequest(memory=True), SnapshotReply, 600)
        snap = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        copy = await c.create(image=reply.image.name, substrate=substrate, **sizes)
        restore = (time.perf_counter() - t0) * 1000
        r = await copy.exec("wc -c < /data 2>/dev/null || echo 0")
        assert int(r.stdout) == written << 20, r  # the written data came along
        return reply.image.name, {"cold": cold, "snapshot": snap, "restore": restore, "stream_mb": reply.size / (1 << 20)}
    finally:
        for sb in (src, copy):
            if sb is not None:
                await sb.destroy()


async def run(args) -> dict[str, Any]:
    s = Stack(data_dir=tempfile.mkdtemp(prefix="crl-bench-", dir="/tmp"), nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR,
              monitor=False, ephemeral=True, node_args=["--substrate", "container", *(a for n in SUBSTRATES for a in ("--substrate", n))])
    await s.start()
    c = await AsyncClient.connect(s.url)
    try:
        accel = {}
        times: dict[str, dict[int, dict[str, list[float]]]] = {n: {w: {} for w in WRITTEN_MB} for n in SUBSTRATES}
        for i in range(args.n):
            for name in (SUBSTRATES if i % 2 == 0 else SUBSTRATES[::-1]):
                for w in WRITTEN_MB:
                    image, got = await one(c, name, w)
                    await c.request(subjects.IMAGE_DELETE, NameRequest(name=image), ImageDeleteReply, 60)
                    for k, v in got.items():
                        times[name][w].setdefault(k, []).append(v)
                    log(f"round {i + 1}/{args.n} {name} written {w} MiB: cold {got['cold']:.0f} ms, snapshot {got['snapshot']:.0f} ms, "
                        f"restore {got['restore']:.0f} ms, stream {got['stream_mb']:.0f} MiB")
        for name in SUBSTRATES:
            with open(f"{GUEST_CACHE}/accel-{name}") as f:
                accel[name] = f.read().strip()
        return {name: {"accel": accel[name], "by_written_mb": {
            str(w): {"ops": {k: stats(v) for k, v in times[name][w].items() if k != "stream_mb"},
                     "stream_mb": round(sum(times[name][w]["stream_mb"]) / len(times[name][w]["stream_mb"]), 1)}
            for w in WRITTEN_MB}} for name in SUBSTRATES}
    finally:
        await c.close()
        await s.stop()


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SUBSTRATES), figsize=(11, 4), sharey=True)
    ops = ("cold", "snapshot", "restore")
    for ax, name in zip(axes, SUBSTRATES):
        d = res["detail"][name]
        width = 0.8 / len(WRITTEN_MB)
        for j, w in enumerate(WRITTEN_MB):
            vals = [d["by_written_mb"][str(w)]["ops"][o]["median_ms"] for o in ops]
            ax.bar([k + j * width for k in range(len(ops))], vals, width, label=f"{w} MiB written")
        ax.set_xticks([k + width / 2 for k in range(len(ops))], ops)
        ax.set_title(f"{name} ({d['accel']}): memory snapshot and restore")
        ax.legend()
    axes[0].set_ylabel("median ms")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    detail = asyncio.run(run(args))
    summary: dict[str, Any] = {}
    goals = []
    for name in SUBSTRATES:
        summary[f"{name}_accel"] = detail[name]["accel"]
        for w in WRITTEN_MB:
            d = detail[name]["by_written_mb"][str(w)]
            for op, st in d["ops"].items():
                summary[f"{name}_w{w}_{op}_p50_ms"] = st["median_ms"]
            summary[f"{name}_w{w}_stream_mb"] = d["stream_mb"]
            ratio = round(d["ops"]["restore"]["median_ms"] / d["ops"]["cold"]["median_ms"], 3)
            summary[f"{name}_w{w}_restore_over_cold"] = ratio
            goals.append(goal(f"{name}_w{w}_restore_vs_cold_create", GOAL_RESTORE_RATIO, ratio, "x", "lower",
                              f"{name}, {w} MiB written: create from its memory snapshot p50 over a cold create of it (p50)"))
    res = {"benchmark": "memsnap", "machine": machine(), "args": vars(args), "detail": detail, "summary": summary}
    save(args.out, "memsnap", res, plot, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
