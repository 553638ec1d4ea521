"""Warm-pool benchmark: create->ready through the bus (SDK -> scheduler -> node-agent -> reply)
for a create that claims a warm (pre-created, frozen) sandbox vs a cold create, side by side.

Two embedded stacks, one after the other, identical but for the node-agent's warm pool:
  pooled  `--warm-pool busybox=4`: each create claims a warm busybox sandbox (hits are checked
          on the `created` event: reason "claimed from the warm pool"); after each create the
          bench waits `--gap` seconds so the pool refills (it measures the claim, not a drained pool)
  cold    no pool: each create builds the sandbox (layers, overlay, runc run, init start).
Every sandbox is destroyed after its create, off the clock. Also reported: the node-side claim
time (corral_warm_pool_claim_seconds) and create time (corral_sandbox_create_seconds) from the
node-agent's metrics, so the bus/scheduler share of the latency is visible.

Also measured, interleaved with the creates: a bare request/reply to the node-agent
(`corral.node.<node>.ping`), the floor any bus round trip pays on this (shared, loaded) machine;
a create through the scheduler makes two such round trips (client -> scheduler -> node).

Goal: pooled create p50 <= 5 ms.

    .venv/bin/python -m bench.warm_pool [--n 150] [--gap 0.3] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from typing import Any

import msgspec
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench._common import Goal, goal, save  # noqa: E402

try:
    from corral_common.contract import subjects
    from corral_common.contract.messages import Event, Heartbeat
except ImportError:  # warm_pool_compare runs this file against trees from before the contract package
    from corral_common import subjects  # type: ignore[attr-defined,no-redef]
    from corral_common.messages import Event, Heartbeat  # type: ignore[import-not-found,no-redef]
from corral_sdk import AsyncClient  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
GOAL_P50_MS = 5.0


def stats(ms: list[float]) -> dict:
    if not ms:
        return {"n": 0}
    a = np.asarray(ms)
    return {"n": int(a.size), "p50_ms": round(float(np.median(a)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "mean_ms": round(float(a.mean()), 3),
            "min_ms": round(float(a.min()), 3), "max_ms": round(float(a.max()), 3), "samples_ms": [round(float(x), 3) for x in a]}


def histogram_mean(metrics_url: str, name: str) -> float | None:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            s += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            c += float(line.rsplit(" ", 1)[1])
    return round(s / c * 1000, 3) if c else None


def counter_total(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def measure(pool: bool, n: int, gap: float) -> dict:
    data = tempfile.mkdtemp(prefix="crl-wp-", dir="/tmp")
    args = ["--heartbeat-s", "0.25"] + (["--warm-pool", "busybox=4"] if pool else [])
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, node_args=args)
    await stack.start()
    try:
        c = await AsyncClient.connect(stack.url)
        reasons: dict[str, str] = {}
        hb_box: list[Heartbeat] = []

        async def on_event(m) -> None:
            e = msgspec.json.decode(m.data, type=Event)
            if e.kind == "created":
                reasons[e.sandbox_id] = e.reason

        async def on_hb(m) -> None:
            hb_box.append(msgspec.json.decode(m.data, type=Heartbeat))

        await c.nc.subscribe(subjects.event("*", "created"), cb=on_event)
        await c.nc.subscribe(subjects.NODE_HEARTBEAT, cb=on_hb)
        deadline = time.monotonic() + 60
        while pool and not (hb_box and hb_box[-1].warm.get("busybox") == 4) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for _ in range(5):  # warm up the path (connections, caches)
            sb = await c.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
            await sb.destroy()
            await asyncio.sleep(gap)
        lat, hit, ping = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await c.nc.request(subjects.node_ping("node-1"), b"{}", timeout=10)
            ping.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            sb = await c.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
            lat.append((time.perf_counter() - t0) * 1000)
            # off the clock: the created event says whether it was a claim (it may follow the reply)
            until = time.monotonic() + 5
            while sb.id not in reasons and time.monotonic() < until:
                await asyncio.sleep(0.005)
            hit.append(reasons.get(sb.id, "") == "claimed from the warm pool")
            await sb.destroy()
            await asyncio.sleep(gap)
        metrics_url = hb_box[-1].metrics_url if hb_box else ""
        out = {
            "all": stats(lat),
            "node_ping": stats(ping),  # a bare bus round trip to the node-agent: the floor under this load
            "hits": sum(hit),
            "hit_rate": round(sum(hit) / len(hit), 3),
            "claimed": stats([ms for ms, h in zip(lat, hit) if h]) if pool else None,
            "node_create_mean_ms": histogram_mean(metrics_url, "corral_sandbox_create_seconds") if metrics_url else None,
            "node_claim_mean_ms": histogram_mean(metrics_url, "corral_warm_pool_claim_seconds") if metrics_url and pool else None,
            # the node's own count (warm-up creates included): a check on the event-based hits
            "node_pool_hits": counter_total(metrics_url, "corral_warm_pool_hits_total") if metrics_url and pool else None,
            "node_pool_misses": counter_total(metrics_url, "corral_warm_pool_misses_total") if metrics_url and pool else None,
        }
        await c.close()
        return out
    finally:
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["pooled (warm claim)", "cold create"]
    data = [res["pooled"]["all"]["samples_ms"], res["cold"]["all"]["samples_ms"]]
    ax1.boxplot(data, showfliers=False)
    ax1.set_xticks([1, 2], names)
    ax1.set_yscale("log")
    ax1.set_ylabel("create -> ready through the bus (ms, log)")
    ax1.axhline(GOAL_P50_MS, color="g", ls="--", lw=1, label=f"goal: pooled p50 <= {GOAL_P50_MS:g} ms")
    ax1.legend(loc="upper left", fontsize=8)
    x = np.arange(2)
    p50 = [res["pooled"]["all"]["p50_ms"], res["cold"]["all"]["p50_ms"]]
    p99 = [res["pooled"]["all"]["p99_ms"], res["cold"]["all"]["p99_ms"]]
    ax2.bar(x - 0.2, p50, 0.4, label="p50")
    ax2.bar(x + 0.2, p99, 0.4, label="p99")
    for i, (a, b) in enumerate(zip(p50, p99)):
        ax2.text(i - 0.2, a, f"{a:.1f}", ha="center", va="bottom", fontsize=8)
        ax2.text(i + 0.2, b, f"{b:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, names)
    ax2.set_ylabel("ms")
    ax2.legend()
    fig.suptitle(f"warm pool vs cold create (busybox, {res['n']} each; load avg {res['machine']['loadavg_start']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    p = res["pooled"]["all"]
    return [goal("pooled_create_p50_ms", GOAL_P50_MS, p["p50_ms"], "ms", "lower", "create->ready p50 through the bus of a pool claim",
                 note=f"p99 {p.get('p99_ms')} ms, hit rate {res['pooled']['hit_rate']}; cold p50 {res['cold']['all']['p50_ms']} ms "
                 f"({res['speedup_p50']}x)")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="creates per mode (pooled, cold); 100 gives a stable p50 and "
                    "p99 from the 99th sample")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between creates (lets the pool refill)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res: dict = {"n": a.n, "gap_s": a.gap, "machine": {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}}
    res["pooled"] = asyncio.run(measure(True, a.n, a.gap))
    res["cold"] = asyncio.run(measure(False, a.n, a.gap))
    p50 = res["pooled"]["all"]["p50_ms"]
    res["speedup_p50"] = round(res["cold"]["all"]["p50_ms"] / p50, 2)
    save(a.out, "warm_pool", res, plot, goals(res))
    brief = {k: {kk: vv for kk, vv in v["all"].items() if kk != "samples_ms"} for k, v in res.items() if k in ("pooled", "cold")}
    brief["node_ping"] = {k: v for k, v in res["pooled"]["node_ping"].items() if k != "samples_ms"}
    print(json.dumps({"summary": brief, "hit_rate": res["pooled"]["hit_rate"], "node_claim_mean_ms": res["pooled"]["node_claim_mean_ms"],
                      "node_create_mean_ms": {k: res[k]["node_create_mean_ms"] for k in ("pooled", "cold")},
                      "machine": res["machine"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
