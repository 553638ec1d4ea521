"""Benchmark results say what they measured and the docs say what the results say: bench/_common
derives every goal's verdict from value against target and stamps the tree and machine, and
docs/benchmarks.md is exactly what scripts/benchdoc.py generates from the committed results."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "scripts" / "benchdoc.py"
sys.path.insert(0, str(ROOT))

from bench import _common  # noqa: E402


def _benchdoc():
    spec = importlib.util.spec_from_file_location("benchdoc", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_docs_are_what_the_committed_results_give():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("value,target,better,met", [
    (1.2, 1.5, "lower", True), (1.5, 1.5, "lower", True), (1.6, 1.5, "lower", False),
    (12.0, 10.0, "higher", True), (10.0, 10.0, "higher", True), (4.6, 10.0, "higher", False),
    (0, 0, "lower", True), (1, 0, "lower", False), (None, 1.0, "lower", False), (None, 1.0, "higher", False),
])
def test_met_is_value_against_target(value, target, better, met):
    assert _common.goal("g", target, value, "x", better).met is met


def test_a_goal_needs_a_direction():
    with pytest.raises(ValueError, match="better"):
        _common.goal("g", 1.0, 0.5, "x", "smaller")  # type: ignore[arg-type]


def test_legacy_op_dicts_keep_their_meaning():
    gs = _common.goals_from_ops({
        "ratio": {"goal": 1.5, "op": "<=", "value": 1.24, "what": "a / b"},
        "rate": {"goal": 10.0, "op": ">=", "value": 4.6, "unit": "per s"},
        "info": {"something": 3},
    }, notes={"ratio": "61 / 49 ms"})
    assert [(g.name, g.better, g.met, g.unit, g.note) for g in gs] == [
        ("ratio", "lower", True, "x", "61 / 49 ms"), ("rate", "higher", False, "per s", "")]


def test_save_stamps_tree_machine_and_goals(tmp_path):
    plotted = []
    path = _common.save(str(tmp_path), "thing", {"machine": {"mem_total_mib": 7}, "n": 3},
                        lambda res, p: plotted.append(p), [_common.goal("p50_ms", 5.0, 3.8, "ms", "lower")], echo=False)
    res = json.loads(Path(path).read_text())
    assert res["tree"]["commit"] == _git("rev-parse", "HEAD")
    # what a bench run writes itself (results, the benchmarks page) does not count as a change
    changed = _git("diff", "--name-only", "HEAD").splitlines()
    assert res["tree"]["dirty"] == any(not p.startswith(("bench/results/", "docs/benchmarks.md")) for p in changed)
    m = res["machine"]
    assert m["mem_total_mib"] == 7 and m["nproc"] >= 1 and len(m["loadavg_before"]) == len(m["loadavg_after"]) == 3
    assert res["goals"] == [{"name": "p50_ms", "target": 5.0, "value": 3.8, "unit": "ms", "better": "lower", "met": True}]
    assert plotted == [str(tmp_path / "thing.png")]
    # what save writes is what benchdoc reads
    bd = _benchdoc()
    assert bd.load(Path(path)).goals[0].met is True


def _result(tmp_path: Path, name: str, commit: str, goals: list[_common.Goal], **extra) -> None:
    tree = _common.Tree(commit=commit, dirty=False, describe=commit[:7])
    res = {"tree": msgspec.to_builtins(tree), "machine": {"date": "2026-12-03 10:00:00"},
           "goals": [msgspec.to_builtins(g) for g in goals], **extra}
    (tmp_path / f"{name}.json").write_text(json.dumps(res))


DOC = """# Benchmarks

Prose before.

<!-- generated: summary -->
<!-- end generated: summary -->

### fast

How fast measures (method notes, kept).

<!-- generated: fast -->
old table
<!-- end generated: fast -->

### plain

<!-- generated: plain -->
<!-- end generated: plain -->

Prose after.
"""


def test_tables_state_each_goal_and_keep_the_prose(tmp_path):
    bd = _benchdoc()
    head = _git("rev-parse", "HEAD")
    _result(tmp_path, "fast", head, [_common.goal("create_p50", 1.5, 1.24, "x", "lower", "corral / runc", "61 / 49 ms"),
                                     _common.goal("throughput", 10, 4.6, "x", "higher", "corral / docker")])
    _result(tmp_path, "plain", head, [], headline={"rollouts_per_s": 2.556})
    out = bd.render(DOC, tmp_path)
    assert out.startswith("# Benchmarks\n\nProse before.\n") and out.endswith("Prose after.\n")
    assert "How fast measures (method notes, kept)." in out and "old table" not in out
    assert f"| create p50 | corral / runc | ≤ 1.5x | **1.24x** (61 / 49 ms) | MET | 2026-12-03, {head[:7]} |" in out
    assert f"| throughput | corral / docker | ≥ 10x | **4.6x** | **MISSED** | 2026-12-03, {head[:7]} |" in out
    assert "| [fast](#fast) | 1 of 2 | **throughput** |" in out
    assert "No numeric goal is set" in out and "| rollouts_per_s | **2.56** |" in out
    assert "stale" not in out
    assert bd.render(out, tmp_path) == out  # generating is idempotent


def test_old_and_foreign_runs_are_stale(tmp_path):
    bd = _benchdoc()
    old = _git("rev-parse", "HEAD~1")
    age = int(_git("rev-list", "--count", f"{old}..HEAD"))  # 1, or more when HEAD is a merge
    _result(tmp_path, "fast", old, [_common.goal("g", 1, 0.5, "x", "lower")])
    _result(tmp_path, "plain", "0" * 40, [_common.goal("g", 1, 0.5, "x", "lower")])
    out = bd.render(DOC, tmp_path, max_age=age - 1)
    assert f"{old[:7]}, **stale** (more than {age - 1} commits old)" in out
    assert "0000000, **stale** (not an ancestor of HEAD)" in out
    assert "stale" not in bd.table(bd.load(tmp_path / "fast.json"), max_age=age)


def test_check_fails_on_drift_and_on_a_result_without_a_table(tmp_path, capsys):
    bd = _benchdoc()
    head = _git("rev-parse", "HEAD")
    _result(tmp_path, "fast", head, [_common.goal("g", 1, 0.5, "x", "lower")])
    _result(tmp_path, "plain", head, [])
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    args = ["--doc", str(doc), "--results", str(tmp_path)]
    assert bd.main([*args, "--check"]) == 1
    assert bd.main(args) == 0 and bd.main([*args, "--check"]) == 0
    _result(tmp_path, "new", head, [])
    assert bd.main([*args, "--check"]) == 2
    assert "no <!-- generated: NAME --> block for new" in capsys.readouterr().err


def test_an_unstamped_result_is_refused(tmp_path):
    bd = _benchdoc()
    (tmp_path / "fast.json").write_text(json.dumps({"goals": {"x": {"goal": 1}}, "machine": {"date": "d"}}))
    with pytest.raises(bd.BenchdocError, match="not a stamped result"):
        bd.render(DOC, tmp_path)


def test_run_all_fails_a_module_that_leaves_no_stamped_result(tmp_path):
    from bench import run_all

    path = tmp_path / "x.json"
    assert "no readable" in run_all.unstamped(str(path), 0)
    path.write_text(json.dumps({"goals": {"a": {"goal": 1}}}))
    assert "no tree/goals stamp" in run_all.unstamped(str(path), 0)
    assert "not rewritten" in run_all.unstamped(str(path), path.stat().st_mtime + 10)
    _common.save(str(tmp_path), "x", {}, None, [], echo=False)
    assert run_all.unstamped(str(path), 0) == ""


def test_check_ignores_ageing_past_the_stale_limit(tmp_path):
    """A commit elsewhere in the tree ages every result; the check must not turn red for that alone,
    while a changed number still does."""
    bd = _benchdoc()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(bd.DOC.read_text(encoding="utf-8"), encoding="utf-8")
    assert bd.main(["--doc", str(doc), "--max-age", "0"]) == 0  # written with every result stale
    assert "**stale**" in doc.read_text(encoding="utf-8")
    assert bd.main(["--doc", str(doc), "--check"]) == 0  # default limit: fewer stale marks, same numbers
    text = doc.read_text(encoding="utf-8")
    i = text.index("**", text.index("<!-- generated:"))
    doc.write_text(text[:i] + "**99999" + text[i + 2:], encoding="utf-8")
    assert bd.main(["--doc", str(doc), "--check"]) == 1
