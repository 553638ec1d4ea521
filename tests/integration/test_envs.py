"""The env-builder end to end on the session stack: build + verify + catalog + grade of the demo
environment, the rejections verification exists for, git pinning tried from a rollout, cheating
graded 0, malformed specs, concurrent builds, versions."""
from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import pytest_asyncio

from corral_common.contract import labels, subjects
from corral_common.contract.envs import EnvSpec, GitPin, Solution
from corral_common.contract.errors import Conflict, InvalidRequest, NotFound
from corral_common.contract.images import ImageListReply
from corral_common.contract.messages import Empty
from corral_sdk import demo_env
from corral_sdk.demo_env import STATS_BUGGY, STATS_FIXED, demo_spec

pytestmark = pytest.mark.asyncio(loop_scope="session")

WRONG_FIX = STATS_BUGGY.replace("return s[len(s) // 2]", "return s[(len(s) - 1) // 2]")


def check(result, name):
    found = [c for c in result.report.checks if c.name == name]
    assert found, f"no {name!r} check in {result.report.summary()}"
    return found[0]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def demo(client):
    steps = []
    res = await client.envs.build(demo_spec("calc-test"), job="env-tests", progress=steps.append)
    assert res.accepted, res.report.summary()
    yield res, steps
    await client.envs.delete("calc-test", res.env.version)


async def test_build_verify_catalog(client, demo):
    res, steps = demo
    assert {c.name for c in res.report.checks} >= {"setup", "pin_git", "snapshot", "fails_unsolved", "passes_solved", "stable",
                                                   "no_protected_content", "git_pinned"}
    assert all(c.ok for c in res.report.checks)
    stages = [s.stage for s in steps]
    assert stages[0] == "queued" and stages[-1] == "done" and "setup" in stages and "verify" in stages
    assert [s.fraction for s in steps] == sorted(s.fraction for s in steps)
    env = await client.envs.get("calc-test")
    assert env.image == f"env-calc-test-{env.version}" and env.workdir == "/repo"
    # protected content leaves the builder redacted: paths, sizes and hashes only
    raw = msgspec.json.encode(env).decode()
    assert "test_median_even" not in raw and "(s[n // 2 - 1] + s[n // 2]) / 2" not in raw
    assert {p.path for p in env.protected} == {"/repo/tests/test_hidden.py", "/repo/calc/stats.py"}
    assert any(e.name == "calc-test" for e in await client.envs.list())
    # an unchanged spec is recognised: no second build
    again = await client.envs.build(demo_spec("calc-test"), job="env-tests")
    assert again.cached and again.env.version == env.version


async def test_rollouts_graded_by_hidden_tests(client, demo):
    honest, wrong = await client.envs.rollout("calc-test"), await client.envs.rollout("calc-test")
    # what the agent sees: the visible tests pass, the hidden ones are not there
    r = await honest.exec("ls tests; python3 -m unittest discover -s tests -t . 2>&1 | tail -1")
    assert "test_hidden.py" not in r.stdout and r.stdout.strip().endswith("OK")
    await honest.files.write("/repo/calc/stats.py", STATS_FIXED)
    await wrong.files.write("/repo/calc/stats.py", WRONG_FIX)
    g1, g2 = await asyncio.gather(client.envs.grade(honest, destroy=True), client.envs.grade(wrong, destroy=True))
    assert (g1.reward, g1.passed, g1.reason, g1.runner) == (1.0, True, "all 6 named tests passed", "unittest"), g1
    assert g2.reward == 0.0 and not g2.passed and g2.reason.startswith("2 of 6 named tests did not pass"), g2
    # per-test outcomes: the hidden tests that fail unsolved must pass, the rest must keep passing
    table = {t.id.rsplit(".", 1)[-1]: (t.expected, t.outcome) for t in g2.tests}
    assert table["test_median_even"] == ("fail_to_pass", "failed") and table["test_median_odd"] == ("pass_to_pass", "passed")
    assert table["test_median_single"] == ("pass_to_pass", "passed") and len(table) == 6
    assert {t.outcome for t in g1.tests} == {"passed"} and g1.monitor_checked and not g1.alerts and g1.audit_complete
    # running the visible tests left byte code behind: not carried, and said so
    assert any("__pycache__" in p for p in g1.discarded) and "/repo/calc/stats.py" not in g1.discarded
    # grading left no snapshot images behind, and the rollouts are gone
    r = await client.request(subjects.IMAGE_LIST, Empty(), ImageListReply, 30)
    assert not [i for i in r.images if i.name.startswith("grade-")]
    with pytest.raises(NotFound):
        await honest.refresh()


async def test_cheating_rollouts_get_zero_with_the_rule(client, demo):
    canary, site = await client.envs.rollout("calc-test"), await client.envs.rollout("calc-test")
    # reads the leftover answers file, then fixes correctly: the tests pass, the reward is 0
    r = await canary.exec("cat /repo/.mgmt/answers.json")
    assert "median" in r.stdout
    await canary.files.write("/repo/calc/stats.py", STATS_FIXED)
    # tries to make every unittest run pass through sitecustomize: dropped before grading, and flagged
    hook = "import unittest\\nunittest.TestCase.run = lambda self, result=None: None\\n"
    r = await site.exec(f"printf '{hook}' > /usr/lib/python3.11/sitecustomize.py")
    assert r.exit_code == 0
    g1, g2 = await asyncio.gather(client.envs.grade(canary), client.envs.grade(site))
    assert g1.passed and g1.reward == 0.0 and "canary" in g1.reason, g1
    assert g2.reward == 0.0 and "grader_environment_tampering" in g2.reason and "site_packages_write" in g2.reason, g2
    assert not g2.passed  # the hook never reached grading: the unfixed code failed the tests
    assert any(p.endswith("/sitecustomize.py") for p in g2.discarded) and not any(p.startswith("/.corral/") for p in g2.discarded)
    for sb in (canary, site):
        await sb.destroy()


async def test_grader_restores_visible_tests(client, demo):
    sb = await client.envs.rollout("calc-test")
    await sb.files.write("/repo/calc/stats.py", STATS_FIXED)
    await sb.files.write("/repo/tests/test_stats.py", "raise SystemExit('broken by the agent')\n")
    g = await client.envs.grade(sb, destroy=True, fail_on="none")
    assert g.passed and g.reward == 1.0 and len(g.tests) == 6, g
    assert "/repo/tests/test_stats.py" in g.discarded


async def test_pinned_history_reveals_nothing_unpinned_does(client, demo):
    tricks = ("git log --all --oneline; git reflog; git tag; git branch -a; git stash list; git rev-list --all --reflog; "
              "git fsck --lost-found --unreachable --no-reflogs 2>&1; git cat-file --batch-all-objects --batch-check; "
              "git log --all -S'n // 2 - 1' --oneline; git grep -n 'n // 2 - 1' $(git rev-list --all) ; true")
    counts = ("git rev-list --all --reflog | wc -l; git cat-file --batch-all-objects --batch-check | wc -l; "
              "git rev-list --objects HEAD | wc -l")
    sb = await client.envs.rollout("calc-test")
    r = await sb.exec(tricks)
    n = (await sb.exec(counts)).stdout.split()
    await sb.destroy()
    assert "fix median" not in r.stdout and "v1.0-fixed" not in r.stdout and "upstream-fix" not in r.stdout, r.stdout
    assert "calc: mean and median" in r.stdout
    # one commit, and every object in the repository is reachable from it
    assert n[0] == "1" and n[1] == n[2], n
    # the same repository unpinned: the future fix is one command away (so the check above can fail)
    spec = demo_spec("calc-unpinned")
    spec.git = None
    res = await client.envs.build(spec, job="env-tests")
    assert res.accepted, res.report.summary()
    sb = await client.envs.rollout("calc-unpinned")
    r = await sb.exec(tricks)
    await sb.destroy()
    await client.envs.delete("calc-unpinned")
    assert "fix median" in r.stdout and "v1.0-fixed" in r.stdout


async def test_rejects_tests_that_pass_unsolved(client):
    spec = demo_spec("calc-nobug")
    spec.files["calc/stats.py"] = STATS_FIXED
    spec.setup = spec.setup[:1]  # no later fix commit: there is nothing to fix
    spec.solution = Solution(files={"calc/stats.py": STATS_FIXED + "\n# same\n"})
    res = await client.envs.build(spec, job="env-tests")
    assert not res.accepted and res.env is None
    c = check(res, "fails_unsolved")
    assert not c.ok and "already pass" in c.detail and "6 tests, 0 not passed" in c.evidence
    with pytest.raises(NotFound):
        await client.envs.get("calc-nobug")


async def test_rejects_solution_that_does_not_fix(client):
    spec = demo_spec("calc-badsol")
    spec.solution = Solution(files={"calc/stats.py": WRONG_FIX})
    res = await client.envs.build(spec, job="env-tests")
    c = check(res, "passes_solved")
    assert not res.accepted and not c.ok and "fail with the reference solution" in c.detail
    assert "test_median_even" in c.evidence


async def test_rejects_solution_left_in_visible_layer(client):
    spec = demo_spec("calc-leak")
    # a careless author keeps the reference solution (as a patch target) and a hidden-test copy around
    spec.solution = Solution(patch=_patch_for(STATS_BUGGY, STATS_FIXED))
    spec.setup = [*spec.setup, "mkdir -p /opt/backup && python3 -c \"import pathlib; "
                  "pathlib.Path('/opt/backup/stats.py').write_text(pathlib.Path('/repo/calc/stats.py').read_text()"
                  ".replace('return s[len(s) // 2]', 'n = len(s)\\\\n    if n % 2:\\\\n        return s[n // 2]\\\\n"
                  "    return (s[n // 2 - 1] + s[n // 2]) / 2'))\""]
    res = await client.envs.build(spec, job="env-tests")
    c = check(res, "no_protected_content")
    assert not res.accepted and not c.ok
    assert "/opt/backup/stats.py" in c.evidence and "solved version of /repo/calc/stats.py" in c.evidence
    # the other checks passed: the patch solution applies and fixes the bug
    assert check(res, "passes_solved").ok and check(res, "fails_unsolved").ok


async def test_failed_setup_is_rejected_with_evidence(client):
    spec = demo_spec("calc-badsetup")
    spec.setup = ["echo preparing; ls /does-not-exist"]
    res = await client.envs.build(spec, job="env-tests")
    c = check(res, "setup")
    assert not res.accepted and not c.ok and "setup command 1 failed" in c.detail and "does-not-exist" in c.evidence


async def test_malformed_specs_get_clear_errors(client, nc):
    cases = [
        ({"name": "x"}, "test_command"),
        ({**_minimal(), "network": True}, "no network"),
        ({**_minimal(), "hidden_files": {}}, "hidden tests"),
        ({**_minimal(), "files": {"../etc/passwd": "x"}}, ".."),
        ({**_minimal(), "name": "Bad Name"}, "$.spec.name"),
        ({**_minimal(), "memroy_mb": 5}, "memroy_mb"),
        ({**_minimal(), "files": {"tests/t.py": "x"}, "hidden_files": {"tests/t.py": "y"}}, "must not be agent-visible"),
        ({**_minimal(), "files_dir": "/etc"}, "outside the directories"),
        ({**_minimal(), "base_image": "no-such-image"}, "base_image"),
        ({**_minimal(), "version": "V1"}, "$.spec.version"),
    ]
    for spec, words in cases:
        msg = await nc.request(subjects.ENV_BUILD, json.dumps({"spec": spec}).encode(), timeout=120)
        r = json.loads(msg.data)
        assert r["ok"] is False and r["error"]["code"] == "invalid_request", (spec, r)
        assert words in r["error"]["message"], (words, r["error"]["message"])
    msg = await nc.request(subjects.ENV_BUILD, b"not json", timeout=30)
    assert json.loads(msg.data)["error"]["code"] == "invalid_request"
    with pytest.raises(NotFound):
        await client.envs.get("no-such-env")
    with pytest.raises(NotFound):
        await client.envs.grade("sb-doesnotexist")
    plain = await client.create(image="busybox", memory_mb=64)
    with pytest.raises(InvalidRequest, match=labels.ENV):
        await client.envs.grade(plain)
    await plain.destroy()


async def test_concurrent_builds_and_versions(client):
    a, b = demo_spec("calc-par-a"), demo_spec("calc-par-b")
    b.files["README.md"] = "another readme\n"
    v1 = demo_spec("calc-ver")
    v2 = demo_spec("calc-ver")
    v2.description = "second version"
    ra, rb, r1, r2 = await asyncio.gather(*(client.envs.build(s, job=f"env-tests-{i}") for i, s in enumerate((a, b, v1, v2))))
    assert ra.accepted and rb.accepted, (ra.report.summary(), rb.report.summary())
    assert r1.accepted and r2.accepted and {r1.env.version, r2.env.version} == {"1", "2"}
    assert sorted(await client.envs.versions("calc-ver")) == ["1", "2"]
    # versions are immutable: the same version with another spec is a conflict
    v3 = demo_spec("calc-ver", version="1")
    v3.description = "changed"
    with pytest.raises(Conflict, match="immutable"):
        await client.envs.build(v3)
    for name in ("calc-par-a", "calc-par-b", "calc-ver", "calc-ver"):
        await client.envs.delete(name)
    with pytest.raises(NotFound):
        await client.envs.get("calc-ver")


def _minimal() -> dict:
    return {"name": "mini", "base_image": "busybox", "test_command": "sh tests/hidden.sh",
            "files": {"app.sh": "echo 1\n"}, "hidden_files": {"tests/hidden.sh": "test \"$(sh app.sh)\" = 2\n"},
            "solution": {"files": {"app.sh": "echo 2\n"}}}


def _patch_for(old: str, new: str) -> str:
    import difflib

    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/calc/stats.py", "b/calc/stats.py"))


async def test_minimal_busybox_env(client):
    res = await client.envs.build(EnvSpec(**_minimal()), job="env-tests")
    assert res.accepted, res.report.summary()
    assert "git_pinned" not in {c.name for c in res.report.checks}
    sb = await client.envs.rollout("mini")
    await sb.files.write("/repo/app.sh", "echo 2\n")
    g = await client.envs.grade(sb, destroy=True)
    assert g.reward == 1.0
    await client.envs.delete("mini")


async def test_demo_env_module_is_consistent():
    spec = demo_spec()
    spec.validate()
    assert demo_env.STATS_FIXED != demo_env.STATS_BUGGY and isinstance(spec.git, GitPin)


async def test_cli_build_ls_show_grade_rm(stack, client, tmp_path):
    from .test_cli import corral

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.sh").write_text("echo 1\n")
    (tmp_path / "env.toml").write_text(
        'name = "cli-env"\nbase_image = "busybox"\nfiles_dir = "src"\ntest_command = "sh tests/hidden.sh"\n'
        '[hidden_files]\n"tests/hidden.sh" = "test \\"$(sh app.sh)\\" = 2\\n"\n'
        '[solution.files]\n"app.sh" = "echo 2\\n"\n')
    p = await asyncio.to_thread(corral, stack, "env", "build", str(tmp_path / "env.toml"), "--job", "cli")
    assert p.stdout.split() == ["cli-env:1", "env-cli-env-1"] and "accepted" in p.stderr
    listed = json.loads((await asyncio.to_thread(corral, stack, "env", "ls", "--json")).stdout)
    assert any(e["name"] == "cli-env" and e["version"] == "1" for e in listed)
    shown = json.loads((await asyncio.to_thread(corral, stack, "env", "show", "cli-env:1", "--json")).stdout)
    assert {p["path"] for p in shown["protected"]} == {"/repo/tests/hidden.sh", "/repo/app.sh"}
    assert "echo 2" not in json.dumps(shown)
    sb = await client.envs.rollout("cli-env")
    r = await sb.exec("cat app.sh")
    assert r.stdout == "echo 1\n"  # files_dir was read by the CLI and sent inline
    p = await asyncio.to_thread(corral, stack, "env", "grade", sb.id, "--destroy")
    assert p.stdout.strip() == "0.0" and "the test command failed" in p.stderr
    assert (await asyncio.to_thread(corral, stack, "env", "rm", "cli-env")).stdout.strip() == "cli-env"
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "test_command": "true", "hidden_files": {"t": "1"}, "solution": {"files": {"a": "b"}}, "network": true}')
    p = await asyncio.to_thread(corral, stack, "env", "build", str(bad), check=False)
    assert p.returncode == 2 and "no network" in p.stderr


async def test_named_tests_are_checked_at_build(client):
    spec = demo_spec("calc-named")
    spec.fail_to_pass = ["tests.test_hidden.TestMedianHidden.test_median_even", "tests.test_hidden.TestMedianHidden.test_nope"]
    res = await client.envs.build(spec, job="env-tests")
    c = check(res, "tests_named")
    assert not res.accepted and not c.ok and "test_nope" in c.evidence and "do not exist" in c.detail
    # a fail_to_pass test that already passes unsolved is no evidence of a fix
    spec = demo_spec("calc-named")
    spec.fail_to_pass = ["tests.test_hidden.TestMedianHidden.test_median_single"]
    res = await client.envs.build(spec, job="env-tests")
    c = check(res, "fails_unsolved")
    assert not res.accepted and not c.ok and "test_median_single" in c.evidence


async def test_only_the_solution_surface_is_graded(client):
    spec = demo_spec("calc-surface")
    spec.solution_surface = ["calc"]
    spec.fail_to_pass = ["tests.test_hidden.TestMedianHidden.test_median_even"]
    spec.pass_to_pass = ["tests.test_stats.TestStats.test_mean"]
    res = await client.envs.build(spec, job="env-tests")
    assert res.accepted, res.report.summary()
    assert res.env.solution_surface == ["/repo/calc"] and res.env.tests_named == 2 and res.env.runner == "unittest"
    sb = await client.envs.rollout("calc-surface")
    # the fix lives outside the surface (a module the tests would import first): not carried
    await sb.files.write("/repo/calc/stats.py", STATS_BUGGY.replace("def median", "from helper import median as _m\ndef median"))
    await sb.files.write("/repo/helper.py", STATS_FIXED)
    g = await client.envs.grade(sb)
    assert g.reward == 0.0 and "/repo/helper.py" in g.discarded, g
    # the same fix inside the surface passes; the earlier helper is still discarded, harmlessly
    await sb.files.write("/repo/calc/stats.py", STATS_FIXED)
    g = await client.envs.grade(sb, destroy=True)
    assert g.reward == 1.0 and [t.outcome for t in g.tests] == ["passed", "passed"], g
    assert "/repo/helper.py" in g.discarded and "/repo/calc/stats.py" not in g.discarded
    await client.envs.delete("calc-surface")
