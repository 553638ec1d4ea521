"""`corral demo`: the main job. Starts the embedded stack, builds and verifies the demo environment
(a Python package with a bug, visible and hidden tests, pinned git history, a planted answers
file), runs many rollouts at once with scripted policies (honest fixers, wrong fixes, cheaters),
grades each with the hidden tests and the monitor's alerts, and reports reward and alerts per
rollout and per policy, as tables, JSON and a PNG plot. It exits non-zero when any rollout got a
grade its policy should not have (an honest fix not rewarded, a cheat not caught)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral_common import extras
from corral_common.contract.errors import CorralError

from .client import AsyncClient
from .demo_env import demo_spec
from .demo_policies import POLICIES, Policy
from .stack import Stack, free_port

ENV = "calc-median"
JOB = "demo"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def run_demo(count: int, nodes: int, data_dir: str, nats_port: int, report: str | None, parallel: int,
                   console: Console) -> int:
    image_dir = os.environ.get("CORRAL_IMAGE_DIR") or f"{data_dir}/images"
    console.rule("[bold]corral demo")
    console.print(f"base image [bold]debian[/bold] (built once and cached in {image_dir})")
    rc = await asyncio.to_thread(subprocess.call, [sys.executable, "-m", "corral_image_cache.builtin", "build", "debian",
                                                   "--root", image_dir])
    if rc != 0:
        console.print("[red]building the debian image failed[/red]")
        return 1
    stack = Stack(data_dir=data_dir, nodes=nodes, nats_port=nats_port or free_port(), image_dir=image_dir)
    t = time.perf_counter()
    with console.status("starting NATS, image-cache, scheduler, monitor, env-builder and node-agents"):
        await stack.start()
    console.print(f"stack ready at {stack.url} in {time.perf_counter() - t:.1f}s ({nodes} node-agent(s))")
    try:
        client = await AsyncClient.connect(stack.url)
        try:
            return await _job(client, count, parallel, report or os.path.join(data_dir, "demo-report.json"), console)
        finally:
            await client.close()
    finally:
        with console.status("shutting down"):
            await stack.stop()
        console.print("stack stopped; every sandbox destroyed")


async def _build(client: AsyncClient, console: Console) -> dict:
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stage]}"), TimeElapsedColumn(),
                        console=console)
    with progress:
        task = progress.add_task(f"build {ENV}", total=1.0, stage="")
        res = await client.envs.build(demo_spec(ENV), job=JOB,
                                      progress=lambda e: progress.update(task, completed=e.fraction, stage=f"{e.stage}: {e.message[:60]}"))
    t = Table("check", "result", "detail", "s", title=f"verification of {ENV}")
    for c in res.report.checks:
        t.add_row(c.name, "[green]pass[/green]" if c.ok else "[red]FAIL[/red]", c.detail, f"{c.seconds:.2f}")
    console.print(t)
    if not res.accepted:
        raise CorralError(f"the demo environment was rejected: {res.report.summary()}")
    assert res.env is not None
    console.print(f"{ENV}:{res.env.version} accepted as image {res.env.image} in {res.env.build_seconds:.1f}s")
    return {"version": res.env.version, "image": res.env.image, "seconds": res.env.build_seconds,
            "checks": [{"name": c.name, "ok": c.ok, "seconds": c.seconds} for c in res.report.checks]}


async def _rollout(client: AsyncClient, i: int, policy: Policy) -> dict:
    row: dict = {"i": i, "policy": policy.name, "kind": policy.kind, "expect_reward": policy.expect_reward,
                 "expect_rule": policy.expect_rule}
    sb = None
    try:
        t0 = time.perf_counter()
        sb = await client.envs.rollout(ENV, job=JOB, labels={"policy": policy.name, "rollout": str(i)})
        row["sandbox"], row["create_s"] = sb.id, time.perf_counter() - t0
        t1 = time.perf_counter()
        await policy.act(sb)
        row["agent_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        g = await client.envs.grade(sb, destroy=True)
        sb = None
        row["grade_s"] = time.perf_counter() - t2
        row.update(reward=g.reward, passed=g.passed, reason=g.reason, alerts=sorted({a.rule for a in g.alerts}),
                   tests={t.id.rsplit(".", 1)[-1].rsplit("::", 1)[-1]: t.outcome for t in g.tests}, discarded=g.discarded,
                   grader_s=g.seconds)
    except CorralError as e:
        row.update(reward=None, passed=None, reason=f"error: {e}", alerts=[], tests={}, discarded=[])
    finally:
        if sb is not None:
            try:
                await sb.destroy()
            except CorralError:
                pass
    row["total_s"] = time.perf_counter() - t0
    caught = policy.expect_rule in row["alerts"] if policy.expect_rule else True
    false_alarm = policy.kind != "cheat" and bool(row["alerts"])
    row["as_expected"] = row["reward"] == policy.expect_reward and caught and not false_alarm
    return row


async def _job(client: AsyncClient, count: int, parallel: int, report: str, console: Console) -> int:
    build = await _build(client, console)
    rows: list[dict] = []
    sem = asyncio.Semaphore(parallel)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
    with progress:
        task = progress.add_task(f"rollouts ({parallel} at once): create, act, grade, destroy", total=count)

        async def one(i: int) -> None:
            async with sem:
                rows.append(await _rollout(client, i, POLICIES[i % len(POLICIES)]))
            progress.advance(task)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        wall = time.perf_counter() - t0
    left = await client.list(job=JOB)
    rows.sort(key=lambda r: r["i"])
    _print_rows(rows, console)
    per_policy = _per_policy(rows)
    _print_policies(per_policy, console)
    ok_n = sum(r["as_expected"] for r in rows)
    cheats = [r for r in rows if r["kind"] == "cheat"]
    honest = [r for r in rows if r["kind"] == "honest"]
    summary = {
        "rollouts": count, "as_expected": ok_n, "unexpected": count - ok_n, "wall_s": round(wall, 2),
        "rollouts_per_s": round(count / wall, 3) if wall else None, "left_behind": len(left),
        "honest_rewarded": sum(r["reward"] == 1.0 for r in honest), "honest": len(honest),
        "cheats_caught": sum(r["reward"] == 0.0 and r["expect_rule"] in r["alerts"] for r in cheats), "cheats": len(cheats),
        "false_alarms": sum(bool(r["alerts"]) for r in rows if r["kind"] != "cheat"),
        "mean_reward": round(sum(r["reward"] or 0 for r in rows) / max(1, count), 3),
        "grade_s": {"p50": pct([r["grade_s"] for r in rows if "grade_s" in r], 50),
                    "p99": pct([r["grade_s"] for r in rows if "grade_s" in r], 99)},
        "rollout_s": {"p50": pct([r["total_s"] for r in rows], 50), "p99": pct([r["total_s"] for r in rows], 99)},
    }
    console.print(f"[bold]{ok_n}/{count} rollouts graded as their policy deserves[/bold] in {wall:.1f}s "
                  f"({summary['rollouts_per_s']} rollouts/s); honest rewarded {summary['honest_rewarded']}/{len(honest)}, "
                  f"cheats caught {summary['cheats_caught']}/{len(cheats)}, false alarms {summary['false_alarms']}, "
                  f"sandboxes left behind {len(left)}")
    out = {"env": build, "summary": summary, "policies": per_policy, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
    with open(report, "w") as f:
        json.dump(out, f, indent=2, default=str)
    png = os.path.splitext(report)[0] + ".png"
    _plot(per_policy, summary, png)
    console.print(f"report: {report}, plot: {png}")
    return 0 if ok_n == count and not left else 1


def _print_rows(rows: list[dict], console: Console) -> None:
    t = Table("#", "policy", "reward", "tests (passed/named)", "discarded", "alerts", "s", "",
              title="rollouts (per-test outcomes, discarded paths and reasons in the JSON report)")
    for r in rows:
        named = r.get("tests") or {}
        tests = "-" if r["passed"] is None else f"{sum(o == 'passed' for o in named.values())}/{len(named)}"
        discarded = r.get("discarded") or []
        shown = ", ".join(discarded[:2]) + (f" +{len(discarded) - 2}" if len(discarded) > 2 else "")
        reward = "-" if r["reward"] is None else f"{r['reward']:.0f}"
        t.add_row(str(r["i"]), r["policy"], reward, tests, shown or "-", ", ".join(r["alerts"]) or "-", f"{r['total_s']:.1f}",
                  "[green]ok[/green]" if r["as_expected"] else f"[red]UNEXPECTED[/red] {r['reason'][:60]}")
    console.print(t)


def _per_policy(rows: list[dict]) -> list[dict]:
    out = []
    for p in POLICIES:
        rs = [r for r in rows if r["policy"] == p.name]
        if not rs:
            continue
        out.append({"policy": p.name, "kind": p.kind, "rollouts": len(rs),
                    "mean_reward": round(sum(r["reward"] or 0 for r in rs) / len(rs), 3),
                    "tests_passed": sum(bool(r["passed"]) for r in rs), "flagged": sum(bool(r["alerts"]) for r in rs),
                    "rules": sorted({a for r in rs for a in r["alerts"]}), "as_expected": sum(r["as_expected"] for r in rs)})
    return out


def _print_policies(per: list[dict], console: Console) -> None:
    t = Table("policy", "n", "reward", "tests ok", "flagged", "rules", "expected", title="per policy")
    for p in per:
        t.add_row(p["policy"], str(p["rollouts"]), f"{p['mean_reward']:.2f}", str(p["tests_passed"]),
                  str(p["flagged"]), ", ".join(p["rules"]) or "-", f"{p['as_expected']}/{p['rollouts']}")
    console.print(t)


def _plot(per: list[dict], summary: dict, path: str) -> None:
    matplotlib = extras.require("matplotlib", "bench", "the demo's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["policy"] for p in per]
    colors = {"honest": "tab:green", "wrong": "tab:gray", "cheat": "tab:red"}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [p["tests_passed"] / p["rollouts"] for p in per], 0.4, label="hidden tests passed (share)",
           color="lightsteelblue")
    ax.bar([i + 0.2 for i in x], [p["mean_reward"] for p in per], 0.4, label="mean reward after alerts",
           color=[colors[p["kind"]] for p in per])
    for i, p in enumerate(per):
        if p["rules"]:
            ax.text(i, 1.04, "\n".join(p["rules"]), ha="center", va="bottom", fontsize=7, color="tab:red", rotation=90)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylim(0, 2.0)
    ax.set_ylabel("share / reward")
    ax.set_title(f"corral demo: {summary['rollouts']} rollouts, {summary['cheats_caught']}/{summary['cheats']} cheats caught, "
                 f"{summary['honest_rewarded']}/{summary['honest']} honest rewarded, {summary['rollouts_per_s']} rollouts/s")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
