"""`corral eval` against the session stack: a policy named module:function runs N rollouts of the
demo environment C at a time; every rollout is graded (reward, per-test outcomes, alerts) and the
JSON and PNG reports say so. A policy that raises costs its rollout only (an error row, the sandbox
destroyed); a bad --policy is refused with a clear message."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import pytest_asyncio

from corral_sdk.demo_env import demo_spec
from corral_sdk.eval import NamedPolicy, evaluate, load_policy

from . import eval_policies

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
ENV = "calc-eval"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(client):
    res = await client.envs.build(demo_spec(ENV), job="eval-tests")
    assert res.accepted, res.report.summary()
    yield res.env
    await client.envs.delete(res.env.name, res.env.version)


def corral_eval(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corral_sdk.cli", "eval", *args],
                          env={**os.environ, "CORRAL_NATS_URL": stack.url, "COLUMNS": "200"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


async def test_cli_runs_grades_and_reports(stack, client, env, tmp_path):
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    p = await _in_thread(corral_eval, stack, ENV, "--policy", "tests.integration.eval_policies:fix", "--rollouts", "4",
                         "--concurrency", "4", "--json", str(js), "--png", str(png), "--job", "eval-cli")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    rep = json.loads(js.read_text())
    s = rep["summary"]
    assert (s["rollouts"], s["graded"], s["rewarded"], s["errors"], s["left_behind"]) == (4, 4, 4, 0, 0)
    assert s["env"] == ENV and s["version"] == env.version and s["rollouts_per_s"] > 0
    assert [r["i"] for r in rep["rows"]] == [0, 1, 2, 3]
    for r in rep["rows"]:
        assert r["reward"] == 1.0 and r["passed"] and not r["alerts"] and r["sandbox"].startswith("sb-")
        assert len(r["tests"]) == 6 and {t["outcome"] for t in r["tests"]} == {"passed"}
    # per-test tallies over the run: every named test passed in all four
    assert len(rep["tests"]) == 6 and all(t["passed"] == 4 and t["failed"] == 0 for t in rep["tests"])
    assert png.stat().st_size > 10_000
    assert "per-test outcomes" in p.stdout and "4 rollouts at concurrency 4" in p.stdout
    assert await client.list(job="eval-cli") == []


async def test_mixed_policies_outcomes_and_alerts(client, env):
    pols = [NamedPolicy("idle", eval_policies.idle), NamedPolicy("answers", eval_policies.read_answers),
            NamedPolicy("crash", eval_policies.crash), NamedPolicy("fix", eval_policies.fix)]
    rep = await evaluate(client, ENV, pols, rollouts=4, concurrency=4, job="eval-mixed")
    by = {r.policy: r for r in rep.rows}
    assert by["fix"].reward == 1.0
    # the unfixed code fails exactly the even-length hidden tests
    idle = by["idle"]
    assert idle.reward == 0.0 and not idle.passed and not idle.alerts
    assert {t.id.rsplit(".", 1)[-1] for t in idle.tests if t.outcome != "passed"} == {"test_median_even", "test_median_even_floats"}
    assert by["answers"].reward == 0.0 and "canary_read" in by["answers"].rules
    crash = by["crash"]
    assert crash.reward is None and crash.error.startswith("policy: RuntimeError: policy bug") and crash.sandbox
    s = rep.summary
    assert (s.graded, s.errors, s.rewarded, s.flagged, s.left_behind) == (3, 1, 1, 1, 0)
    assert [a.rule for a in rep.alerts if a.rule == "canary_read"] == ["canary_read"]
    even = next(t for t in rep.tests if t.id.endswith("test_median_even"))
    assert (even.expected, even.passed, even.failed) == ("fail_to_pass", 1, 2)
    # the policy was told the environment's task
    task = eval_policies.SEEN_TASKS[-1]
    assert task.env == ENV and task.version == env.version and task.limits.memory_mb == 256


async def test_bad_policy_refused(stack, env):
    for ref, why in (("nocolon", "expected module:function"), ("tests.integration.eval_policies:nope", "has no attribute"),
                     ("no_such_module_x:f", "cannot import"), ("tests.integration.eval_policies:not_async", "must be an async")):
        p = await _in_thread(corral_eval, stack, ENV, "--policy", ref, "--rollouts", "1")
        assert p.returncode == 2 and "invalid_request" in p.stdout and why in p.stdout, (ref, p.stdout, p.stderr)
    p = await _in_thread(corral_eval, stack, "no-such-env", "--policy", "tests.integration.eval_policies:fix")
    assert p.returncode == 2 and "not_found" in p.stdout, p.stdout
    assert load_policy("tests.integration.eval_policies:fix").name == "fix"


async def _in_thread(fn, *args):
    import asyncio

    return await asyncio.to_thread(fn, *args)


async def test_the_substrate_switch_reaches_every_rollout(client, env):
    """`substrate=` (`corral eval --substrate`, `corral demo --substrate`) is where the rollouts
    are created: one this stack does not offer is refused for each, clearly, and nothing is left."""
    rep = await evaluate(client, ENV, [NamedPolicy("fix", eval_policies.fix)], rollouts=2, concurrency=2, job="eval-substrate",
                         substrate="vm")
    assert [r.reward for r in rep.rows] == [None, None], rep.rows
    for r in rep.rows:
        assert r.error.startswith("create: ") and "vm" in r.error and not r.sandbox, r.error
    assert (rep.summary.errors, rep.summary.left_behind) == (2, 0)
    rep = await evaluate(client, ENV, [NamedPolicy("fix", eval_policies.fix)], rollouts=1, concurrency=1, job="eval-substrate",
                         substrate="container")
    assert rep.rows[0].reward == 1.0, rep.rows[0]
