"""Warm-pool create latency, two versions of corral side by side: `bench.warm_pool` run for an
earlier commit (`--before`, extracted with `git archive` into a temp dir and put first on
PYTHONPATH, so every service of its stack runs that code) and for the working tree, alternating
(before/after, then after/before, ...) for `--rounds` rounds so the load of this shared machine
falls on both alike. Reports per round and over all samples the pooled and cold create p50/p99
through the bus, the node-side means and a bare bus round trip; writes
`warm_pool_compare.json` + `.png` and, from the last run of the working tree, the usual
`warm_pool.json` + `.png`. Both versions are driven by this tree's bench code; only the code of
the stack's services (every process started with the before tree first on PYTHONPATH) differs.

    .venv/bin/python -m bench.warm_pool_compare --before REV [--rounds 3] [--n 100] [--gap 0.3] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench._common import Goal, goal, save  # noqa: E402

BEFORE = "40619f0"  # the warm pool before the node answered the client directly (0b63b7a)
GOAL_P50_MS = 5.0
PKG_DIRS = ["", "libs/common", "libs/sdk", "services/scheduler", "services/node-agent", "services/image-cache",
            "services/monitor", "services/env-builder"]


def extract(rev: str) -> str:
    d = tempfile.mkdtemp(prefix="crl-before-", dir="/tmp")
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
    return d


def run(tree: str, n: int, gap: float) -> dict:
    out = tempfile.mkdtemp(prefix="crl-wpc-", dir="/tmp")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.join(tree, p) for p in PKG_DIRS)
    try:
        # the same bench code (this tree's) for both: only the services' code differs
        subprocess.run([sys.executable, "-m", "bench.warm_pool", "--n", str(n), "--gap", str(gap), "--out", out],
                       cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "warm_pool.json")) as f:
            res = json.load(f)
        res["_dir"] = out
        return res
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def brief(samples: list[float]) -> dict:
    a = np.asarray(samples)
    return {"n": int(a.size), "p50_ms": round(float(np.median(a)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3)}


def summary(runs: list[dict]) -> dict:
    pooled = [x for r in runs for x in r["pooled"]["all"]["samples_ms"]]
    cold = [x for r in runs for x in r["cold"]["all"]["samples_ms"]]
    ping = [x for r in runs for x in r["pooled"]["node_ping"]["samples_ms"]]
    return {
        "pooled": brief(pooled), "cold": brief(cold), "node_ping": brief(ping),
        "pooled_p50_per_round": [r["pooled"]["all"]["p50_ms"] for r in runs],
        "cold_p50_per_round": [r["cold"]["all"]["p50_ms"] for r in runs],
        "hit_rate": round(float(np.mean([r["pooled"]["hit_rate"] for r in runs])), 3),
        "node_pool_hits_misses": [[r["pooled"].get("node_pool_hits"), r["pooled"].get("node_pool_misses")] for r in runs],
        "node_claim_mean_ms": [r["pooled"]["node_claim_mean_ms"] for r in runs],
        "node_create_mean_ms_pooled": [r["pooled"]["node_create_mean_ms"] for r in runs],
        "loadavg": [r["machine"]["loadavg_start"][0] for r in runs],
    }


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    b, a = res["before"], res["after"]
    ax1.boxplot([b["samples_pooled"], a["samples_pooled"]], showfliers=False)
    ax1.set_xticks([1, 2], [f"before ({res['before_rev'][:7]})", "after"])
    ax1.axhline(GOAL_P50_MS, color="g", ls="--", lw=1, label="goal: pooled p50 <= 5 ms")
    ax1.set_ylabel("pooled create -> ready through the bus (ms)")
    ax1.legend(loc="upper right", fontsize=8)
    x = np.arange(len(b["summary"]["pooled_p50_per_round"]))
    ax2.bar(x - 0.2, b["summary"]["pooled_p50_per_round"], 0.4, label="before")
    ax2.bar(x + 0.2, a["summary"]["pooled_p50_per_round"], 0.4, label="after")
    for i, (p, q) in enumerate(zip(b["summary"]["pooled_p50_per_round"], a["summary"]["pooled_p50_per_round"])):
        ax2.text(i - 0.2, p, f"{p:.1f}", ha="center", va="bottom", fontsize=8)
        ax2.text(i + 0.2, q, f"{q:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, [f"round {i + 1}" for i in x])
    ax2.set_ylabel("pooled p50 (ms)")
    ax2.legend()
    fig.suptitle(f"warm-pool create, before vs after, alternating runs of {res['n']} (p50 {b['summary']['pooled']['p50_ms']:.2f}"
                 f" -> {a['summary']['pooled']['p50_ms']:.2f} ms over all samples)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    a, b = res["after"]["summary"]["pooled"], res["before"]["summary"]["pooled"]
    return [goal("pooled_create_p50_ms", GOAL_P50_MS, a["p50_ms"], "ms", "lower",
                 f"pooled create->ready p50 through the bus, all samples of this tree ({res['rounds']} alternating rounds of {res['n']})",
                 note=f"{res['before_rev'][:7]}: {b['p50_ms']} ms")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=BEFORE, help="git revision to compare the working tree with (default: the tree before "
                    "the node answered the client directly, which this comparison was written for)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (2: before/after then after/before, so a "
                    "drifting load falls on both trees alike)")
    ap.add_argument("--n", type=int, default=60, help="creates per mode and run (120 pooled samples per tree at the default)")
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", a.before], check=True, capture_output=True, text=True).stdout.strip()
    after_rev = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    before_tree = extract(rev)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    t0 = time.time()
    try:
        for i in range(a.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for which in order:
                r = run(before_tree if which == "before" else REPO, a.n, a.gap)
                runs[which].append(r)
                print(f"round {i + 1} {which}: pooled p50 {r['pooled']['all']['p50_ms']} ms, cold p50 {r['cold']['all']['p50_ms']} ms",
                      file=sys.stderr)
        res = {"n": a.n, "rounds": a.rounds, "gap_s": a.gap, "before_rev": rev, "after_rev": after_rev + ("+dirty" if dirty else ""),
               "seconds": round(time.time() - t0, 1)}
        for which in ("before", "after"):
            res[which] = {"summary": summary(runs[which]),
                          "samples_pooled": [x for r in runs[which] for x in r["pooled"]["all"]["samples_ms"]]}
        res["pooled_p50_change_ms"] = round(res["after"]["summary"]["pooled"]["p50_ms"] - res["before"]["summary"]["pooled"]["p50_ms"], 3)
        save(a.out, "warm_pool_compare", res, plot, goals(res))
        print(json.dumps({k: res[k]["summary"] for k in ("before", "after")} | {"goals": res["goals"]}, indent=1))
    finally:
        shutil.rmtree(before_tree, ignore_errors=True)
        for r in runs["before"] + runs["after"]:
            shutil.rmtree(r["_dir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
