"""What every benchmark here does the same way: timestamped progress lines, latency statistics in
one JSON shape, matplotlib without a display, and one way to write a result (the tree it measured,
the machine and its load, and its goals in one shape) so docs/benchmarks.md can be generated from
the results and checked against them. (Leading underscore: run_all skips it.)"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import msgspec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each benchmark runs in its own process (run_all), so the load when this module is first imported
# is the load before the benchmark started.
_LOAD_BEFORE = [round(x, 2) for x in os.getloadavg()]

Better = Literal["lower", "higher"]


class Goal(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One goal of a benchmark: `met` is derived from value against target, never set by hand; a
    goal whose value could not be measured (None) is not met."""

    name: str
    target: float
    value: float | None
    unit: str
    better: Better
    met: bool
    what: str = ""  # what is compared (the docs' "compares" column)
    note: str = ""  # what else this run saw that bears on the goal (the docs' "result" column)


class Tree(msgspec.Struct, kw_only=True, omit_defaults=True):
    commit: str
    dirty: bool
    describe: str
    # True for results older than this stamp: the commit is the one the JSON recorded, or else the
    # commit that added the result file (see scripts/benchdoc.py)
    inferred: bool = False


def is_met(value: float | None, target: float, better: Better) -> bool:
    if value is None:
        return False
    return value <= target if better == "lower" else value >= target


def goal(name: str, target: float, value: float | None, unit: str, better: Better, what: str = "", note: str = "") -> Goal:
    if better not in ("lower", "higher"):
        raise ValueError(f"goal {name}: better must be 'lower' or 'higher', got {better!r}")
    return Goal(name=name, target=target, value=value, unit=unit, better=better, met=is_met(value, target, better),
                what=what, note=note)


def goals_from_ops(legacy: Mapping[str, Mapping[str, Any]], unit: str = "x", notes: Mapping[str, str] | None = None) -> list[Goal]:
    """The `{name: {goal, op: "<="|">=", value, what}}` dicts several benchmarks keep their targets in,
    as goals (entries without a "goal", like "info", are not goals)."""
    out = []
    for name, g in legacy.items():
        if "goal" not in g or "op" not in g:
            continue
        out.append(goal(name, g["goal"], g.get("value"), g.get("unit", unit), "lower" if g["op"] == "<=" else "higher",
                        what=g.get("what", ""), note=(notes or {}).get(name, "")))
    return out


OWN_OUTPUT = ("bench/results", "docs/benchmarks.md")  # written by bench/ runs and scripts/benchdoc.py


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def tree() -> Tree:
    """The commit the benchmark ran on, and whether tracked files differed from it. What a run of
    bench/ writes itself (bench/results/, the benchmarks page) does not make a tree dirty: the
    second benchmark of a `make bench` would otherwise describe the first one's results."""
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{p}" for p in OWN_OUTPUT)))
    describe = commit[:7] + ("-dirty" if dirty else "")
    return Tree(commit=commit, dirty=dirty, describe=describe)


def machine(**extra: Any) -> dict[str, Any]:
    return {**extra, "nproc": os.cpu_count(), "kernel": platform.release(), "loadavg_before": _LOAD_BEFORE,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "timezone": "UTC"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stats(ms: list[float]) -> dict[str, Any]:
    """n, median, p90, p99, mean, min, max, stdev and the samples of a list of milliseconds."""
    import numpy as np

    if not ms:
        return {"n": 0}
    a = np.asarray(ms, dtype=float)

    def r(x: float) -> float:
        return round(float(x), 3)

    return {
        "n": int(a.size), "median_ms": r(np.median(a)), "p90_ms": r(np.percentile(a, 90)),
        "p99_ms": r(np.percentile(a, 99)), "mean_ms": r(a.mean()), "min_ms": r(a.min()), "max_ms": r(a.max()),
        "stdev_ms": r(a.std(ddof=1) if a.size > 1 else 0.0),
        "samples_ms": [r(x) for x in a],
    }


def pyplot():
    """matplotlib.pyplot on the Agg backend (benchmarks write PNGs, there is no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stamp(res: dict[str, Any], goals: Iterable[Goal]) -> dict[str, Any]:
    """`res` with the tree, the machine (keeping what the benchmark recorded of it) and the goals."""
    res["tree"] = msgspec.to_builtins(tree())
    res["machine"] = machine(**(res.get("machine") or {}))
    res["goals"] = [msgspec.to_builtins(g) for g in goals]
    return res


def save(out: str, name: str, res: dict[str, Any], plot: Callable[[dict[str, Any], str], None] | None,
         goals: Iterable[Goal], echo: bool = True) -> str:
    """Stamp `res` (see `stamp`), write `<out>/<name>.json` and `.png`; returns the JSON's path.
    `goals` is required: a benchmark with no numeric goal passes an empty list and so says so."""
    stamp(res, goals)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    if plot is not None:
        try:
            plot(res, os.path.join(out, f"{name}.png"))
        except Exception as e:  # noqa: BLE001 - the JSON is written; a broken plot must not lose the run
            log(f"plot failed: {type(e).__name__}: {e}")
    for g in res["goals"]:
        log(f"goal {g['name']}: {g['value']} {g['unit']} ({g['better']} is better, target {g['target']}) -> "
            f"{'MET' if g['met'] else 'MISSED'}")
    if not res["goals"]:
        log(f"{name}: no numeric goal")
    if echo:
        log(f"wrote {path}")
    return path
