"""What a user namespace per sandbox costs: two stacks side by side in one run, one whose
node-agent gives every sandbox its own user namespace and idmapped layers (the default) and one
with `CORRAL_USERNS=off` (sandbox root is host root, as before #15's user namespaces), the same
calls alternating between them (the order flipped each round) so machine noise falls on both.

  create   `client.create(image="busybox")` through the bus, returned when the sandbox runs
  exec     `sb.exec(["true"])` on a sandbox of each
  destroy  `sb.destroy()`
  function `client.run(["true"], substrate="function")` (warm tier and slots as configured)

Warm pools are off (the default), so every create is cold: a fresh namespace, idmapped clones of
the image's layers, the overlay mounted as the sandbox's root, runc joining the namespace.

    .venv/bin/python -m bench.userns [--n 60] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._common import goal, log, pyplot, save, stats  # noqa: E402
from corral_sdk import AsyncClient  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
VARIANTS = ("userns", "host-root")
OPS = ("create", "exec", "destroy", "function")
GOAL_CREATE_RATIO = 1.25  # a cold create with a user namespace at most 1.25x one without


async def start(variant: str) -> tuple[Stack, AsyncClient]:
    if variant == "host-root":
        os.environ["CORRAL_USERNS"] = "off"
    try:
        s = Stack(data_dir=tempfile.mkdtemp(prefix="crl-bench-", dir="/tmp"), nodes=1, nats_port=free_port(),
                  image_dir=IMAGE_DIR, monitor=False, ephemeral=True)
        await s.start()
    finally:
        os.environ.pop("CORRAL_USERNS", None)
    return s, await AsyncClient.connect(s.url)


async def one_round(client: AsyncClient, out: dict[str, list[float]]) -> None:
    t = time.perf_counter()
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128)
    out["create"].append((time.perf_counter() - t) * 1000)
    try:
        t = time.perf_counter()
        r = await sb.exec(["true"])
        out["exec"].append((time.perf_counter() - t) * 1000)
        assert r.exit_code == 0, r
    finally:
        t = time.perf_counter()
        await sb.destroy()
        out["destroy"].append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    r = await client.run(["true"], image="busybox", substrate="function")
    out["function"].append((time.perf_counter() - t) * 1000)
    assert r.exit_code == 0, r


async def main_async(n: int, out_dir: str) -> None:
    stacks: dict[str, tuple[Stack, AsyncClient]] = {}
    samples: dict[str, dict[str, list[float]]] = {v: {op: [] for op in OPS} for v in VARIANTS}
    try:
        for v in VARIANTS:
            stacks[v] = await start(v)
        # the bases differ: the namespace is really there in one and not in the other
        for v in VARIANTS:
            sb = await stacks[v][1].create(image="busybox")
            m = (await sb.exec("cat /proc/self/uid_map")).stdout.split()
            await sb.destroy()
            log(f"{v}: uid_map {m}")
            assert (m[1] == "0") == (v == "host-root"), (v, m)
        for v in VARIANTS:  # warm-up (layer mounts, function slots)
            await one_round(stacks[v][1], {op: [] for op in OPS})
        for i in range(n):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            for v in order:
                await one_round(stacks[v][1], samples[v])
            if (i + 1) % 10 == 0:
                log(f"{i + 1}/{n} rounds")
    finally:
        for s, c in stacks.values():
            await c.close()
            await s.stop()
            shutil.rmtree(s.data_dir, ignore_errors=True)
    res: dict[str, Any] = {"n": n, "variants": {v: {op: stats(samples[v][op]) for op in OPS} for v in VARIANTS}}
    res["ratios_median"] = {op: round(res["variants"]["userns"][op]["median_ms"] / res["variants"]["host-root"][op]["median_ms"], 3)
                            for op in OPS}
    for op in OPS:
        a, b = res["variants"]["userns"][op], res["variants"]["host-root"][op]
        log(f"{op:9s} userns p50 {a['median_ms']:7.2f} p99 {a['p99_ms']:7.2f} | host-root p50 {b['median_ms']:7.2f} "
            f"p99 {b['p99_ms']:7.2f} | ratio {res['ratios_median'][op]}")
    goals = [goal("create_ratio", GOAL_CREATE_RATIO, res["ratios_median"]["create"], "x", "lower",
                  what="cold create p50 with a user namespace / without")]
    save(out_dir, "userns", res, plot, goals)


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(OPS))
    for k, v in enumerate(VARIANTS):
        med = [res["variants"][v][op]["median_ms"] for op in OPS]
        p99 = [res["variants"][v][op]["p99_ms"] for op in OPS]
        pos = [x + (k - 0.5) * 0.38 for x in xs]
        ax.bar(pos, med, 0.36, label=f"{v} p50")
        ax.scatter(pos, p99, marker="_", s=300, color="black", label="p99" if k == 0 else None)
    ax.set_xticks(list(xs), [f"{op}\n{res['ratios_median'][op]}x" for op in OPS])
    ax.set_ylabel("ms")
    ax.set_title(f"user namespace per sandbox vs none (n={res['n']}, alternating)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    asyncio.run(main_async(a.n, a.out))


if __name__ == "__main__":
    main()
