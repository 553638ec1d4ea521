"""`corral demo`: the main job. Starts the embedded stack, builds and verifies the demo environment
(a Python package with a bug, visible and hidden tests, pinned git history, a planted answers
file), runs many rollouts at once with scripted policies (honest fixers, wrong fixes, cheaters),
grades each with the hidden tests and the monitor's alerts, and reports reward and alerts per
rollout and per policy, as tables, JSON and a PNG plot; then does the same for a web agent's task
(demo_web.py: a shop run as the harness, Chromium driven over the bus, graded on the shop's own
state). The rollouts are `corral eval`'s
(eval.py) with the built-in scripted policies; the demo adds what each policy deserved. It exits non-zero when any rollout got a
grade its policy should not have (an honest fix not rewarded, a cheat not caught)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import TypedDict

import msgspec
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral_common import extras
from corral_common.contract import subjects
from corral_common.contract.envs import SEVERITY_RANK, EnvSpec
from corral_common.contract.errors import CorralError
from corral_common.contract.images import ImportReply, ImportRequest

from .cli_eval import run_with_progress
from .client import AsyncClient, AsyncSandbox
from .demo_env import demo_spec
from .demo_policies import POLICIES, Policy
from .demo_web import WEB_ENV, WEB_POLICIES, shop_spec
from .eval import NamedPolicy, RolloutResult, Task
from .eval_report import print_report, short_test
from .stack import Stack, free_port

ENV = "calc-median"
#: the substrates a Stack enables on request (`container` always runs)
OPTIONAL_SUBSTRATES = ("gvisor", "docker", "microvm", "vm")
JOB = "demo"
FAIL_ON = "high"  # eval's default: alerts at or above it zero the reward


class DemoRow(TypedDict):
    """A rollout in the demo's report: eval's row and what the demo expected of its policy."""

    i: int
    policy: str
    kind: str
    expect_reward: float
    expect_rule: str
    sandbox: str
    substrate: str
    create_s: float
    agent_s: float
    grade_s: float
    grader_s: float
    total_s: float
    reward: float | None
    passed: bool | None
    reason: str
    alerts: list[str]
    discarded: list[str]
    tests: dict[str, str]  # short test name -> outcome
    false_alarm: bool  # not a cheat, yet an alert at or above FAIL_ON
    as_expected: bool


class PolicyRow(TypedDict):
    """One policy's rollouts, summed up."""

    policy: str
    kind: str
    rollouts: int
    mean_reward: float
    tests_passed: int
    flagged: int
    rules: list[str]
    as_expected: int


async def run_demo(count: int, nodes: int, data_dir: str, nats_port: int, report: str | None, parallel: int,
                   console: Console, web_rollouts: int = len(WEB_POLICIES), substrate: str = "container") -> int:
    image_dir = os.environ.get("CORRAL_IMAGE_DIR") or f"{data_dir}/images"
    console.rule("[bold]corral demo")
    console.print(f"base image [bold]debian[/bold] (built once and cached in {image_dir})")
    rc = await asyncio.to_thread(subprocess.call, [sys.executable, "-m", "corral_image_cache.builtin", "build", "debian",
                                                   "--root", image_dir])
    if rc != 0:
        console.print("[red]building the debian image failed[/red]")
        return 1
    if substrate not in OPTIONAL_SUBSTRATES and substrate != "container":
        console.print(f"[red]the demo's rollouts run on container, {', '.join(OPTIONAL_SUBSTRATES)}; not {substrate!r}[/red]")
        return 2
    guest = substrate in ("microvm", "vm")
    # 8 guests at once under TCG (this machine: no usable KVM) on 2 cores made the policies' execs
    # outlast their 75 s; 2 at once graded all 10 of a run as they deserved (07:15, a6af908)
    parallel = parallel or (2 if guest else 8)
    if guest and web_rollouts:
        console.print(f"[yellow]the web environment is left out on {substrate}: its browser is driven through a "
                      "port forward, which a guest does not offer (it has no network)[/yellow]")
        web_rollouts = 0
    stack = Stack(data_dir=data_dir, nodes=nodes, nats_port=nats_port or free_port(), image_dir=image_dir,
                  gvisor=substrate == "gvisor", docker=substrate == "docker", microvm=substrate == "microvm", vm=substrate == "vm")
    t = time.perf_counter()
    with console.status("starting NATS, image-cache, scheduler, monitor, env-builder and node-agents"):
        await stack.start()
    console.print(f"stack ready at {stack.url} in {time.perf_counter() - t:.1f}s ({nodes} node-agent(s))")
    try:
        client = await AsyncClient.connect(stack.url)
        try:
            return await _job(client, count, parallel, web_rollouts, report or os.path.join(data_dir, "demo-report.json"), console,
                              substrate)
        finally:
            await client.close()
    finally:
        with console.status("shutting down"):
            await stack.stop()
        console.print("stack stopped; every sandbox destroyed")


async def _build(client: AsyncClient, console: Console, spec: EnvSpec) -> dict[str, object]:
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stage]}"), TimeElapsedColumn(),
                        console=console)
    with progress:
        task = progress.add_task(f"build {spec.name}", total=1.0, stage="")
        res = await client.envs.build(spec, job=JOB,
                                      progress=lambda e: progress.update(task, completed=e.fraction, stage=f"{e.stage}: {e.message[:60]}"))
    t = Table("check", "result", "detail", "s", title=f"verification of {spec.name}")
    for c in res.report.checks:
        t.add_row(c.name, "[green]pass[/green]" if c.ok else "[red]FAIL[/red]", c.detail, f"{c.seconds:.2f}")
    console.print(t)
    if not res.accepted:
        raise CorralError(f"the demo environment {spec.name} was rejected: {res.report.summary()}")
    assert res.env is not None
    console.print(f"{spec.name}:{res.env.version} accepted as image {res.env.image} in {res.env.build_seconds:.1f}s")
    return {"version": res.env.version, "image": res.env.image, "seconds": res.env.build_seconds,
            "checks": [{"name": c.name, "ok": c.ok, "seconds": c.seconds} for c in res.report.checks]}


def _scripted(policy: Policy) -> NamedPolicy:
    """A demo policy as an eval policy: the scripted ones need only the sandbox."""
    async def act(sb: AsyncSandbox, task: Task) -> None:
        await policy.act(sb)

    return NamedPolicy(policy.name, act)


def _row(r: RolloutResult, policy: Policy) -> DemoRow:
    """An eval row with what the demo expected of its policy (the demo's report rows)."""
    alerts = r.rules
    caught = policy.expect_rule in alerts if policy.expect_rule else True
    # an alert that would withhold an honest agent's reward (at or above the grade's fail_on);
    # below that (a browser's own UDP probe, network_probe: medium) it is recorded, not held against it
    false_alarm = policy.kind != "cheat" and any(SEVERITY_RANK.get(a.severity, 0) >= SEVERITY_RANK[FAIL_ON] for a in r.alerts)
    return {"i": r.i, "policy": policy.name, "kind": policy.kind, "expect_reward": policy.expect_reward,
            "expect_rule": policy.expect_rule, "sandbox": r.sandbox, "substrate": r.substrate, "create_s": r.create_s, "agent_s": r.agent_s,
            "grade_s": r.grade_s, "grader_s": r.grader_s, "total_s": r.total_s, "reward": r.reward, "passed": r.passed,
            "reason": r.reason or f"error: {r.error}", "alerts": alerts, "discarded": r.discarded,
            "tests": {short_test(t.id): t.outcome for t in r.tests},
            "false_alarm": false_alarm, "as_expected": r.reward == policy.expect_reward and caught and not false_alarm}


async def _web(client: AsyncClient, rollouts: int, parallel: int, console: Console,
               substrate: str) -> tuple[dict[str, object], list[DemoRow], int]:
    """The web environment's part: the browser image (built once per machine), the env built and
    verified, its policies run and graded like calc-median's. Returns (build, rows, left behind)."""
    console.rule(f"[bold]{WEB_ENV}: a web agent's task, graded on the app's server state")
    with console.status("the browser image (Chromium from Debian; built once per machine, ~1-2 minutes)"):
        await client.request(subjects.IMAGE_IMPORT, ImportRequest(name="browser", source="builtin"), ImportReply, timeout=1200)
    build = await _build(client, console, shop_spec())
    rep = await run_with_progress(client, WEB_ENV, [_scripted(p) for p in WEB_POLICIES], rollouts, parallel, console, job=JOB,
                                  substrate=substrate)
    rows = [_row(r, WEB_POLICIES[r.i % len(WEB_POLICIES)]) for r in rep.rows]
    _print_rows(rows, console)
    print_report(rep, console, rows=False)
    return build, rows, rep.summary.left_behind


async def _job(client: AsyncClient, count: int, parallel: int, web_rollouts: int, report: str, console: Console,
               substrate: str = "container") -> int:
    build = await _build(client, console, demo_spec(ENV))
    rep = await run_with_progress(client, ENV, [_scripted(p) for p in POLICIES], count, parallel, console, job=JOB,
                                  substrate=substrate)
    wall, left = rep.summary.wall_s, rep.summary.left_behind
    rows = [_row(r, POLICIES[r.i % len(POLICIES)]) for r in rep.rows]
    _print_rows(rows, console)
    print_report(rep, console, rows=False)
    web_build: dict[str, object] | None = None
    if web_rollouts:
        web_build, web_rows, web_left = await _web(client, web_rollouts, min(parallel, 4), console, substrate)
        for r in web_rows:
            r["i"] += count
        rows += web_rows
        left += web_left
    count = len(rows)
    per_policy = _per_policy(rows)
    _print_policies(per_policy, console)
    ok_n = sum(r["as_expected"] for r in rows)
    cheats = [r for r in rows if r["kind"] == "cheat"]
    honest = [r for r in rows if r["kind"] == "honest"]
    summary: dict[str, object] = {
        "rollouts": count, "as_expected": ok_n, "unexpected": count - ok_n, "wall_s": round(wall, 2), "concurrency": parallel,
        "rollouts_per_s": rep.summary.rollouts_per_s, "left_behind": left,
        "honest_rewarded": sum(r["reward"] == 1.0 for r in honest), "honest": len(honest),
        "cheats_caught": sum(r["reward"] == 0.0 and r["expect_rule"] in r["alerts"] for r in cheats), "cheats": len(cheats),
        "false_alarms": sum(r["false_alarm"] for r in rows),
        "mean_reward": rep.summary.mean_reward,
        "create_s": msgspec.to_builtins(rep.summary.create_s), "agent_s": msgspec.to_builtins(rep.summary.agent_s),
        "grade_s": msgspec.to_builtins(rep.summary.grade_s), "rollout_s": msgspec.to_builtins(rep.summary.total_s),
    }
    console.print(f"[bold]{ok_n}/{count} rollouts graded as their policy deserves[/bold] in {wall:.1f}s "
                  f"({summary['rollouts_per_s']} rollouts/s); honest rewarded {summary['honest_rewarded']}/{len(honest)}, "
                  f"cheats caught {summary['cheats_caught']}/{len(cheats)}, false alarms {summary['false_alarms']}, "
                  f"sandboxes left behind {left}")
    out = {"env": build, "web_env": web_build, "summary": summary, "policies": per_policy, "rows": rows,
           "tests": msgspec.to_builtins(rep.tests), "alerts": msgspec.to_builtins(rep.alerts)}
    os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
    with open(report, "w") as f:
        json.dump(out, f, indent=2, default=str)
    png = os.path.splitext(report)[0] + ".png"
    _plot(per_policy, summary, png)
    console.print(f"report: {report}, plot: {png}")
    return 0 if ok_n == count and not left else 1


def _print_rows(rows: list[DemoRow], console: Console) -> None:
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


def _per_policy(rows: list[DemoRow]) -> list[PolicyRow]:
    out: list[PolicyRow] = []
    for p in [*POLICIES, *WEB_POLICIES]:
        rs = [r for r in rows if r["policy"] == p.name]
        if not rs:
            continue
        out.append({"policy": p.name, "kind": p.kind, "rollouts": len(rs),
                    "mean_reward": round(sum(r["reward"] or 0 for r in rs) / len(rs), 3),
                    "tests_passed": sum(bool(r["passed"]) for r in rs), "flagged": sum(bool(r["alerts"]) for r in rs),
                    "rules": sorted({a for r in rs for a in r["alerts"]}), "as_expected": sum(r["as_expected"] for r in rs)})
    return out


def _print_policies(per: list[PolicyRow], console: Console) -> None:
    t = Table("policy", "n", "reward", "tests ok", "flagged", "rules", "expected", title="per policy")
    for p in per:
        t.add_row(p["policy"], str(p["rollouts"]), f"{p['mean_reward']:.2f}", str(p["tests_passed"]),
                  str(p["flagged"]), ", ".join(p["rules"]) or "-", f"{p['as_expected']}/{p['rollouts']}")
    console.print(t)


def _plot(per: list[PolicyRow], summary: dict[str, object], path: str) -> None:
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
