"""The real-package environments (bench/hacks/pypi_envs.py: more-itertools and toolz from their
PyPI sdists, one off-by-one each) built and verified by the env-builder on the session stack,
and graded: the unsolved rollout gets 0, the reference fix and an alternative fix get 1. Also
that the debian image has the pytest the toolz environment's tests run with."""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from bench.hacks import pypi_envs

# the module fixture runs both packages' suites on the host, then builds and verifies both envs
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def built(client):
    envs = {e.name: e for e in await asyncio.to_thread(lambda: pypi_envs.PYPI_ENVS)}
    results = await asyncio.gather(*(client.envs.build(e.spec(), job="pypi-env-tests") for e in envs.values()))
    yield {name: (envs[name], res) for name, res in zip(envs, results)}
    for res in results:
        if res.env is not None:
            await client.envs.delete(res.env.name, res.env.version)


async def test_debian_image_has_pytest(client):
    sb = await client.create(image="debian", cpu=0.5, memory_mb=256, ttl_s=300)
    try:
        r = await sb.exec("python3 -m pytest --version 2>&1")
        assert r.exit_code == 0 and r.stdout.startswith("pytest "), r
    finally:
        await sb.destroy()


async def test_both_build_and_verify(built):
    assert set(built) == {"pypi-more-itertools", "pypi-toolz"}
    for name, (bench, res) in built.items():
        assert res.accepted, f"{name}: {res.report.summary()}"
        assert {c.name for c in res.report.checks} >= {"setup", "snapshot", "fails_unsolved", "passes_solved",
                                                       "no_protected_content"}
        assert all(c.ok for c in res.report.checks), res.report.summary()
        hidden = {p.path for p in res.env.protected}
        assert bench.target in hidden  # the unmutated file is the reference solution, kept out of sight
        assert any("/tests/test_" in p for p in hidden)


@pytest.mark.parametrize("name", ["pypi-more-itertools", "pypi-toolz"])
async def test_rollouts_graded(client, built, name):
    bench, res = built[name]
    unsolved, honest, alt = await asyncio.gather(*(client.envs.rollout(name) for _ in range(3)))
    # what the agent sees: the bug, the visible tests passing, the hidden test file absent
    hidden_tests = bench.notes["hidden"].split()
    r = await unsolved.exec(f"ls {' '.join(hidden_tests)} 2>&1; {bench.visible_test_cmd} >/dev/null 2>&1; echo rc=$?",
                            cwd=bench.workdir)
    assert "No such file" in r.stdout and r.stdout.strip().endswith("rc=0"), r
    assert (await unsolved.files.read(bench.target)).decode() == bench.buggy

    if bench.runner == "pytest":
        # the ids derived on the host (pytest 9) are the ones the image's pytest (7.2) gives
        made = pypi_envs.made(pypi_envs.TOOLZ, name)
        r = await unsolved.exec(f"python3 -m pytest -q -p no:cacheprovider --collect-only {' '.join(made.visible_tests)}",
                                cwd=bench.workdir)
        collected = {line.strip() for line in r.stdout.splitlines() if "::" in line}
        visible_p2p = {t for t in made.pass_to_pass if t.split("::")[0] in made.visible_tests}
        assert visible_p2p and visible_p2p <= collected, sorted(visible_p2p - collected)[:5]

    await honest.files.write(bench.target, bench.fixed)
    await alt.files.write(bench.target, bench.alt_fixes[-1])
    g0, g1, g2 = await asyncio.gather(*(client.envs.grade(sb, destroy=True) for sb in (unsolved, honest, alt)))
    assert g0.reward == 0.0 and not g0.passed, g0
    assert g1.reward == 1.0 and g1.passed and not g1.alerts, g1
    assert g2.reward == 1.0 and g2.passed and not g2.alerts, g2
    # graded per test by the runner the environment uses, with every named test reported
    spec = bench.spec()
    assert g1.runner == spec.runner and {t.id for t in g1.tests} == {*spec.fail_to_pass, *spec.pass_to_pass}
    failing = {t.id for t in g0.tests if t.outcome != "passed"}
    assert failing and failing <= set(spec.fail_to_pass), failing
