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

Cases, by the guest's RAM (memory_mb M) and what it wrote (W, disk_mb = W + 32): M 128 with W 0
and 128 MiB, and M 512 with W 0 (a larger guest holding as little: the stream is its touched
pages, zero pages go as flags); rounds alternate substrates. The accelerator (KVM or TCG) is the
one the node settled on, recorded with the results.

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
CASES = ((128, 0), (128, 128), (512, 0))  # (memory_mb, MiB written)
GOAL_RESTORE_RATIO = 0.5  # resuming a saved guest at most half a cold boot of it


def key(memory: int, written: int) -> str:
    return f"m{memory}_w{written}"


async def one(c: AsyncClient, substrate: str, memory: int, written: int) -> tuple[str, dict[str, float]]:
    sizes = {"memory_mb": memory, "disk_mb": written + 32}
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
        times: dict[str, dict[str, dict[str, list[float]]]] = {n: {key(*cs): {} for cs in CASES} for n in SUBSTRATES}
        for i in range(args.n):
            for name in (SUBSTRATES if i % 2 == 0 else SUBSTRATES[::-1]):
                for m, w in CASES:
                    image, got = await one(c, name, m, w)
                    await c.request(subjects.IMAGE_DELETE, NameRequest(name=image), ImageDeleteReply, 60)
                    for k, v in got.items():
                        times[name][key(m, w)].setdefault(k, []).append(v)
                    log(f"round {i + 1}/{args.n} {name} memory {m} MiB, written {w} MiB: cold {got['cold']:.0f} ms, "
                        f"snapshot {got['snapshot']:.0f} ms, restore {got['restore']:.0f} ms, stream {got['stream_mb']:.0f} MiB")
        for name in SUBSTRATES:
            with open(f"{GUEST_CACHE}/accel-{name}") as f:
                accel[name] = f.read().strip()
        return {name: {"accel": accel[name], "by_case": {
            k: {"ops": {op: stats(v) for op, v in t.items() if op != "stream_mb"},
                "stream_mb": round(sum(t["stream_mb"]) / len(t["stream_mb"]), 1)}
            for k, t in times[name].items()}} for name in SUBSTRATES}
    finally:
        await c.close()
        await s.stop()


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SUBSTRATES), figsize=(11, 4), sharey=True)
    ops = ("cold", "snapshot", "restore")
    for ax, name in zip(axes, SUBSTRATES):
        d = res["detail"][name]
        width = 0.8 / len(CASES)
        for j, (m, w) in enumerate(CASES):
            vals = [d["by_case"][key(m, w)]["ops"][o]["median_ms"] for o in ops]
            ax.bar([k + j * width for k in range(len(ops))], vals, width, label=f"{m} MiB guest, {w} MiB written")
        ax.set_xticks([k + width for k in range(len(ops))], ops)
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
        for m, w in CASES:
            k = key(m, w)
            d = detail[name]["by_case"][k]
            for op, st in d["ops"].items():
                summary[f"{name}_{k}_{op}_p50_ms"] = st["median_ms"]
            summary[f"{name}_{k}_stream_mb"] = d["stream_mb"]
            ratio = round(d["ops"]["restore"]["median_ms"] / d["ops"]["cold"]["median_ms"], 3)
            summary[f"{name}_{k}_restore_over_cold"] = ratio
            goals.append(goal(f"{name}_{k}_restore_vs_cold_create", GOAL_RESTORE_RATIO, ratio, "x", "lower",
                              f"{name}, a {m} MiB guest with {w} MiB written: create from its memory snapshot p50 "
                              "over a cold create of it (p50)"))
    res = {"benchmark": "memsnap", "machine": machine(), "args": vars(args), "detail": detail, "summary": summary}
    save(args.out, "memsnap", res, plot, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
