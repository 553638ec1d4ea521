"""Density on one node: how many idle container sandboxes one node-agent keeps alive on this
machine, what each costs the host in memory, and how create latency holds up as they pile up.

One embedded stack (nats-server, scheduler, image-cache + loader, one node-agent with only the
container substrate, no monitor). Idle busybox sandboxes (cpu 0.005, memory_mb 16: they only run
their init) are created through the bus (SDK, 8 at a time) up to each level of `--levels`; at each
level:
  - create latency: `--k` sequential creates through the bus, each destroyed right after (off the
    clock), so the level stays put; p50 and p99;
  - host memory: MemAvailable, Slab (reclaimable/unreclaimable), PageTables, KernelStack from
    /proc/meminfo, the memory cgroup usage of the node's cgroup parent (every sandbox's memcg,
    kernel memory charged to it included), and the RSS of the node-agent and nats-server.
Host memory per sandbox = drop in MemAvailable since level 0 / sandboxes alive (other workers
share this machine, so the breakdown is reported too: memcg + agent RSS + nats RSS + unreclaimable
slab + page tables + kernel stacks).
At the end every sandbox is destroyed and the node is checked for leftovers (sandbox dirs,
mounts, cgroups, runc containers) and corral-init processes.

Goals: 2,000 alive at <= 4 MiB host memory each; create p50 at 2,000 alive <= 2x the p50 at 0.
The node offers `--memory-mb 40000`: 2,000 x 16 MiB of requests is more than this machine's RAM
(the scheduler treats memory requests as hard limits); idle sandboxes use a fraction of it.

    .venv/bin/python -m bench.density [--levels 0,500,1000,2000] [--k 40] [--out bench/results]
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
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench._common import Goal, goal, save  # noqa: E402
from corral_sdk import AsyncClient  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402
from tests import leaks  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
SPEC = {"image": "busybox", "cpu": 0.005, "memory_mb": 16, "disk_mb": 16, "ttl_s": 7 * 86400}
MiB = 1024 * 1024
GOAL_MIB = 4.0
GOAL_RATIO = 2.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def host_mounts() -> int:
    """Mounts in the host's table: each is copied into every new sandbox's mount namespace."""
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"n": int(a.size), "p50_ms": round(float(np.median(a)), 2), "p90_ms": round(float(np.percentile(a, 90)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2),
            "samples_ms": [round(float(x), 2) for x in a]}


class Probe:
    def __init__(self, stack: Stack):
        self.stack = stack
        self.agent = stack.proc("node-1").popen.pid
        self.nats = stack.proc("nats-server").popen.pid
        self.cg = leaks.cgroup_parent(stack.data_dir, "node-1").strip("/")

    def snapshot(self) -> dict[str, int]:
        m = meminfo()
        return {"mem_available": m["MemAvailable"], "slab_unreclaimable": m["SUnreclaim"], "slab_reclaimable": m["SReclaimable"],
                "page_tables": m["PageTables"], "kernel_stack": m["KernelStack"], "shmem": m["Shmem"],
                "percpu": m.get("Percpu", 0), "vmalloc": m.get("VmallocUsed", 0),
                "memcg": read_int(f"/sys/fs/cgroup/memory/{self.cg}/memory.usage_in_bytes"),
                "memcg_kmem": read_int(f"/sys/fs/cgroup/memory/{self.cg}/memory.kmem.usage_in_bytes"),
                "agent_rss": rss(self.agent), "nats_rss": rss(self.nats), "agent_fds": nfds(self.agent)}


async def fill(c: AsyncClient, alive: list, target: int, conc: int = 8) -> float:
    sem = asyncio.Semaphore(conc)
    t0 = time.perf_counter()

    async def one() -> None:
        async with sem:
            for attempt in range(5):
                try:
                    alive.append(await c.create(**SPEC, timeout=120))
                    return
                except Exception as e:  # noqa: BLE001 - retried, then reported
                    if attempt == 4:
                        raise
                    log(f"create failed ({e}); retrying")
                    await asyncio.sleep(1)

    await asyncio.gather(*(one() for _ in range(target - len(alive))))
    return time.perf_counter() - t0


async def latency(c: AsyncClient, k: int) -> list[float]:
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        sb = await c.create(**SPEC, timeout=120)
        out.append((time.perf_counter() - t0) * 1000)
        await sb.destroy()
        await asyncio.sleep(0.05)
    return out


async def run(levels: list[int], k: int) -> dict:
    data = tempfile.mkdtemp(prefix="crl-dn-", dir="/tmp")
    logs = os.environ.get("DENSITY_LOG_DIR") or tempfile.mkdtemp(prefix="corral-density-logs-")
    log(f"service logs in {logs}")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, monitor=False, log_dir=logs,
                  node_args=["--substrate", "container", "--memory-mb", "40000", "--max-sandboxes", "4096"])
    await stack.start()
    res: dict = {"levels": []}
    alive: list = []
    try:
        c = await AsyncClient.connect(stack.url)
        probe = Probe(stack)
        await latency(c, 5)  # warm up
        await asyncio.sleep(2)
        base = probe.snapshot()
        res["base"] = base
        for level in levels:
            fill_s = await fill(c, alive, level) if level > len(alive) else 0.0
            log(f"{len(alive)} alive (filled in {fill_s:.1f} s); settling")
            await asyncio.sleep(5)
            snap = probe.snapshot()
            n = len(alive)
            delta = {key: snap[key] - base[key] for key in snap}
            per = {key: round(v / n / MiB, 3) for key, v in delta.items()} if n else {}
            accounted = (delta["memcg"] + delta["agent_rss"] + delta["nats_rss"] + delta["page_tables"] + delta["kernel_stack"]
                         + delta["percpu"] + max(0, delta["slab_unreclaimable"] - delta["memcg_kmem"]))
            lat = await latency(c, k)
            row = {"alive": n, "fill_s": round(fill_s, 2), "fill_per_s": round((n - (res["levels"][-1]["alive"] if res["levels"] else 0)) / fill_s, 1) if fill_s else None,
                   "snapshot": snap, "delta": delta,
                   "per_sandbox_mib": {"host_mem_available_drop": round(-delta["mem_available"] / n / MiB, 3) if n else None,
                                       "accounted": round(accounted / n / MiB, 3) if n else None, **per},
                   "create": stats(lat), "host_mounts": host_mounts(), "loadavg": [round(x, 2) for x in os.getloadavg()]}
            res["levels"].append(row)
            log(f"{n} alive: create p50 {row['create']['p50_ms']} ms p99 {row['create']['p99_ms']} ms; "
                f"host memory per sandbox {row['per_sandbox_mib']['host_mem_available_drop']} MiB "
                f"(accounted {row['per_sandbox_mib']['accounted']}); agent fds {snap['agent_fds']}; host mounts {row['host_mounts']}; "
                f"load {row['loadavg']}")
        before_destroy = probe.snapshot()
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(16)

        failed: list[str] = []

        async def gone(sb) -> None:
            async with sem:
                try:
                    await sb.destroy()
                except Exception as e:  # noqa: BLE001 - counted and reported
                    failed.append(f"{sb.id}: {e}")

        await asyncio.gather(*(gone(sb) for sb in alive))
        res["destroy_all_s"] = round(time.perf_counter() - t0, 2)
        res["destroy_failed"] = failed[:20]
        res["destroy_failed_count"] = len(failed)
        res["agent_alive_after_destroy"] = stack.proc("node-1").popen.poll() is None
        await asyncio.sleep(3)
        res["after_destroy"] = after = probe.snapshot()
        # a second, short-interval estimate: what destroying them all gave back (less exposed to
        # other workers' memory churn than the drop since the start)
        res["released_per_sandbox_mib"] = {k: round((after[k] - before_destroy[k]) / max(1, len(alive)) / MiB, 3)
                                           for k in ("mem_available", "memcg", "slab_unreclaimable", "percpu", "page_tables")}
        left = leaks.node_leftovers(data, "node-1")
        # the image loader's FUSE mount and the shared layer mounts belong to the node, not to sandboxes
        left["mounts"] = [m for m in left["mounts"] if "/sandboxes/" in m]
        res["leftovers"] = {k: len(v) for k, v in left.items()}
        res["leftover_samples"] = {k: v[:10] for k, v in left.items() if v}
        res["inits_left"] = len(leaks.inits_of_node(data, "node-1"))
        log(f"destroyed {len(alive)} in {res['destroy_all_s']} s; leftovers {res['leftovers']}, inits {res['inits_left']}")
        alive.clear()
        await c.close()
    finally:
        if alive:  # a failed run: destroy what is left before the stack stops (its stop has a time limit)
            log(f"destroying {len(alive)} sandboxes left by a failed run")
            sem = asyncio.Semaphore(16)

            async def drop(sb) -> None:
                async with sem:
                    try:
                        await sb.destroy()
                    except Exception:  # noqa: BLE001 - best effort
                        pass

            await asyncio.gather(*(drop(sb) for sb in alive))
        await stack.stop(timeout=300)
        shutil.rmtree(data, ignore_errors=True)
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["levels"]
    x = [r["alive"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(x, [r["create"]["p50_ms"] for r in rows], "o-", label="create p50")
    ax1.plot(x, [r["create"]["p99_ms"] for r in rows], "s--", label="create p99")
    ax1.axhline(rows[0]["create"]["p50_ms"] * GOAL_RATIO, color="g", ls=":", label="goal: p50 <= 2x p50 at 0")
    ax1.set_xlabel("idle sandboxes alive on the node")
    ax1.set_ylabel("create -> ready through the bus (ms)")
    ax1.legend(fontsize=8)
    xs = [r["alive"] for r in rows if r["alive"]]
    ax2.plot(xs, [r["per_sandbox_mib"]["host_mem_available_drop"] for r in rows if r["alive"]], "o-", label="MemAvailable drop / sandbox")
    ax2.plot(xs, [r["per_sandbox_mib"]["accounted"] for r in rows if r["alive"]], "s--", label="accounted (memcg+RSS+slab+percpu+pt+stacks)")
    ax2.plot(xs, [r["per_sandbox_mib"]["memcg"] for r in rows if r["alive"]], "^:", label="sandbox memcgs")
    ax2.axhline(GOAL_MIB, color="g", ls=":", label=f"goal: <= {GOAL_MIB:g} MiB")
    ax2.set_xlabel("idle sandboxes alive on the node")
    ax2.set_ylabel("host memory per sandbox (MiB)")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    fig.suptitle(f"density on one node ({os.cpu_count()} cores, {meminfo()['MemTotal'] // MiB // 1024} GiB; "
                 f"load avg at start {res['machine']['loadavg_before']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    first, last = res["levels"][0], res["levels"][-1]
    per = last["per_sandbox_mib"]["host_mem_available_drop"]
    ratio = round(last["create"]["p50_ms"] / first["create"]["p50_ms"], 2)
    left = sum(res["leftovers"].values())
    left += res["inits_left"] + (res["destroy_failed_count"] or 0)
    return [
        goal("alive", 2000, last["alive"], "sandboxes", "higher", "sandboxes alive on one node"),
        goal("host_mib_per_sandbox", GOAL_MIB, per, "MiB", "lower",
             "accounted host memory per sandbox (memcg, agent and nats RSS, page tables, kernel stacks, per-cpu, unreclaimable slab)"),
        goal("create_p50_ratio_top_vs_0", GOAL_RATIO, ratio, "x", "lower", f"create p50 at {last['alive']} alive / at {first['alive']}",
             note=" / ".join(f"{r['create']['p50_ms']:.0f}" for r in res["levels"]) + f" ms p50 at {' / '.join(str(r['alive']) for r in res['levels'])} alive"),
        goal("nothing_left", 0, left, "leftovers", "lower",
             "sandbox dirs, mounts, cgroups, runc state, inits and failed destroys after destroying all",
             note=f"all destroyed in {res['destroy_all_s']:.0f} s"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="0,500,1000,2000")
    ap.add_argument("--k", type=int, default=40, help="creates measured at each level")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    os.makedirs(a.out, exist_ok=True)
    machine = {"mem_total_mib": meminfo()["MemTotal"] // MiB}
    res = asyncio.run(run(levels, a.k))
    res["machine"] = machine
    save(a.out, "density", res, plot, goals(res))
    print(json.dumps({"released_per_sandbox_mib": res["released_per_sandbox_mib"], "destroy_all_s": res["destroy_all_s"],
                      "levels": [{"alive": r["alive"], "create": {k: v for k, v in r["create"].items() if k != "samples_ms"},
                                  "per_sandbox_mib": r["per_sandbox_mib"], "agent_fds": r["snapshot"]["agent_fds"],
                                  "loadavg": r["loadavg"]} for r in res["levels"]]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
