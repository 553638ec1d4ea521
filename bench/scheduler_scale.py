"""Scale by simulation: many simulated nodes (node-protocol stand-ins on the real bus, see
tests/simnode.py) and hundreds of thousands of live sandboxes in the scheduler's state; measures
placements per second through create_batch, the scheduler's memory, and fairness between two
jobs placing at once.

    .venv/bin/python -m bench.scheduler_scale [--nodes 1000] [--live 380000] [--batch 5000] [--out bench/results]
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

import msgspec
import nats

from corral_common.contract import subjects
from corral_common.contract.messages import SandboxInfo, encoder
from corral_sdk.stack import Stack, free_port

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import Goal, goal, pyplot, save

GOAL_PER_S = 10_000
from tests.simnode import SimNode  # noqa: E402


class _Reply(msgspec.Struct):
    """What a client keeps of a create_batch reply (typed: decodes faster than plain dicts)."""

    ok: bool
    sandboxes: list[SandboxInfo] = []
    failed: list[dict] = []
    error: dict | None = None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (load-independent, unlike wall-clock rates)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_profiles(pids: dict[str, int], out_dir: str) -> list:
    """py-spy (if installed) sampling each process while the rounds run: raw folded stacks."""
    import signal
    import subprocess

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("py-spy not found: no profiles", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    procs = [subprocess.Popen([spy, "record", "-p", str(pid), "-f", "raw", "-r", "200", "--nonblocking", "-o",
                               os.path.join(out_dir, f"{name}.folded")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()]
    return [(p, signal.SIGINT) for p in procs]


def stop_profiles(procs: list) -> None:
    for p, sig in procs:
        p.send_signal(sig)
    for p, _ in procs:
        try:
            p.wait(timeout=30)
        except Exception:
            p.kill()


async def run(n_nodes: int, live: int, batch: int, rounds: int, profile: str = "") -> dict:
    data = tempfile.mkdtemp(prefix="crl-bench-sched-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=0, nats_port=free_port(), image_dir=os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images"))
    await stack.start(timeout=120)
    sched_pid = stack.proc("scheduler").popen.pid
    out: dict = {"nodes": n_nodes, "live_sandboxes": live, "loadavg_before": os.getloadavg()}
    conns = [await nats.connect(stack.url, pending_size=256 * 1024 * 1024) for _ in range(4)]
    try:
        rss0 = rss_mb(sched_pid)
        # the simulated nodes, each already holding its share of the live sandboxes
        nodes = []
        per = live // n_nodes
        now = time.time()
        for i in range(n_nodes):
            n = SimNode(conns[i % len(conns)], f"sim-{i:04d}", cpu=32.0, memory_mb=1_000_000, sandboxes=10_000, cpu_overcommit_max=8.0)
            for j in range(per):
                sid = f"sb-{i:04d}{j:08x}"
                n.add(SandboxInfo(id=sid, node=n.name, state="running", substrate="container", image="busybox",
                                               created_at=now, expires_at=now + 86400, job=f"bg-{j % 20}", cpu=0.05, memory_mb=64))
            nodes.append(n)
        t0 = time.perf_counter()
        await asyncio.gather(*(n.start(interval=2.0) for n in nodes))
        out["nodes_started_s"] = round(time.perf_counter() - t0, 2)
        # their sandboxes into the placements KV, which the scheduler watches
        t0 = time.perf_counter()
        # acked (pipelined through one inbox): unacked publishes at this rate are dropped by JetStream
        from corral_common.bus import Scatter

        sc = await Scatter(conns[0]).start()
        infos = [info for n in nodes for info in n.sandboxes.values()]
        missing = 0
        for j in range(0, len(infos), 5000):
            reqs = [(subjects.kv_key(subjects.KV_PLACEMENTS, i.id), encoder.encode(i), None) for i in infos[j:j + 5000]]
            async for _, m in sc.requests(reqs, timeout=120):
                missing += m is None or b'"error"' in m.data
        out["live_write_failures"] = missing
        out["live_written_s"] = round(time.perf_counter() - t0, 2)
        # let the watcher take it all in: the background jobs' totals reach `live`
        bg = [f"bg-{j}" for j in range(min(20, per))]
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 120:
            seen = 0
            for job in bg:
                r = json.loads((await conns[0].request(subjects.QUOTA_GET, json.dumps({"job": job}).encode(), timeout=30)).data)
                seen += r.get("used", {}).get("sandboxes", 0) if r.get("ok") else 0
            if seen >= per * n_nodes:
                break
            await asyncio.sleep(0.5)
        out["live_ingested_s"] = round(time.perf_counter() - t0, 2)
        out["live_seen_by_scheduler"] = seen
        lost: list[str] = []

        async def on_lost(m) -> None:
            lost.append(m.subject)

        await conns[0].subscribe(subjects.node_event("*", "lost"), cb=on_lost)
        out["scheduler_rss_mb"] = {"empty": round(rss0, 1), "with_live_state": round(rss_mb(sched_pid), 1)}
        # placements: two jobs placing batches at once
        nc = conns[0]
        rates = []
        run_id = os.urandom(4).hex()
        pids = {"scheduler": sched_pid, "nats_server": stack.proc("nats-server").popen.pid, "bench_and_sim_nodes": os.getpid()}
        cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        spies = start_profiles({"scheduler": sched_pid, "bench": os.getpid()}, profile) if profile else []
        await asyncio.sleep(1.0 if spies else 0)
        per_job = {"job-a": 0, "job-b": 0}
        failed = 0
        for r in range(rounds):
            async def one(job: str):
                # with a request_id, as a trainer that retries would send it (idempotent batches)
                spec = {"image": "busybox", "cpu": 0.01, "memory_mb": 16, "job": job, "request_id": f"bench-{job}-{r}-{run_id}"}
                body = json.dumps({"spec": spec, "count": batch}).encode()
                msg = await nc.request(subjects.SANDBOX_CREATE_BATCH, body, timeout=600)
                return job, msgspec.json.decode(msg.data, type=_Reply)

            t0 = time.perf_counter()
            res = await asyncio.gather(one("job-a"), one("job-b"))
            dt = time.perf_counter() - t0
            placed = 0
            for job, rep in res:
                got = len(rep.sandboxes)
                per_job[job] += got
                placed += got
                failed += len(rep.failed) if rep.ok else batch
            rates.append(placed / dt)
        cpu_used = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
        stop_profiles(spies)
        total = sum(per_job.values())
        # CPU per placement is what the machine's load does not change much: the wall-clock rate
        # above depends on how many of the 2 cores the other tenants leave free
        out["cpu_us_per_placement"] = {k: round(v / max(1, total) * 1e6, 1) for k, v in cpu_used.items()}
        out["scheduler_placements_per_cpu_s"] = round(total / max(1e-9, cpu_used["scheduler"]))
        out["placements_per_s"] = {"rounds": [round(x) for x in rates], "median": round(sorted(rates)[len(rates) // 2])}
        out["node_requests"] = sum(n.batches for n in nodes)
        out["node_items"] = sum(n._seen for n in nodes)
        out["nodes_declared_lost"] = len(lost)  # must be 0: a loaded machine that misses heartbeats spoils the run
        out["fairness"] = {"placed_by_job": per_job, "ratio": round(min(per_job.values()) / max(1, max(per_job.values())), 3), "failed": failed}
        out["scheduler_rss_mb"]["after"] = round(rss_mb(sched_pid), 1)
        out["loadavg_after"] = os.getloadavg()
        for n in nodes:
            await n.stop(forget=False)
    finally:
        for c in conns:
            await c.close()
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)
    return out


def plot(res: dict, path: str) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(range(len(res["placements_per_s"]["rounds"])), res["placements_per_s"]["rounds"], color="#57a")
    a.axhline(GOAL_PER_S, color="#c55", ls="--", label="goal")
    load = res.get("loadavg_before", [0])[0]
    a.set_title(f"placements/s ({res['nodes']} sim nodes, {res['live_sandboxes']:,} live)\n"
                f"2-core host, load average {load:.1f} at start", fontsize=9)
    a.set_xlabel("round")
    a.legend()
    m = res["scheduler_rss_mb"]
    b.bar(list(m), list(m.values()), color="#5a5")
    b.set_title("scheduler RSS (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    r = res["placements_per_s"]
    return [goal("placements_per_s", GOAL_PER_S, r["median"], "placements/s", "higher", "placements per second, median round",
                 note=f"rounds {min(r['rounds'])}-{max(r['rounds'])}; {res['nodes_declared_lost']} nodes declared lost")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--live", type=int, default=380_000)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="", help="directory for py-spy profiles of the scheduler and this process")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON in --out")
    args = ap.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out, "scheduler_scale.json")) as f:
            plot(json.load(f), os.path.join(args.out, "scheduler_scale.png"))
        return 0
    res = asyncio.run(run(args.nodes, args.live, args.batch, args.rounds, args.profile))
    save(args.out, "scheduler_scale", res, plot, goals(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
