"""Resume after preemption: fast-forwarding a logged trajectory vs re-executing its steps, and
snapshot / restore time against the size of the sandbox's writable layer. Side by side in one run.

    .venv/bin/python -m bench.trajectory_resume [--steps 200] [--sizes 1,16,64,256] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench._common import Goal, goal, pyplot, save
from corral_common.contract import subjects
from corral_sdk import AsyncClient
from corral_sdk.stack import Stack, free_port

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")


def step_cmd(i: int) -> str:
    # a typical agent step: a little work and a non-idempotent side effect
    return f"mkdir -p /w && echo step-{i} >> /w/log && ls / > /dev/null && wc -l < /w/log"


async def run(steps: int, sizes: list[int]) -> dict:
    data = tempfile.mkdtemp(prefix="crl-bench-traj-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR)
    await stack.start()
    out: dict = {}
    try:
        c = await AsyncClient.connect(stack.url)
        # 1) the rollout for real, logged
        t0 = time.perf_counter()
        async with c.trajectory("bench-traj", image="busybox", cpu=0.5, memory_mb=128, snapshot_every=0) as t:
            per_exec = []
            for i in range(steps):
                s0 = time.perf_counter()
                await t.exec(step_cmd(i))
                per_exec.append((time.perf_counter() - s0) * 1000)
        first_s = time.perf_counter() - t0
        # 2) resume: the same steps again, answered from the log
        t0 = time.perf_counter()
        async with c.trajectory("bench-traj", image="busybox", cpu=0.5, memory_mb=128, snapshot_every=0) as t:
            per_replay = []
            for i in range(steps):
                s0 = time.perf_counter()
                r = await t.exec(step_cmd(i))
                per_replay.append((time.perf_counter() - s0) * 1000)
                assert r.replayed
            sb = t.sandbox
        ff_s = time.perf_counter() - t0
        # 3) baseline: re-executing the same steps without a log (what a resume costs without corral)
        fresh = await c.create(image="busybox", cpu=0.5, memory_mb=128)
        t0 = time.perf_counter()
        for i in range(steps):
            await fresh.exec(step_cmd(i))
        reexec_s = time.perf_counter() - t0
        await fresh.destroy()
        lines = (await sb.exec("wc -l < /w/log")).stdout.strip()
        out["resume"] = {
            "steps": steps, "first_run_s": round(first_s, 3), "fast_forward_s": round(ff_s, 3), "re_execute_s": round(reexec_s, 3),
            "speedup_vs_re_execute": round(reexec_s / ff_s, 1),
            "exec_step_ms": {"p50": round(statistics.median(per_exec), 3), "p99": round(sorted(per_exec)[int(0.99 * (len(per_exec) - 1))], 3)},
            "replay_step_ms": {"p50": round(statistics.median(per_replay), 3), "p99": round(sorted(per_replay)[int(0.99 * (len(per_replay) - 1))], 3)},
            "side_effect_lines_after_resume": int(lines),
        }
        await sb.destroy()
        await c.trajectories.delete("bench-traj")
        # 4) snapshot and restore vs writable-layer size
        rows = []
        for mb in sizes:
            # the writable layer is a tmpfs charged to the sandbox's memory: room for the blob
            sb = await c.create(image="busybox", cpu=0.5, memory_mb=mb + 256, disk_mb=max(1024, mb * 2))
            await sb.exec(f"head -c {mb * 1024 * 1024} /dev/urandom > /blob; sync", timeout_s=600)
            t0 = time.perf_counter()
            image = await sb.snapshot(f"bench-snap-{mb}")
            snap_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            sb2 = await c.create(image=image, cpu=0.5, memory_mb=256)
            created_s = time.perf_counter() - t0
            r = await sb2.exec("wc -c < /blob")
            first_exec_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            r2 = await sb2.exec("md5sum /blob > /dev/null")
            read_all_s = time.perf_counter() - t0
            assert int(r.stdout) == mb * 1024 * 1024 and r2.exit_code == 0
            rows.append({"size_mb": mb, "snapshot_s": round(snap_s, 3), "restore_create_s": round(created_s, 3),
                         "restore_first_exec_s": round(first_exec_s, 3), "read_whole_layer_s": round(read_all_s, 3)})
            for s in (sb, sb2):
                await s.destroy()
            msg = await c.nc.request(subjects.IMAGE_DELETE, json.dumps({"name": image}).encode(), timeout=60)
            assert json.loads(msg.data)["ok"]
        out["snapshot_restore"] = rows
        await c.close()
    finally:
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)
    return out


def plot(res: dict, path: str) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    r = res["resume"]
    names = ["first run (logged)", "re-execute", "fast-forward"]
    vals = [r["first_run_s"], r["re_execute_s"], r["fast_forward_s"]]
    a.bar(names, vals, color=["#888", "#c55", "#5a5"])
    a.set_ylabel("seconds")
    a.set_title(f"resume a {r['steps']}-step trajectory ({r['speedup_vs_re_execute']}x)")
    rows = res["snapshot_restore"]
    x = [row["size_mb"] for row in rows]
    for key, label in (("snapshot_s", "snapshot"), ("restore_first_exec_s", "restore: create + first exec"), ("read_whole_layer_s", "then read all of it")):
        b.plot(x, [row[key] for row in rows], marker="o", label=label)
    b.set_xscale("log", base=2)
    b.set_xlabel("writable layer size (MiB)")
    b.set_ylabel("seconds")
    b.set_title("snapshot and restore vs size")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    r = res["resume"]
    return [goal("fast_forward_speedup", 50, r["speedup_vs_re_execute"], "x", "higher",
                 f"{r['steps']} steps replayed from the log / re-executed (speed-up)",
                 note=f"{r['fast_forward_s']} / {r['re_execute_s']} s; step p50 replay {r['replay_step_ms']['p50']} ms, "
                 f"exec {r['exec_step_ms']['p50']} ms")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    res = asyncio.run(run(args.steps, [int(s) for s in args.sizes.split(",")]))
    save(args.out, "trajectory_resume", res, plot, goals(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
