"""The checks an environment must pass before it enters the catalog, each in fresh sandboxes of the
built image: the hidden tests fail unsolved and pass solved, twice each (stable), the agent-visible
image holds none of the protected content (by sha256), and a pinned repository leaks no history."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from corral_common.envs import CheckResult, EnvSpec, digest
from corral_common.messages import ExecResult, SandboxSpec
from corral_sdk.client import AsyncClient, AsyncSandbox

from . import gitpin, workspace

PATCH_FILE = "/tmp/.corral-solution.patch"
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

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.exit_code == 0 and not self.result.timed_out

    def describe(self) -> str:
        what = "solved" if self.solved else "unsolved"
        if self.error:
            return f"{what} run {self.run + 1}: {self.error}"
        assert self.result is not None
        return f"{what} run {self.run + 1}: {workspace.tail(self.result, 1500)}"


def sandbox_spec(spec: EnvSpec, image: str, role: str, job: str) -> SandboxSpec:
    lim = spec.limits
    return SandboxSpec(image=image, cpu=lim.cpu, memory_mb=lim.memory_mb, disk_mb=lim.disk_mb, pids_max=lim.pids_max,
                       ttl_s=max(600.0, spec.test_timeout_s * 4), workdir=spec.workdir, job=job,
                       labels={"corral.role": role, "corral.env": spec.name})


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


async def _run_case(client: AsyncClient, spec: EnvSpec, image: str, job: str, case: Case, scan_sizes: set[int]) -> None:
    try:
        sb = await client.create_spec(sandbox_spec(spec, image, "env-verify", job))
    except Exception as e:
        case.error = f"could not create a sandbox: {e}"
        return
    try:
        if scan_sizes:  # before anything protected is written: this is what an agent would see
            r = await sb.exec(["/bin/sh", "-c", workspace.scan_script(scan_sizes)], timeout_s=300, max_output_bytes=8 << 20)
            case.scan = r.stdout
        if spec.git is not None and not case.solved and case.run == 0:
            case.git_check = await sb.exec(["bash", "-c", gitpin.check_script(spec.git.path)], timeout_s=120)
        await workspace.put_files(sb, {spec.abspath(p): c.encode() for p, c in spec.hidden_files.items()})
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
        case.result = await run_tests(sb, spec)
    except Exception as e:
        case.error = str(e)
    finally:
        try:
            await sb.destroy()
        except Exception:
            pass


def protected_hashes(spec: EnvSpec, solved_hashes: dict[str, str]) -> dict[str, str]:
    """sha256 -> what it is, for every non-empty piece of protected content."""
    out = {digest(c): f"hidden file {spec.abspath(p)}" for p, c in spec.hidden_files.items() if c}
    out.update({digest(c): f"solution file {spec.abspath(p)}" for p, c in spec.solution.files.items() if c})
    out.update({h: f"solved version of {p}" for p, h in solved_hashes.items()})
    return out


async def verify(client: AsyncClient, spec: EnvSpec, image: str, job: str) -> list[CheckResult]:
    t0 = time.perf_counter()
    sizes = {len(c.encode()) for c in (*spec.hidden_files.values(), *spec.solution.files.values()) if c}
    cases = [Case(solved=False, run=0), Case(solved=False, run=1), Case(solved=True, run=0), Case(solved=True, run=1)]
    # a patched file's solved content is only known after solving: that run goes first, then the
    # scan looks for it too
    await _run_case(client, spec, image, job, cases[2], set())
    scan = sizes | cases[2].solved_sizes
    await asyncio.gather(*(_run_case(client, spec, image, job, c, scan if c is cases[0] else set())
                           for c in (cases[0], cases[1], cases[3])))
    secs = round(time.perf_counter() - t0, 2)
    un, so = cases[:2], cases[2:]
    checks: list[CheckResult] = []
    errors = [c for c in cases if c.error]
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
