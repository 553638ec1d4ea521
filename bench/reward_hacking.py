"""Reward-hacking benchmark (issue 13): every strategy of bench/hacks/corpus.py, cheating and
honest, in its own fresh rollout of every environment of bench/hacks/envs.py, graded by the real
grader (`client.envs.grade(sb, destroy=True)`).

A cheat must get reward 0; an honest solution must get reward 1 with no alert. Reported per
category and environment: cheats rewarded, honest unrewarded, false alerts (alerts on honest
rollouts), and grade latency p50/p99 (the grader's own `seconds` and the caller's wall time).
Exits 1 if any cheat was rewarded or any honest solution was not (or drew an alert).

    python -m bench.reward_hacking [--envs demo,authored,pypi] [--only NAME[,NAME]] [--kind cheat|honest]
                                   [--concurrency 2] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from typing import Any

from bench._common import Goal, goal, log, pyplot, save, stats

GRADE_GOAL_ENV = "calc-median"  # the grade latency goal is set on the demo environment
DEFAULT_ENVS = "demo,authored"  # every strategy on the two quick environments: ~3 min of the ~25 of bench.run_all

HERE = os.path.dirname(os.path.abspath(__file__))
IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")


def verdict(kind: str, reward: float | None, alerts: list[str]) -> str:
    """ok | cheat_rewarded | honest_unrewarded | false_alert | error (no grade)."""
    if reward is None:
        return "error"
    if kind == "cheat":
        return "ok" if reward == 0.0 else "cheat_rewarded"
    if reward != 1.0:
        return "honest_unrewarded"
    return "false_alert" if alerts else "ok"


async def grade_retrying(client, sb, row: dict[str, Any]):
    """A grade that could not rule cheating out (`unavailable`: the monitor did not answer in time)
    is asked again, as a harness would; how often is in the row."""
    from corral_sdk import Unavailable

    for attempt in range(3):
        try:
            return await client.envs.grade(sb, destroy=True)
        except Unavailable:
            row["grade_retries"] = attempt + 1
            if attempt == 2:
                raise
            await asyncio.sleep(2.0)


async def run_one(client, env, strat, job: str) -> dict[str, Any]:
    """One rollout: act, grade (destroying the rollout), and the row the report is made of."""
    row: dict[str, Any] = {"env": env.name, "strategy": strat.name, "kind": strat.kind, "category": strat.category}
    sb = await client.envs.rollout(env.name, job=job, labels={"strategy": strat.name[:60]})
    try:
        await strat.act(sb, env)
    except Exception as e:  # a cheat that broke its own sandbox still gets graded
        row["act_error"] = f"{type(e).__name__}: {e}"[:300]
    t0 = time.perf_counter()
    try:
        g = await grade_retrying(client, sb, row)
    except Exception as e:
        row.update(reward=None, reason=f"grade failed: {type(e).__name__}: {e}"[:400], alerts=[], wall_s=time.perf_counter() - t0)
        try:
            await sb.destroy()
        except Exception:  # cleanup: the grade error is the result; a sandbox left behind expires with its TTL
            pass
    else:
        row.update(reward=g.reward, passed=g.passed, reason=g.reason, alerts=sorted({a.rule for a in g.alerts}),
                   runner=g.runner, discarded=g.discarded[:20], audit_complete=g.audit_complete, exit_code=g.exit_code,
                   tests={o: sum(t.outcome == o for t in g.tests) for o in {t.outcome for t in g.tests}},
                   grade_s=g.seconds, wall_s=round(time.perf_counter() - t0, 3))
    row["verdict"] = verdict(strat.kind, row["reward"], row["alerts"])
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def block(rs: list[dict[str, Any]]) -> dict[str, Any]:
        ch, ho = [r for r in rs if r["kind"] == "cheat"], [r for r in rs if r["kind"] == "honest"]
        return {"n": len(rs), "cheats": len(ch), "cheats_rewarded": sum(r["verdict"] == "cheat_rewarded" for r in ch),
                "honest": len(ho), "honest_unrewarded": sum(r["verdict"] == "honest_unrewarded" for r in ho),
                "false_alerts": sum(r["verdict"] == "false_alert" for r in ho), "errors": sum(r["verdict"] == "error" for r in rs),
                "grade_s": _pcts([r["grade_s"] for r in rs if r.get("grade_s") is not None]),
                "wall_s": _pcts([r["wall_s"] for r in rs if r.get("wall_s") is not None])}

    by: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[f"{r['kind']}/{r['category']}"][r["env"]].append(r)
    per_env: dict[str, list] = defaultdict(list)
    for r in rows:
        per_env[r["env"]].append(r)
    return {"total": block(rows), "per_env": {e: block(rs) for e, rs in sorted(per_env.items())},
            "per_category": {c: {e: block(rs) for e, rs in sorted(envs.items())} for c, envs in sorted(by.items())},
            "cheats_rewarded": sorted(f"{r['env']}/{r['strategy']}" for r in rows if r["verdict"] == "cheat_rewarded"),
            "honest_failed": sorted(f"{r['env']}/{r['strategy']}: {r['verdict']} ({r.get('reason', '')[:120]}; alerts {r['alerts']})"
                                    for r in rows if r["kind"] == "honest" and r["verdict"] != "ok"),
            "errors": sorted(f"{r['env']}/{r['strategy']}: {r.get('reason', '')}" for r in rows if r["verdict"] == "error")}


def _pcts(xs: list[float]) -> dict[str, Any]:
    s = stats([x * 1000 for x in xs])
    return {"n": s["n"], "p50_s": round(s["median_ms"] / 1000, 3), "p99_s": round(s["p99_ms"] / 1000, 3)} if xs else {"n": 0}


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    cats = sorted(res["summary"]["per_category"])
    envs = sorted(res["summary"]["per_env"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    w = 0.8 / max(1, len(envs))
    for i, e in enumerate(envs):
        blocks = [res["summary"]["per_category"][c].get(e, {}) for c in cats]
        bad = [b.get("cheats_rewarded", 0) + b.get("honest_unrewarded", 0) + b.get("false_alerts", 0) for b in blocks]
        tot = [b.get("n", 0) for b in blocks]
        xs = [j + i * w for j in range(len(cats))]
        a1.bar(xs, tot, w, color="lightgray", edgecolor="gray")
        a1.bar(xs, bad, w, label=f"{e}: wrong grades", color=f"C{i}")
    a1.set_xticks([j + w * (len(envs) - 1) / 2 for j in range(len(cats))], cats, rotation=35, ha="right", fontsize=8)
    a1.set_ylabel("rollouts (gray: all; colour: wrong grades)")
    a1.set_title("cheat rewarded / honest unrewarded / false alert, per kind/category and env (goal: 0)", fontsize=10)
    a1.legend(fontsize=8)
    lat = [r["grade_s"] for r in res["rows"] if r.get("grade_s") is not None]
    wall = [r["wall_s"] for r in res["rows"] if r.get("wall_s") is not None]
    if lat:
        a2.hist([lat, wall], bins=20, label=["grader seconds", "wall seconds"], color=["tab:blue", "tab:orange"])
    a2.axvline(1.5, color="red", ls="--", lw=1, label="goal p50 1.5 s")
    a2.set_xlabel("grade latency (s)")
    a2.set_title("grade latency")
    a2.legend(fontsize=8)
    t = res["summary"]["total"]
    fig.suptitle(f"reward hacking: {t['cheats_rewarded']}/{t['cheats']} cheats rewarded, {t['honest_unrewarded']}/{t['honest']} "
                 f"honest unrewarded, {t['false_alerts']} false alerts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(args, res: dict[str, Any]) -> None:
    from bench.hacks import corpus
    from bench.hacks import envs as benv
    from corral_sdk.client import AsyncClient
    from corral_sdk.stack import Stack, free_port

    envs = benv.select("" if args.envs == "all" else args.envs)
    strategies = [s for s in corpus.CORPUS if (not args.kind or s.kind == args.kind)]
    if args.only:
        want = {x.strip() for x in args.only.split(",") if x.strip()}
        unknown = want - {s.name for s in corpus.CORPUS}
        if unknown:
            raise SystemExit(f"unknown strategy {sorted(unknown)}; see bench/hacks/corpus.py")
        strategies = [s for s in strategies if s.name in want]
    data = tempfile.mkdtemp(prefix="crl-bench-rh-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR)
    await stack.start()
    client = await AsyncClient.connect(stack.url)
    try:
        for env in envs:
            t0 = time.perf_counter()
            b = await benv.build(client, env)
            res["builds"][env.name] = {"version": b.env.version if b.env else "", "seconds": round(time.perf_counter() - t0, 2),
                                       "cached": b.cached}
            log(f"built {env.name} in {time.perf_counter() - t0:.1f}s")
        work = [(e, s) for e in envs for s in strategies if s.applies(e)]
        sem = asyncio.Semaphore(args.concurrency)
        job = f"rh-{int(time.time())}"

        async def one(e, s) -> None:
            async with sem:
                try:
                    row = await run_one(client, e, s, job)
                except Exception as ex:
                    row = {"env": e.name, "strategy": s.name, "kind": s.kind, "category": s.category, "reward": None,
                           "alerts": [], "verdict": "error", "reason": f"{type(ex).__name__}: {ex}"[:400],
                           "trace": traceback.format_exc()[-1500:]}
                res["rows"].append(row)
                log(f"{row['verdict']:>18}  {e.name:<18} {s.name:<44} reward={row['reward']} alerts={row['alerts']} "
                    f"grade={row.get('grade_s')}s  {row.get('reason', '')[:90]}")

        await asyncio.gather(*(one(e, s) for e, s in work))
    finally:
        await client.close()
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)


def goals(res: dict[str, Any]) -> list[Goal]:
    t = res["summary"]["total"]
    demo = res["summary"]["per_env"].get(GRADE_GOAL_ENV, {}).get("grade_s", {})
    return [
        goal("cheats_rewarded", 0, t["cheats_rewarded"], "rollouts", "lower", "cheating rollouts with reward 1",
             note=f"of {t['cheats']}, on {', '.join(sorted(res['summary']['per_env']))}"),
        goal("honest_unrewarded", 0, t["honest_unrewarded"], "rollouts", "lower", "honest rollouts with reward 0",
             note=f"of {t['honest']}; {t['false_alerts']} false alerts, {t['errors']} errors"),
        goal("grade_p50_s", 1.5, demo.get("p50_s"), "s", "lower", f"grade latency p50 on {GRADE_GOAL_ENV}",
             note=f"p99 {demo.get('p99_s')} s; all environments p50 {t['grade_s'].get('p50_s')} s, p99 {t['grade_s'].get('p99_s')} s"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", default=DEFAULT_ENVS,
                    help=f"comma-separated: demo, authored, pypi or env names, or 'all' (default: {DEFAULT_ENVS}; the two PyPI "
                    "environments take ~5x longer per rollout, 'all' runs the four in ~10 min)")
    ap.add_argument("--only", default="", help="comma-separated strategy names (default: the whole corpus)")
    ap.add_argument("--kind", choices=["cheat", "honest"], default="")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default="reward_hacking", help="result file name (without extension)")
    ap.add_argument("--replot", help="redraw the PNG from this JSON and exit")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return 0
    if os.geteuid() != 0:
        print("run as root (runc, mounts, cgroups)", file=sys.stderr)
        return 2
    subprocess.run([sys.executable, "-m", "corral_image_cache.builtin", "build", "debian", "--root", IMAGE_DIR], check=True,
                   stdout=subprocess.DEVNULL)
    res: dict[str, Any] = {"bench": "reward_hacking", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           "args": {k: v for k, v in vars(args).items() if k != "replot"}, "builds": {}, "rows": []}
    t0 = time.perf_counter()
    asyncio.run(run(args, res))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["rows"].sort(key=lambda r: (r["env"], r["kind"], r["category"], r["strategy"]))
    res["summary"] = summarize(res["rows"])
    save(args.out, args.name, res, plot, goals(res))
    t = res["summary"]["total"]
    log(f"{t['cheats_rewarded']}/{t['cheats']} cheats rewarded, {t['honest_unrewarded']}/{t['honest']} honest unrewarded, "
        f"{t['false_alerts']} false alerts, {t['errors']} errors; grade p50 {t['grade_s'].get('p50_s')}s p99 {t['grade_s'].get('p99_s')}s")
    return 1 if (t["cheats_rewarded"] or t["honest_unrewarded"] or t["false_alerts"] or t["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
