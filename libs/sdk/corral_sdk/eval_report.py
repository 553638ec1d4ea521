"""How an EvalReport is shown: per-rollout, per-test and alert tables (rich), the JSON file and a
PNG. Kept apart from eval.py so that running rollouts needs neither rich tables nor matplotlib."""
from __future__ import annotations

import os

import msgspec
from rich.console import Console
from rich.table import Table

from corral_common import extras

from .eval import EvalReport, RolloutResult


def short_test(test_id: str) -> str:
    """`tests.test_x.TestY.test_z` / `tests/test_x.py::test_z` -> `test_z`."""
    return test_id.rsplit("::", 1)[-1] if "::" in test_id else test_id.rsplit(".", 1)[-1]


def rollout_table(rows: list[RolloutResult], title: str = "rollouts") -> Table:
    t = Table("#", "policy", "reward", "tests passed", "failed", "alerts", "s", "reason / error", title=title)
    for r in rows:
        named = len(r.tests)
        passed = r.tests_passed()
        t.add_row(str(r.i), r.policy, "-" if r.reward is None else f"{r.reward:g}",
                  "-" if r.reward is None else f"{passed}/{named}", "-" if r.reward is None else str(named - passed),
                  ", ".join(r.rules) or "-", f"{r.total_s:.1f}",
                  f"[red]{r.error[:70]}[/red]" if r.error else r.reason[:70])
    return t


def tests_table(rep: EvalReport) -> Table:
    t = Table("test", "expected", "passed", "failed", "error", "missing", title="per-test outcomes over graded rollouts")
    for x in rep.tests:
        t.add_row(x.id if len(x.id) <= 70 else "…" + x.id[-69:], x.expected, str(x.passed), str(x.failed), str(x.error),
                  str(x.missing))
    return t


def alerts_table(rep: EvalReport) -> Table:
    t = Table("rule", "severity", "rollouts", "example", title="alerts")
    for a in rep.alerts:
        t.add_row(a.rule, a.severity, str(a.rollouts), a.example[:90])
    return t


def print_report(rep: EvalReport, console: Console, rows: bool = True) -> None:
    if rows:
        console.print(rollout_table(rep.rows))
    if rep.tests:
        console.print(tests_table(rep))
    if rep.alerts:
        console.print(alerts_table(rep))
    s = rep.summary
    console.print(f"[bold]{s.env}:{s.version}[/bold]: {s.rollouts} rollouts at concurrency {s.concurrency} in {s.wall_s:.1f}s "
                  f"([bold]{s.rollouts_per_s:g} rollouts/s[/bold]); graded {s.graded}, errors {s.errors}, rewarded {s.rewarded}, "
                  f"mean reward {s.mean_reward:g}, flagged {s.flagged}, left behind {s.left_behind}; p50 create "
                  f"{s.create_s.p50:.2f}s, agent {s.agent_s.p50:.2f}s, grade {s.grade_s.p50:.2f}s")


def write_json(rep: EvalReport, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(rep), indent=2))


def write_png(rep: EvalReport, path: str) -> None:
    """Reward per rollout (red: flagged), pass rate per named test, and where each rollout's time
    went (create, agent, grade)."""
    matplotlib = extras.require("matplotlib", "bench", "the eval report's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = rep.summary
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    xs = [r.i for r in rep.rows]
    ax.bar(xs, [r.reward if r.reward is not None else 0 for r in rep.rows],
           color=["tab:gray" if r.reward is None else "tab:red" if r.alerts else "tab:green" for r in rep.rows])
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.set_title(f"reward (mean {s.mean_reward:g}; red: flagged, gray: error)", fontsize=9)
    ax = axes[1]
    graded = max(1, s.graded)
    names = [short_test(t.id) for t in rep.tests]
    ax.barh(range(len(names)), [t.passed / graded for t in rep.tests],
            color=["tab:blue" if t.expected == "fail_to_pass" else "lightsteelblue" for t in rep.tests])
    ax.set_yticks(list(range(len(names))), names, fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of graded rollouts passing")
    ax.set_title("named tests (dark: fail_to_pass)", fontsize=9)
    ax = axes[2]
    c = [r.create_s for r in rep.rows]
    a = [r.agent_s for r in rep.rows]
    g = [r.grade_s for r in rep.rows]
    ax.bar(xs, c, label="create", color="tab:purple")
    ax.bar(xs, a, bottom=c, label="agent", color="tab:orange")
    ax.bar(xs, g, bottom=[x + y for x, y in zip(c, a)], label="grade", color="tab:cyan")
    ax.set_xlabel("rollout")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title(f"time per rollout ({s.rollouts_per_s:g} rollouts/s at concurrency {s.concurrency})", fontsize=9)
    fig.suptitle(f"corral eval {s.env}:{s.version}: {s.rollouts} rollouts, {s.rewarded} rewarded, {s.flagged} flagged, "
                 f"{s.errors} errors")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
