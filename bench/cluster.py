"""corral on a 3-server NATS cluster against the single embedded server, side by side in one run.

Three stacks on this machine: `single` (one nats-server, JetStream at replicas 1, one node),
`cluster` (`corral up --cluster 3`: three routed nats-servers on loopback, replicas 3, one node)
and `hosts` (`corral up --hosts 3`: three network namespaces on a bridge, each with its own
nats-server, node-agent and loader; two scheduler replicas). Measured alternately, so machine
noise falls on all alike:

  create      sequential `create` + `destroy` of a busybox container: create p50/p99;
  placements  creates in flight at once (--concurrency), sandboxes placed per second;
  publish     JetStream publish (PubAck) of a 1 KiB event to a scratch stream at replicas 1 and 3
              on the cluster, and at 1 on the single server: p50/p99;
  recovery    on the cluster: SIGKILL the nats-server a client is connected to, then the time
              until a create through that client succeeds again, and until the killed server is
              back in the replica set of every stream after its restart. On the hosts: a host
              killed (every process in its namespace, its sandboxes too): until creates work
              again, and from its restart until it takes a sandbox; a host's link cut for 8 s:
              from the heal until its sandbox answers an exec.

    .venv/bin/python -m bench.cluster [--n 40] [--concurrency 16] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

from nats.js.api import StorageType, StreamConfig

from corral_common.contract.messages import SandboxSpec
from corral_sdk import AsyncClient
from corral_sdk.stack import Stack, free_port

from ._common import goal, log, pyplot, save, stats
from .sandbox_lifecycle import DEFAULT_IMAGE_DIR, ensure_busybox

SPEC = SandboxSpec(image="busybox", cpu=0.05, memory_mb=64)


async def _create_ms(c: AsyncClient) -> float:
    t = time.perf_counter()
    sb = await c.create_spec(SPEC)
    ms = (time.perf_counter() - t) * 1000
    await sb.destroy()
    return ms


async def _placements_per_s(c: AsyncClient, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    made = []

    async def one() -> None:
        async with sem:
            made.append(await c.create_spec(SPEC, wait_for_capacity_s=60))

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    rate = n / (time.perf_counter() - t)
    await asyncio.gather(*(sb.destroy() for sb in made))
    return rate


async def _publish_ms(c: AsyncClient, replicas: int, n: int) -> list[float]:
    js = c.nc.jetstream()
    name = f"BENCH_{secrets.token_hex(4).upper()}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"bench.{name}"], storage=StorageType.FILE, num_replicas=replicas))
    payload = os.urandom(1024)
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            await js.publish(f"bench.{name}", payload)
            out.append((time.perf_counter() - t) * 1000)
    finally:
        await js.delete_stream(name)
    return out


async def _recovery(stack: Stack, c: AsyncClient) -> dict[str, float]:
    """Kill the server `c` talks to; time until a create through `c` works, and until the
    restarted server is a current replica of every stream again."""
    port = c.nc.connected_url.port if c.nc.connected_url else None
    victim = next(i for i, s in enumerate(stack.servers) if s.listen.endswith(f":{port}"))
    t0 = time.perf_counter()
    stack.kill_nats(victim)
    while True:
        try:
            await (await c.create_spec(SPEC, timeout=2)).destroy()
            break
        except Exception:  # the client is failing over, or a stream leader is being elected: try again
            await asyncio.sleep(0.05)
    create_again = time.perf_counter() - t0
    t1 = time.perf_counter()
    await stack.restart_nats(victim)
    name = stack.servers[victim].name
    js = c.nc.jetstream()
    while True:
        try:
            infos = await js.streams_info()
        except Exception:  # the meta leader is being elected again as the server rejoins: ask again
            await asyncio.sleep(0.1)
            continue
        if all(s.cluster and (s.cluster.leader == name or any(p.name == name and p.current for p in s.cluster.replicas or []))
               for s in infos):
            break
        await asyncio.sleep(0.1)
    return {"create_again_s": round(create_again, 3), "rejoined_s": round(time.perf_counter() - t1, 3)}


async def _until(what) -> float:
    """Seconds until `what()` (a coroutine function) returns true (errors count as not yet)."""
    t0 = time.perf_counter()
    while True:
        try:
            if await what():
                return round(time.perf_counter() - t0, 3)
        except Exception:  # failing over, a stream leader being elected, a node still being declared lost
            pass
        await asyncio.sleep(0.05)


async def _host_faults(stack: Stack, c: AsyncClient) -> dict[str, float]:
    """Host 2 killed and restarted; host 3's link cut for 8 s and healed."""

    async def creates() -> bool:
        await (await c.create_spec(SPEC, timeout=2)).destroy()
        return True

    def lands_on(node: str):
        async def check() -> bool:
            sb = await c.create_spec(SPEC, timeout=2)
            await sb.destroy()
            return sb.info.node == node
        return check

    stack.kill_host(1)
    out = {"host_kill_create_again_s": await _until(creates)}
    t0 = time.perf_counter()
    await stack.restart_host(1)
    await _until(lands_on("node-2"))
    out["host_restart_serving_s"] = round(time.perf_counter() - t0, 3)
    sbs = []
    while not any(sb.info.node == "node-3" for sb in sbs):
        sbs.append(await c.create_spec(SPEC))
    cut = next(sb for sb in sbs if sb.info.node == "node-3")
    stack.cut_link(2)
    await asyncio.sleep(8)
    stack.heal_link(2)

    async def answers() -> bool:
        # not waited out: a request caught in the cut gets no answer until its own timeout
        return (await asyncio.wait_for(cut.exec("echo back", timeout_s=2), 2)).stdout == "back\n"

    out["link_heal_answers_s"] = await _until(answers)
    for sb in sbs:
        await sb.destroy()
    return out


async def measure(image_dir: str, n: int, concurrency: int) -> dict[str, Any]:
    stacks = {}
    dirs = []
    try:
        for name, cluster, hosts in (("single", 1, 0), ("cluster", 3, 0), ("hosts", 3, 3)):
            d = tempfile.mkdtemp(prefix=f"bench-{name}-")
            dirs.append(d)
            stacks[name] = Stack(data_dir=d, nats_port=free_port(), cluster=cluster, hosts=hosts, nodes=max(1, hosts),
                                 image_dir=image_dir, monitor=False, env_builder=False, ephemeral=True)
            await stacks[name].start()
        clients = {name: await AsyncClient.connect(s.url) for name, s in stacks.items()}
        create: dict[str, list[float]] = {name: [] for name in stacks}
        for name, c in clients.items():  # warm-up: image layers, the first placement
            await _create_ms(c)
        for _ in range(n):
            for name, c in clients.items():
                create[name].append(await _create_ms(c))
        rates = {name: [] for name in stacks}
        for _ in range(3):
            for name, c in clients.items():
                rates[name].append(await _placements_per_s(c, n, concurrency))
        publish = {"single_r1": await _publish_ms(clients["single"], 1, n * 10),
                   "cluster_r1": await _publish_ms(clients["cluster"], 1, n * 10),
                   "cluster_r3": await _publish_ms(clients["cluster"], 3, n * 10)}
        recovery = {**await _recovery(stacks["cluster"], clients["cluster"]), **await _host_faults(stacks["hosts"], clients["hosts"])}
        for c in clients.values():
            await c.close()
        return {"create": {k: stats(v) for k, v in create.items()},
                "placements_per_s": {k: round(sorted(v)[1], 1) for k, v in rates.items()},
                "publish": {k: stats(v) for k, v in publish.items()},
                "recovery": recovery}
    finally:
        for s in stacks.values():
            await s.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(res["create"])
    axes[0].bar(names, [res["create"][k]["median_ms"] for k in names], color=["#777", "#36c", "#693"][:len(names)])
    axes[0].set_ylabel("create p50 (ms)")
    axes[0].set_title("create: one server, a 3-server cluster, 3 hosts")
    pub = list(res["publish"])
    axes[1].bar(pub, [res["publish"][k]["median_ms"] for k in pub], color=["#777", "#69c", "#36c"])
    axes[1].set_ylabel("JetStream publish p50 (ms)")
    axes[1].set_title("replicas 1 vs 3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--image-dir", default=DEFAULT_IMAGE_DIR)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    t0 = time.time()
    ensure_busybox(args.image_dir)
    res = asyncio.run(measure(args.image_dir, args.n, args.concurrency))
    c = res["create"]
    res["ratios"] = {"create_p50": round(c["cluster"]["median_ms"] / c["single"]["median_ms"], 3),
                     "create_p50_hosts": round(c["hosts"]["median_ms"] / c["single"]["median_ms"], 3),
                     "placements_per_s": round(res["placements_per_s"]["cluster"] / res["placements_per_s"]["single"], 3),
                     "publish_p50_r3_vs_r1": round(res["publish"]["cluster_r3"]["median_ms"] / res["publish"]["cluster_r1"]["median_ms"], 3)}
    res["seconds"] = round(time.time() - t0, 1)
    log(f"ratios {res['ratios']} recovery {res['recovery']}")
    goals = [goal("cluster_create_p50", 1.5, res["ratios"]["create_p50"], "x", "lower", what="cluster / single server, create p50"),
             goal("cluster_fault_recovery", 10.0, max(res["recovery"].values()), "s", "lower",
                  what="each fault (a killed nats-server, a killed host, a cut link): until creates work again, "
                       "until the restarted part serves, until the cut host answers; the longest")]
    save(args.out, "cluster", {"config": {"n": args.n, "concurrency": args.concurrency}, **res}, plot, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
