"""`corral eval` throughput on the demo environment, and where a rollout's time goes.

Starts its own stack, builds the demo environment, then runs `evaluate` (what `corral eval` and
`corral demo` run) with the demo's scripted policies at each concurrency asked for. Besides the
client's view (create, agent, grade per rollout), a passive tap on the bus records every request
any process makes (the grader's own sandbox ops and its monitor evaluation included) and how long
each reply took, so the grade can be split into its steps without instrumenting the services.

    python -m bench.eval_throughput [--rollouts 48] [--concurrency 8 16] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import nats

from bench._common import Goal, goal, log, pyplot, save, stats
from corral_common.contract import subjects
from corral_sdk.client import AsyncClient
from corral_sdk.demo import _scripted
from corral_sdk.demo_env import demo_spec
from corral_sdk.demo_policies import POLICIES
from corral_sdk.eval import evaluate
from corral_sdk.stack import Stack, free_port

ENV = "calc-bench"


def op_name(subject: str) -> str:
    """`<prefix>.sandbox.<id>.exec` -> `sandbox.exec`; other subjects keep their last two tokens."""
    parts = subject.split(".")
    if subject.startswith(subjects.PREFIX + ".sandbox.") and len(parts) > 4:
        return "sandbox." + ".".join(parts[4:])
    return ".".join(parts[-2:])


class Tap:
    """Every request on the v1 subjects and the time until its reply, from a plain subscriber."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[str, float]] = {}
        self.ms: dict[str, list[float]] = defaultdict(list)

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)

        async def on_req(msg) -> None:
            if msg.reply:
                self.pending[msg.reply] = (op_name(msg.subject), time.perf_counter())

        async def on_reply(msg) -> None:
            got = self.pending.pop(msg.subject, None)
            if got is not None:
                self.ms[got[0]].append((time.perf_counter() - got[1]) * 1000)

        await self.nc.subscribe(subjects.PREFIX + ".>", cb=on_req)
        await self.nc.subscribe("_INBOX.>", cb=on_reply)

    def reset(self) -> None:
        self.pending.clear()
        self.ms.clear()

    def table(self) -> dict[str, dict]:
        return {op: {k: v for k, v in stats(ms).items() if k != "samples_ms"} | {"total_s": round(sum(ms) / 1000, 2)}
                for op, ms in sorted(self.ms.items(), key=lambda kv: -sum(kv[1]))}


async def run(rollouts: int, concurrencies: list[int], nodes: int) -> dict:
    image_dir = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
    subprocess.run([sys.executable, "-m", "corral_image_cache.builtin", "build", "debian", "--root", image_dir], check=True,
                   stdout=subprocess.DEVNULL)
    stack = Stack(data_dir=tempfile.mkdtemp(prefix="crl-evb-", dir="/tmp"), nodes=nodes, nats_port=free_port(),
                  image_dir=image_dir, ephemeral=True)
    await stack.start()
    out: dict = {"env": ENV, "rollouts": rollouts, "nodes": nodes, "runs": []}
    try:
        client = await AsyncClient.connect(stack.url)
        tap = Tap()
        await tap.start(stack.url)
        res = await client.envs.build(demo_spec(ENV), job="bench")
        assert res.accepted, res.report.summary()
        pols = [_scripted(p) for p in POLICIES]
        await evaluate(client, ENV, pols, rollouts=min(8, rollouts), concurrency=4, job="warmup")
        for c in concurrencies:
            tap.reset()
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            rep = await evaluate(client, ENV, pols, rollouts=rollouts, concurrency=c, job=f"bench-c{c}")
            s = rep.summary
            log(f"concurrency {c}: {s.rollouts_per_s} rollouts/s, p50 create {s.create_s.p50}s agent {s.agent_s.p50}s "
                f"grade {s.grade_s.p50}s (load average before: {load})")
            out["runs"].append({"concurrency": c, "rollouts_per_s": s.rollouts_per_s, "wall_s": s.wall_s, "load_before": load,
                                "graded": s.graded, "errors": s.errors, "create_s": s.create_s.p50, "agent_s": s.agent_s.p50,
                                "grade_s": s.grade_s.p50, "total_s": s.total_s.p50, "ops": tap.table()})
        await tap.nc.close()
        await client.close()
    finally:
        await stack.stop()
    return out


def plot(res: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    runs = res["runs"]
    axes[0].bar([str(r["concurrency"]) for r in runs], [r["rollouts_per_s"] for r in runs], color="tab:green")
    axes[0].axhline(4.0, color="tab:red", linestyle="--", label="goal 4/s")
    axes[0].set_xlabel("concurrency")
    axes[0].set_ylabel("rollouts/s")
    axes[0].legend()
    last = runs[-1]["ops"]
    ops = list(last)[:12]
    axes[1].barh(ops, [last[o]["total_s"] for o in ops], color="tab:blue")
    axes[1].invert_yaxis()
    axes[1].set_xlabel(f"request time summed over the run at concurrency {runs[-1]['concurrency']} (s)")
    fig.suptitle(f"corral eval on the demo environment, {res['rollouts']} rollouts per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(res: dict) -> list[Goal]:
    at16 = [r["rollouts_per_s"] for r in res["runs"] if r["concurrency"] == 16]
    return [goal("rollouts_per_s_at_16", 4.0, at16[0] if at16 else None, "rollouts/s", "higher",
                 what="`corral eval` of the demo env with the ten scripted policies, rollouts finished per second",
                 note=", ".join(f"{r['rollouts_per_s']}/s at {r['concurrency']} (load {r['load_before']})" for r in res["runs"]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.rollouts, a.concurrency, a.nodes))
    save(a.out, "eval_throughput", res, plot, goals(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
