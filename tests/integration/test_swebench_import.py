"""`corral envs import-swebench` with instances made from a real package's history, the SWE-bench
way: the toolz 1.0.0 sdist becomes a git repository (its release as the first commit, a bug in
partition_all as the next, then the fix together with a test that exposes the bug); the instance's
patch and test_patch are that last commit's diff split into code and tests, and FAIL_TO_PASS /
PASS_TO_PASS come from SWE-bench's own pytest log parser reading `pytest -rA` logs before and after
the fix. Imported, built and verified on the session stack, the environment grades the gold patch
as solved and the untouched repository as not solved, per named test. Bad instances (a missing
field, an unknown commit, a patch that does not apply, a line that is not JSON) each get their own
clear error while the good one is still imported."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import pytest_asyncio

from corral_sdk.pypi_env import fetch_sdist, unpack_sdist
from corral_sdk.swebench_import import env_name, fail_pass_from_logs, swebench_fields

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

GOOD = "            yield prev[:len(seq) % n]\n"
BUG = "            yield prev[:len(seq) % n - 1]\n"
NEW_TEST = '''

def test_partition_all_keeps_the_last_element():
    assert list(partition_all(2, [1, 2, 3, 4, 5])) == [(1, 2), (3, 4), (5,)]
'''
TESTS = "toolz/tests/test_itertoolz.py"
GIT = ["git", "-c", "user.email=dev@example.com", "-c", "user.name=dev"]
INSTANCE_ID = "pytoolz__toolz-9001"


def git(repo: str, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def pytest_log(repo: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", TESTS], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    return r.stdout


def make_repo(root: str) -> dict:
    """The repository and the instance made of its history."""
    repo = unpack_sdist(fetch_sdist("toolz", "1.0.0"), os.path.join(root, "sdist"))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "toolz 1.0.0 as released")
    src = os.path.join(repo, "toolz/itertoolz.py")
    code = open(src).read()
    assert code.count(GOOD) == 1
    open(src, "w").write(code.replace(GOOD, BUG))
    git(repo, "commit", "-qam", "partition_all: refactor the tail")
    base = git(repo, "rev-parse", "HEAD").strip()
    open(src, "w").write(code)
    with open(os.path.join(repo, TESTS), "a") as f:
        f.write(NEW_TEST)
    git(repo, "commit", "-qam", "partition_all: keep the last element (fixes #9001)")
    fix = git(repo, "rev-parse", "HEAD").strip()
    patch = git(repo, "diff", base, fix, "--", "toolz/itertoolz.py")
    test_patch = git(repo, "diff", base, fix, "--", "toolz/tests")
    # the logs SWE-bench's harness would take: the tests of test_patch on the buggy code, then with the fix
    git(repo, "checkout", "-q", base)
    git(repo, "checkout", "-q", fix, "--", "toolz/tests")
    before = pytest_log(repo)
    git(repo, "checkout", "-q", "-f", "main")
    after = pytest_log(repo)
    f2p, p2p = fail_pass_from_logs(before, after)
    git(repo, "checkout", "-q", "-f", "main")
    inst = {"instance_id": INSTANCE_ID, "repo": "pytoolz/toolz", "base_commit": base, "patch": patch,
            "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": p2p,
            "problem_statement": "partition_all drops the last element: list(partition_all(2, [1, 2, 3, 4, 5])) "
                                 "ends with () instead of (5,).", "version": "1.0", "created_at": "2026-12-03",
            "hints_text": "", "environment_setup_commit": base}
    return {"repo": repo, "base": base, "fix": fix, "inst": inst, "f2p": f2p, "p2p": p2p}


def corral(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corral_sdk.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CORRAL_NATS_URL": stack.url, "COLUMNS": "200"})


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def imported(stack, client, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("swebench"))
    made = await asyncio.to_thread(make_repo, root)
    inst = made["inst"]
    bad_apply = inst["patch"].replace("-            yield prev[:len(seq) % n - 1]", "-            yield prev[:len(seq) % n - 2]")
    lines = [
        json.dumps(inst),
        json.dumps({k: v for k, v in inst.items() if k != "patch"} | {"instance_id": "missing-patch"}),
        json.dumps(inst | {"instance_id": "unknown-commit", "base_commit": "0123456789abcdef0123456789abcdef01234567"}),
        json.dumps(inst | {"instance_id": "bad-patch", "patch": bad_apply}),
        "{not json",
    ]
    jsonl = os.path.join(root, "instances.jsonl")
    with open(jsonl, "w") as f:
        f.write("\n".join(lines) + "\n")
    p = await asyncio.to_thread(corral, stack, "envs", "import-swebench", jsonl, "--repo-dir", made["repo"], "--job",
                                "swebench-tests", "--json", "--out", os.path.join(root, "specs"))
    rows = {r["line"]: r for r in map(json.loads, p.stdout.splitlines())}
    yield made, p, rows, os.path.join(root, "specs")
    if rows.get(1, {}).get("env"):
        name, _, version = rows[1]["env"].partition(":")
        await client.envs.delete(name, version)


async def test_instances_from_history(imported):
    made, *_ = imported
    # SWE-bench's parser read the logs: the new test and the existing partition_all tests fail before the fix
    assert f"{TESTS}::test_partition_all_keeps_the_last_element" in made["f2p"]
    assert f"{TESTS}::test_partition_all" in made["f2p"] and len(made["p2p"]) > 20
    assert not set(made["f2p"]) & set(made["p2p"])
    assert {"instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS"} <= swebench_fields()


async def test_import_errors_per_instance(imported):
    _, p, rows, specs = imported
    assert p.returncode == 1, p.stderr[-3000:]  # not every instance was accepted
    assert rows[1]["accepted"] and rows[1]["env"].startswith(env_name(INSTANCE_ID) + ":"), rows[1]
    assert rows[2]["instance_id"] == "missing-patch" and "missing required SWE-bench field(s): patch" in rows[2]["error"]
    assert "base_commit 0123456789abcdef0123456789abcdef01234567 is not a commit" in rows[3]["error"]
    assert rows[4]["error"].startswith("patch does not apply to base_commit after test_patch"), rows[4]
    assert rows[5]["error"].startswith("not JSON") and not rows[5]["accepted"]
    assert sorted(os.listdir(specs)) == [env_name(INSTANCE_ID) + ".json"]


async def test_graded_gold_solved_unpatched_not(client, imported):
    made, _, rows, _ = imported
    name, _, version = rows[1]["env"].partition(":")
    env = await client.envs.get(name, version)
    assert env.runner == "pytest" and env.tests_named == len(made["f2p"]) + len(made["p2p"])
    assert "partition_all drops the last element" in env.description
    unsolved, gold = await asyncio.gather(client.envs.rollout(name, version), client.envs.rollout(name, version))
    # what the agent gets: the buggy code at base_commit, one commit of history, no hidden test file
    r = await unsolved.exec(["/bin/sh", "-c", f"git log --all --oneline | wc -l; ls {TESTS} 2>&1; grep -c 'len(seq) % n - 1' "
                             "toolz/itertoolz.py"])
    lines = r.stdout.split("\n")
    assert lines[0].strip() == "1" and "No such file" in lines[1] and lines[2].strip() == "1", r
    r = await gold.exec(["git", "apply", "-"], stdin=made["inst"]["patch"])  # as an agent submits a diff
    assert r.exit_code == 0, r
    g0, g1 = await asyncio.gather(client.envs.grade(unsolved, destroy=True), client.envs.grade(gold, destroy=True))
    assert g0.reward == 0.0 and not g0.passed
    assert {t.id for t in g0.tests if t.outcome != "passed"} == set(made["f2p"]), g0.tests
    assert g1.reward == 1.0 and g1.passed and not g1.alerts, g1.reason
    outcomes = {t.id: (t.outcome, t.expected) for t in g1.tests}
    assert outcomes == {**{t: ("passed", "fail_to_pass") for t in made["f2p"]}, **{t: ("passed", "pass_to_pass") for t in made["p2p"]}}
