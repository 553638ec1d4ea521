"""The checks an environment must pass before it enters the catalog, each in fresh sandboxes of the
built image: the hidden tests fail unsolved and pass solved, twice each (stable), the agent-visible
image holds none of the protected content (by sha256), a pinned repository leaks no history, and
the environment's services (if any) start and get ready.

With a per-test runner (unittest, pytest) every test's outcome is read in all four runs: the tests
the spec names must behave as named, or (none named) fail_to_pass and pass_to_pass are derived:
tests failing in both unsolved runs and passing in both solved runs, and tests passing in all four."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from corral_common.contract import labels
from corral_common.contract.envs import CheckResult, EnvSpec, digest
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import ExecResult, SandboxSpec
from corral_sdk.client import AsyncClient, AsyncSandbox
from corral_sdk.envs import start_services

from . import gitpin, testrun, workspace
from .testrun import RunnerPlan, RunReport

PATCH_FILE = "/tmp/.corral-solution.patch"
CAPACITY_WAIT_S = 300.0  # the builder's and grader's own sandboxes wait out a full or hot cluster
APPLY_PATCH = (f"if command -v patch >/dev/null 2>&1; then patch -p1 --forward -s < {PATCH_FILE}; "
               f"else git apply --unsafe-paths {PATCH_FILE}; fi; rc=$?; rm -f {PATCH_FILE}; exit $rc")


@dataclass
class Case:
    solved: bool
    run: int
    result: ExecResult | None = None
    error: str = ""
    scan: str = ""  # `sha256  path` lines of the agent-visible image (first unsolved run only)
    git_check: ExecResult | None = None
    solved_hashes: dict[str, str] = field(default_factory=dict)  # path -> sha256 of patched files
    solved_sizes: set[int] = field(default_factory=set)
    report: RunReport | None = None  # per-test runners: what the trusted runner reported

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.exit_code == 0 and not self.result.timed_out

    def outcome(self, test: str) -> str:
        r = self.report.results.get(test) if self.report is not None else None
        return r.outcome if r is not None else "missing"

    def describe(self) -> str:
        what = "solved" if self.solved else "unsolved"
        if self.error:
            return f"{what} run {self.run + 1}: {self.error}"
        assert self.result is not None
        if self.report is not None:
            bad = [f"  {t}: {r.outcome} {r.message[:300]}" for t, r in sorted(self.report.results.items()) if r.outcome != "passed"]
            head = f"{what} run {self.run + 1}: {len(self.report.results)} tests, {len(bad)} not passed"
            return "\n".join([head, *bad[:40], *(f"  runner: {e[:500]}" for e in self.report.errors[:5])])
        return f"{what} run {self.run + 1}: {workspace.tail(self.result, 1500)}"


def sandbox_spec(spec: EnvSpec, image: str, role: str, job: str) -> SandboxSpec:
    lim = spec.limits
    return SandboxSpec(image=image, cpu=lim.cpu, memory_mb=lim.memory_mb, disk_mb=lim.disk_mb, pids_max=lim.pids_max,
                       ttl_s=max(600.0, spec.test_timeout_s * 4), workdir=spec.workdir, job=job,
                       labels={labels.ROLE: role, labels.ENV: spec.name})


async def apply_solution(sb: AsyncSandbox, spec: EnvSpec) -> None:
    files = {spec.abspath(p): c.encode() for p, c in spec.solution.files.items()}
    if spec.solution.patch:
        files[PATCH_FILE] = spec.solution.patch.encode()
    await workspace.put_files(sb, files)
    if spec.solution.patch:
        r = await sb.exec(["/bin/sh", "-c", APPLY_PATCH], cwd=spec.workdir, timeout_s=120)
        if r.exit_code != 0:
            raise RuntimeError(f"the solution patch does not apply: {workspace.tail(r)}")


async def run_tests(sb: AsyncSandbox, spec: EnvSpec) -> ExecResult:
    return await sb.exec(["/bin/sh", "-c", spec.test_command], cwd=spec.workdir, timeout_s=spec.test_timeout_s,
                         max_output_bytes=256 * 1024)


async def _run_case(client: AsyncClient, spec: EnvSpec, plan: RunnerPlan, image: str, job: str, case: Case,
                    scan_sizes: set[int]) -> None:
    try:
        sb = await client.create_spec(sandbox_spec(spec, image, "env-verify", job), wait_for_capacity_s=CAPACITY_WAIT_S)
    except Exception as e:
        case.error = f"could not create a sandbox: {e}"
        return
    try:
        if scan_sizes:  # before anything protected is written: this is what an agent would see
            r = await sb.exec(["/bin/sh", "-c", workspace.scan_script(scan_sizes)], timeout_s=300, max_output_bytes=8 << 20)
            case.scan = r.stdout
        if spec.git is not None and not case.solved and case.run == 0:
            case.git_check = await sb.exec(["bash", "-c", gitpin.check_script(spec.git.path)], timeout_s=120)
        hidden = {spec.abspath(p): c.encode() for p, c in spec.hidden_files.items()}
        if plan.kind == "command":
            await workspace.put_files(sb, hidden)
        else:
            await testrun.install(sb, hidden)
        if case.solved:
            await apply_solution(sb, spec)
            if case.run == 0:
                for rel in workspace.patch_targets(spec.solution.patch):
                    try:
                        data = await sb.files.read(spec.abspath(rel))
                    except Exception:
                        continue
                    if data:
                        case.solved_hashes[spec.abspath(rel)] = digest(data)
                        case.solved_sizes.add(len(data))
        if plan.kind == "command":
            case.result = await run_tests(sb, spec)
        else:
            case.report, case.result = await testrun.run(sb, plan, spec.workdir, spec.test_timeout_s)
            if case.report is None:
                case.error = f"the test runner gave no result: {workspace.tail(case.result, 1500)}"
    except Exception as e:
        case.error = str(e)
    finally:
        try:
            await sb.destroy()
        except Exception:  # cleanup: the check's own outcome matters; a sandbox left behind expires with its TTL
            pass


def protected_hashes(spec: EnvSpec, solved_hashes: dict[str, str]) -> dict[str, str]:
    """sha256 -> what it is, for every non-empty piece of protected content."""
    out = {digest(c): f"hidden file {spec.abspath(p)}" for p, c in spec.hidden_files.items() if c}
    out.update({digest(c): f"solution file {spec.abspath(p)}" for p, c in spec.solution.files.items() if c})
    out.update({h: f"solved version of {p}" for p, h in solved_hashes.items()})
    return out


@dataclass
class Verified:
    checks: list[CheckResult]
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    test_files: list[str] = field(default_factory=list)  # absolute paths of the files defining them


async def verify(client: AsyncClient, spec: EnvSpec, plan: RunnerPlan, image: str, job: str) -> Verified:
    t0 = time.perf_counter()
    sizes = {len(c.encode()) for c in (*spec.hidden_files.values(), *spec.solution.files.values()) if c}
    cases = [Case(solved=False, run=0), Case(solved=False, run=1), Case(solved=True, run=0), Case(solved=True, run=1)]
    # a patched file's solved content is only known after solving: that run goes first, then the
    # scan looks for it too
    await _run_case(client, spec, plan, image, job, cases[2], set())
    scan = sizes | cases[2].solved_sizes
    services = asyncio.ensure_future(services_check(client, spec, image, job)) if spec.services else None
    await asyncio.gather(*(_run_case(client, spec, plan, image, job, c, scan if c is cases[0] else set())
                           for c in (cases[0], cases[1], cases[3])))
    secs = round(time.perf_counter() - t0, 2)
    un, so = cases[:2], cases[2:]
    errors = [c for c in cases if c.error]
    if plan.kind == "command":
        out = Verified(checks=_exit_status_checks(un, so, errors, cases, secs))
    else:
        out = per_test_checks(spec, plan, cases, secs)
    out.checks += _content_checks(spec, cases, secs)
    if services is not None:
        out.checks.append(await services)
    return out


async def services_check(client: AsyncClient, spec: EnvSpec, image: str, job: str) -> CheckResult:
    """The environment's services start in a sandbox of the built image and get ready, as every
    rollout will start them (envs.start_services): a spec whose app never comes up is refused here,
    not discovered in every rollout."""
    t0 = time.perf_counter()
    try:
        sb = await client.create_spec(sandbox_spec(spec, image, "env-verify", job), wait_for_capacity_s=CAPACITY_WAIT_S)
    except Exception as e:
        return CheckResult(name="services", ok=False, detail="could not create a sandbox", evidence=str(e)[:4000],
                           seconds=round(time.perf_counter() - t0, 2))
    try:
        await start_services(sb, spec.services)
        ok, detail, evidence = True, f"{len(spec.services)} service(s) started and ready", ""
    except CorralError as e:
        ok, detail, evidence = False, "a service did not start or get ready", e.message
    finally:
        try:
            await sb.destroy()
        except Exception:  # cleanup: the check's own outcome matters; a sandbox left behind expires with its TTL
            pass
    return CheckResult(name="services", ok=ok, detail=detail, evidence=evidence[:4000], seconds=round(time.perf_counter() - t0, 2))


def _exit_status_checks(un: list[Case], so: list[Case], errors: list[Case], cases: list[Case], secs: float) -> list[CheckResult]:
    checks: list[CheckResult] = []
    checks.append(CheckResult(
        name="fails_unsolved", ok=all(not c.passed and not c.error for c in un), seconds=secs,
        detail="the hidden tests fail without the solution" if all(not c.passed and not c.error for c in un) else
        ("a verification run broke" if any(c.error for c in un) else "the tests already pass without the solution"),
        evidence="\n\n".join(c.describe() for c in un)))
    checks.append(CheckResult(
        name="passes_solved", ok=all(c.passed for c in so), seconds=secs,
        detail="the hidden tests pass with the reference solution" if all(c.passed for c in so) else
        ("a verification run broke" if any(c.error for c in so) else "the tests fail with the reference solution"),
        evidence="\n\n".join(c.describe() for c in so)))
    stable = not errors and un[0].passed == un[1].passed and so[0].passed == so[1].passed
    checks.append(CheckResult(name="stable", ok=stable, seconds=secs,
                              detail="two runs agree, unsolved and solved" if stable else "two runs of the same state disagree (flaky tests?)",
                              evidence="" if stable else "\n\n".join(c.describe() for c in cases)))
    return checks


def per_test_checks(spec: EnvSpec, plan: RunnerPlan, cases: list[Case], secs: float) -> Verified:
    """fail_to_pass / pass_to_pass checked (named) or derived (not named) from four runs' outcomes."""
    un, so = cases[:2], cases[2:]
    broken = [c for c in cases if c.error or c.report is None]
    if broken:
        ev = "\n\n".join(c.describe() for c in broken)
        return Verified(checks=[CheckResult(name=n, ok=False, seconds=secs, detail="a verification run broke", evidence=ev)
                                for n in ("fails_unsolved", "passes_solved")])
    collected: dict[str, str] = {}
    for c in (*so, *un):
        collected = {**(c.report.collected or {}), **collected}  # type: ignore[union-attr]
    everything = sorted(set(collected) | {t for c in cases for t in c.report.results})  # type: ignore[union-attr]
    flaky = sorted(t for t in everything if un[0].outcome(t) != un[1].outcome(t) or so[0].outcome(t) != so[1].outcome(t))
    checks: list[CheckResult] = []
    if spec.fail_to_pass or spec.pass_to_pass:
        f2p, p2p = list(spec.fail_to_pass), list(spec.pass_to_pass)
        unknown = sorted(t for t in {*f2p, *p2p} if t not in collected)
        checks.append(CheckResult(name="tests_named", ok=not unknown, seconds=secs,
                                  detail=f"{len(f2p)} fail_to_pass and {len(p2p)} pass_to_pass tests exist" if not unknown else
                                  f"{len(unknown)} named test(s) do not exist (the runner collected {len(collected)})",
                                  evidence="\n".join(unknown[:100])))
    else:
        f2p = [t for t in everything if t not in flaky and all(c.outcome(t) != "passed" for c in un)
               and all(c.outcome(t) == "passed" for c in so)]
        p2p = [t for t in everything if t not in flaky and all(c.outcome(t) == "passed" for c in cases)]
        checks.append(CheckResult(name="tests_named", ok=True, seconds=secs,
                                  detail=f"derived {len(f2p)} fail_to_pass and {len(p2p)} pass_to_pass tests of {len(everything)}"))
    still_pass = [t for t in f2p if any(c.outcome(t) == "passed" for c in un)]
    checks.append(CheckResult(
        name="fails_unsolved", ok=bool(f2p) and not still_pass, seconds=secs,
        detail=(f"{len(f2p)} fail_to_pass tests fail without the solution" if f2p and not still_pass else
                ("no test fails without the solution and passes with it" +
                 ("; the tests already pass without the solution" if everything and all(c.outcome(t) == "passed" for c in un for t in everything) else ""))
                if not f2p else
                f"{len(still_pass)} fail_to_pass test(s) already pass without the solution"),
        evidence="\n".join(still_pass[:50]) or "\n\n".join(c.describe() for c in un)))
    not_solved = [f"{t}: {c.outcome(t)}" for t in (*f2p, *p2p) for c in so if c.outcome(t) != "passed"]
    broke = [f"{t}: {c.outcome(t)} unsolved" for t in p2p for c in un if c.outcome(t) != "passed"]
    checks.append(CheckResult(
        name="passes_solved", ok=bool(f2p) and not not_solved and not broke, seconds=secs,
        detail=("the named tests pass with the reference solution" if f2p and not not_solved and not broke else
                "the tests fail with the reference solution" if not_solved or not f2p else
                "pass_to_pass tests fail without the solution"),
        evidence="\n".join([*not_solved, *broke][:100]) or "\n\n".join(c.describe() for c in so)))
    named_flaky = sorted(set(flaky) & {*f2p, *p2p, *spec.fail_to_pass, *spec.pass_to_pass})
    checks.append(CheckResult(name="stable", ok=not named_flaky, seconds=secs,
                              detail=("two runs agree, unsolved and solved" + (f"; {len(flaky)} flaky test(s) left out" if flaky else ""))
                              if not named_flaky else f"{len(named_flaky)} named test(s) flip between two runs of the same state",
                              evidence="\n".join(flaky[:50])))
    # every file the runner collected tests from is the grader's, named tests or not: a test module
    # an agent edits could patch the framework when discovery imports it
    root = spec.workdir.rstrip("/") + "/"
    files = sorted({f for t in {*collected, *f2p, *p2p} if (f := testrun.test_file(plan, spec.workdir, t, collected.get(t, "")))
                    and f.endswith(".py") and f.startswith(root)})
    return Verified(checks=checks, fail_to_pass=f2p, pass_to_pass=p2p, test_files=files)


def _content_checks(spec: EnvSpec, cases: list[Case], secs: float) -> list[CheckResult]:
    checks: list[CheckResult] = []
    wanted = protected_hashes(spec, cases[2].solved_hashes)
    leaks = []
    for line in cases[0].scan.splitlines():
        h, _, path = line.partition("  ")
        if h in wanted:
            leaks.append(f"{path}: same content as the {wanted[h]} (sha256 {h[:16]})")
    scanned = bool(cases[0].scan) or not cases[0].error
    checks.append(CheckResult(
        name="no_protected_content", ok=scanned and not leaks, seconds=secs,
        detail=(f"{len(wanted)} protected contents, none in the agent-visible image" if scanned and not leaks else
                "protected content found in the agent-visible image" if leaks else "the scan did not run"),
        evidence="\n".join(leaks[:50]) or cases[0].error))
    if spec.git is not None:
        g = cases[0].git_check
        ok = g is not None and g.exit_code == 0
        checks.append(CheckResult(name="git_pinned", ok=ok, seconds=secs,
                                  detail="no history beyond the pinned commit" if ok else "the repository still reveals other history",
                                  evidence=workspace.tail(g) if g is not None else cases[0].error))
    return checks
