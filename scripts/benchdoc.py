"""Generate the results tables of docs/benchmarks.md from bench/results/*.json.

A number copied into the docs by hand goes stale with the next run and cannot say which tree it
measured; these tables are written from the results themselves, which bench/_common.save stamps
with the commit they ran on, the machine and a uniform goals list. Each table sits between
`<!-- generated: NAME -->` and `<!-- end generated: NAME -->` (NAME = the result's file name), so
the hand-written method notes around it stay. A run whose commit is not an ancestor of HEAD, or
more than --max-age commits behind it, is flagged stale: re-run that benchmark. `--check` writes
nothing and exits 1 when the docs differ from what the results give (tests/unit/test_benchdoc.py
runs it), so the docs and the committed results cannot drift apart.

    python scripts/benchdoc.py            # rewrite the generated parts of docs/benchmarks.md
    python scripts/benchdoc.py --check    # exit 1 if they are out of date
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import Goal, Tree  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
MAX_AGE = 50  # commits: older than this, a result no longer describes the tree around it
SUMMARY = "summary"  # the block listing every benchmark's goals met and missed

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)


class Machine(msgspec.Struct):
    date: str
    loadavg_before: list[float] | None = None
    loadavg_after: list[float] | None = None


class Result(msgspec.Struct):
    """What benchdoc reads of a result JSON: the stamp bench/_common.save writes (the rest of the
    file is each benchmark's own)."""

    tree: Tree
    machine: Machine
    goals: list[Goal]
    headline: dict[str, Any] | None = None  # the measures of a benchmark without a numeric goal


class BenchdocError(Exception):
    pass


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def staleness(commit: str, max_age: int, root: Path = ROOT) -> str:
    """Why a run of `commit` no longer describes HEAD ("" when it does)."""
    if _git("merge-base", "--is-ancestor", commit, "HEAD", root=root).returncode != 0:
        return "not an ancestor of HEAD"
    r = _git("rev-list", "--count", f"{commit}..HEAD", root=root)
    if r.returncode != 0:
        return "not in this history"
    if int(r.stdout.strip()) > max_age:
        return f"more than {max_age} commits old"
    return ""


def load(path: Path) -> Result:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Result)
    except msgspec.ValidationError as e:
        raise BenchdocError(f"{path.name}: not a stamped result ({e}); write it through bench/_common.save") from e


def num(v: float | None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v).lower()
    if float(v).is_integer() or abs(v) >= 100:
        return f"{round(v):,}"
    return f"{v:.3g}"


def with_unit(v: float | None, unit: str) -> str:
    return num(v) + ("x" if unit == "x" else f" {unit}" if unit else "")


_STALE = re.compile(r", \*\*stale\*\* \([^)]*\)")


def run_cell(r: Result, max_age: int, root: Path) -> str:
    tree = r.tree.describe if r.tree.inferred else r.tree.commit[:7] + ("-dirty" if r.tree.dirty else "")
    stale = staleness(r.tree.commit, max_age, root)
    return f"{r.machine.date[:10]}, {tree}" + (f", **stale** ({stale})" if stale else "")


def table(r: Result, max_age: int = MAX_AGE, root: Path = ROOT) -> str:
    run = run_cell(r, max_age, root)
    if not r.goals:
        lines = [f"No numeric goal is set for this benchmark; its measures are the result. Run: {run}."]
        if r.headline:
            lines += ["", "| measure | result |", "|---|---|"]
            lines += [f"| {k} | **{num(v) if isinstance(v, (int, float)) else v}** |" for k, v in r.headline.items()]
        return "\n".join(lines) + "\n"
    lines = ["| goal | compares | target | result | verdict | run |", "|---|---|---|---|---|---|"]
    for g in r.goals:
        target = f"{'≤' if g.better == 'lower' else '≥'} {with_unit(g.target, g.unit)}"
        result = f"**{with_unit(g.value, g.unit)}**" + (f" ({g.note})" if g.note else "")
        verdict = "MET" if g.met else "**MISSED**"
        lines.append(f"| {g.name.replace('_', ' ')} | {g.what} | {target} | {result} | {verdict} | {run} |")
    return "\n".join(lines) + "\n"


def summary(results: dict[str, Result], max_age: int = MAX_AGE, root: Path = ROOT) -> str:
    lines = ["| benchmark | goals met | goals missed | run |", "|---|---|---|---|"]
    for name, r in sorted(results.items()):
        met = [g.name for g in r.goals if g.met]
        missed = [g.name for g in r.goals if not g.met]
        lines.append(f"| [{name}](#{name}) | {len(met)} of {len(r.goals)} | "
                     f"{', '.join(f'**{m}**' for m in missed) or ('none' if r.goals else 'no numeric goal')} | "
                     f"{run_cell(r, max_age, root)} |")
    return "\n".join(lines) + "\n"


def render(doc: str, results_dir: Path, max_age: int = MAX_AGE, root: Path = ROOT) -> str:
    """`doc` with every generated block rewritten from `results_dir`; a result without a block, or a
    block without a result, is an error (the docs must show every result, and only results)."""
    results = {p.stem: load(p) for p in sorted(results_dir.glob("*.json"))}
    blocks = {m.group("name") for m in _BLOCK.finditer(doc)}
    missing = sorted(set(results) - blocks)
    orphans = sorted(blocks - set(results) - {SUMMARY})
    if missing or orphans:
        raise BenchdocError("docs/benchmarks.md and bench/results differ: "
                            + "; ".join(x for x in (missing and f"no <!-- generated: NAME --> block for {', '.join(missing)}",
                                                    orphans and f"no result for the block(s) {', '.join(orphans)}") if x))

    def body(m: re.Match[str]) -> str:
        name = m.group("name")
        text = summary(results, max_age, root) if name == SUMMARY else table(results[name], max_age, root)
        return m.group(1) + text + m.group(4)

    return _BLOCK.sub(body, doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date, write nothing")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--max-age", type=int, default=MAX_AGE, help="commits behind HEAD before a result is stale")
    a = ap.parse_args(argv)
    old = a.doc.read_text(encoding="utf-8")
    try:
        new = render(old, a.results, a.max_age)
    except BenchdocError as e:
        print(f"benchdoc: {e}", file=sys.stderr)
        return 2
    if a.check:
        # staleness is relative to HEAD, which every commit moves: it is written when the docs are
        # generated, but a result ageing past --max-age must not fail the check (CI would turn red
        # on a commit that changed nothing here)
        if _STALE.sub("", new) != _STALE.sub("", old):
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(a.doc), "generated"))
            print(f"{a.doc} is out of date: run python scripts/benchdoc.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        a.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
