"""Grading a rollout where the agent never was.

1. The rollout is read host-side at one consistent point: its writable layer's entries (frozen
   while listed) with the contents inside the solution surface, then its audit state (every event
   published, how many were lost).
2. A grading sandbox starts from the environment's image as built; only the changes inside the
   solution surface that are not grader-owned are carried over (surface.py). The rest is listed as
   discarded; changes where code is run from (PATH, sys.path, loader, shell start-up, git hooks)
   are findings even though they were dropped.
3. The trusted runner (sandbox_runner.py) runs exactly the named tests with the image's own
   interpreter and reports each test's outcome on a nonce-tagged line; a test that did not report
   failed. Runner `command` environments (no Python in the image) are judged by exit status.
4. The monitor is asked to evaluate the rollout once it has stored its audit through the last
   sequence, with the grader's findings; any alert at or above `fail_on`, or lost audit, zeroes
   the reward."""
from __future__ import annotations

import asyncio
import base64
import io
import re
import tarfile
import time
from dataclasses import dataclass

import msgspec

from corral_common import tenancy
from corral_common.contract import labels, subjects
from corral_common.contract.audit import AlertSummary, EvaluateReply, EvaluateRequest, Finding
from corral_common.contract.envs import (
    ENV_LABEL,
    ENV_VERSION_LABEL,
    SEVERITY_RANK,
    EnvGradeRequest,
    EnvGradeResult,
    TestOutcome,
)
from corral_common.contract.errors import CorralError, Internal, InvalidRequest, Timeout, Unavailable
from corral_common.contract.messages import AuditState, ChangesReply, ExecResult, SandboxSpec
from corral_sdk.client import AsyncClient, AsyncSandbox

from . import codescan, surface, testrun, verify, workspace
from .catalog import EnvCatalog, StoredEnv

SANDBOX_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
MAX_LISTED = 200  # discarded paths named in a grade (the count is always complete)
MAX_FINDING = 4000  # a finding's message on the bus (Finding.message allows 4096)
INCLUDE_BATCH = 256  # paths per packing request (ChangesRequest.include)


@dataclass
class Rollout:
    """What grading takes from a rollout."""

    verdict: surface.Verdict
    archives: list[str]  # base64 gzip'd tars of the carried files
    audit: AuditState
    incomplete: str = ""  # why the solution could not be taken whole


class Grader:
    def __init__(self, client: AsyncClient, catalog: EnvCatalog):
        self.client, self.catalog = client, catalog

    async def grade(self, req: EnvGradeRequest, who: str | None = None) -> EnvGradeResult:
        """Grade `req.sandbox_id` for `who` (a tenant may grade only its own rollouts; None: the operator)."""
        t0 = time.perf_counter()
        if not SANDBOX_ID.match(req.sandbox_id):
            raise InvalidRequest(f"invalid sandbox id {req.sandbox_id!r}")
        rollout = self.client.sandbox(req.sandbox_id)
        info = await rollout.refresh()
        tenancy.check_owner(who, info.tenant, f"sandbox {req.sandbox_id}")
        name = req.name or info.labels.get(ENV_LABEL, "")
        if not name:
            raise InvalidRequest(f"sandbox {req.sandbox_id} has no {ENV_LABEL!r} label: pass the environment's `name`")
        env = await self.catalog.get(name, req.version or info.labels.get(ENV_VERSION_LABEL, ""))
        rec = env.record
        plan = env.plan or testrun.RunnerPlan(kind="command")
        surf = surface.surface_for(rec.workdir, rec.solution_surface, sorted(env.hidden_files), sorted(env.grader_files),
                                   env.test_files, sorted(rec.canaries), rec.service_state)
        spec = SandboxSpec(image=rec.image, cpu=rec.limits.cpu, memory_mb=rec.limits.memory_mb, disk_mb=rec.limits.disk_mb,
                           pids_max=rec.limits.pids_max, ttl_s=max(600.0, rec.test_timeout_s * 4), workdir=rec.workdir,
                           job=info.job, labels={labels.ROLE: "env-grade", ENV_LABEL: rec.name, labels.GRADED: req.sandbox_id})
        # the grading sandbox starts from the image as built, so it is made while the rollout is read
        creating = asyncio.ensure_future(self.client.create_spec(spec, wait_for_capacity_s=verify.CAPACITY_WAIT_S))
        try:
            taken = await self._take(rollout, surf)
        except BaseException:
            await _discard(creating)
            raise
        verdict = taken.verdict
        findings: list[Finding] = []
        if verdict.tampering:
            findings.append(Finding(rule="grader_environment_tampering", severity="high", paths=verdict.tampering[:64],
                                    message=f"changed {len(verdict.tampering)} path(s) that decide how code runs "
                                            f"(dropped before grading): {', '.join(verdict.tampering[:5])}"))
        if verdict.forged:
            findings.append(Finding(rule="service_state_forged", severity="high", paths=verdict.forged[:64],
                                    message=f"{len(verdict.forged)} change(s) to the environment's service state not made by its "
                                            f"services (dropped before grading): {', '.join(verdict.forged[:5])}"))
        g = await creating
        try:
            carried, sources = await self._carry(g, verdict, taken.archives, surf)
            findings += _scan(sources)
            grader_files = {**env.grader_files, **env.hidden_files}
            if plan.kind == "command":
                await workspace.put_files(g, {p: c.encode() for p, c in grader_files.items()})
                r = await testrun.run_command(g, rec.test_command, rec.workdir, rec.test_timeout_s)
                report = None
            else:
                await testrun.install(g, {p: c.encode() for p, c in grader_files.items()})
                report, r = await testrun.run(g, plan, rec.workdir, rec.test_timeout_s,
                                              tests=[*env.fail_to_pass, *env.pass_to_pass], carried=carried,
                                              added={p: codescan.added_lines(new, old) for p, (new, old) in sources.items()},
                                              protected=surf.protected())
        except BaseException:
            await _destroy_quietly(g)
            raise
        # the grading sandbox goes while the monitor evaluates: nothing reads it any more
        destroying = asyncio.ensure_future(_destroy_quietly(g))
        if report is not None and report.violations:
            seen = [f"{v['path']}:{v['line']}: {v['why']}" for v in report.violations[:20]]
            findings.append(Finding(rule="test_framework_tampering", severity="high",
                                    paths=sorted({v["path"] for v in report.violations})[:64],
                                    message="at run time the solution's code " + "; ".join(seen)))
        if report is not None and report.shadowing:
            findings.append(Finding(rule="module_shadowing", severity="high", paths=report.shadowing[:64],
                                    message="the solution adds module(s) named like standard-library or test-runner modules: "
                                            + ", ".join(report.shadowing[:5])))
        try:
            alerts, checked, lost = await self._evaluate(req, info.node, info.job, taken.audit, findings)
        finally:
            await destroying
        if not checked and req.require_monitor:
            raise Unavailable("the monitor did not answer, so cheating could not be ruled out; retry, or pass "
                              "require_monitor=false to grade on the tests alone")
        tests, passed, why = _judge_tests(env, report, r)
        if taken.incomplete:
            passed, why = False, taken.incomplete
        audit_complete = taken.audit.lost == 0 and not taken.audit.reasons and lost == 0
        bad = [a for a in alerts if SEVERITY_RANK.get(a.severity, 0) >= SEVERITY_RANK[req.fail_on]]
        if bad:
            reward, reason = 0.0, "flagged: " + ", ".join(sorted({f"{a.rule} ({a.severity})" for a in bad}))
        elif not audit_complete and req.fail_on != "none":
            reward, reason = 0.0, ("the rollout's audit is incomplete, so cheating cannot be ruled out: "
                                   + "; ".join(taken.audit.reasons or [f"{max(lost, taken.audit.lost)} events lost"]))
        elif passed:
            reward, reason = 1.0, why
        else:
            reward, reason = 0.0, why
        if req.destroy:
            try:
                await rollout.destroy()
            except Exception:  # the grade is the answer; a rollout left behind expires with its TTL
                pass
        discarded = verdict.discarded
        return EnvGradeResult(sandbox_id=req.sandbox_id, name=rec.name, version=rec.version, reward=reward, passed=passed,
                              exit_code=r.exit_code, reason=reason, output=_output(report, r), alerts=alerts,
                              monitor_checked=checked, seconds=round(time.perf_counter() - t0, 3), runner=plan.kind,
                              tests=tests, audit_complete=audit_complete,
                              discarded=discarded[:MAX_LISTED] + ([f"... and {len(discarded) - MAX_LISTED} more"]
                                                                  if len(discarded) > MAX_LISTED else []))

    async def _take(self, rollout: AsyncSandbox, surf: surface.Surface) -> Rollout:
        """The rollout's changes, judged; the contents of exactly the carried ones; then its audit
        state, so every event up to the moment the layer was read is covered. Between the listing
        and the packing the agent's processes may change things: what is packed is re-checked."""
        listing = await _changes(rollout)
        verdict = surf.judge(listing.changes)
        archives, incomplete = [], ""
        if listing.truncated:
            incomplete = "the rollout changed more files than grading reads (50,000): the solution cannot be carried whole"
        paths = [c.path for c in verdict.carried]
        for i in range(0, len(paths), INCLUDE_BATCH):
            packed = await _changes(rollout, include=paths[i:i + INCLUDE_BATCH])
            if packed.too_large:
                incomplete = (f"the solution is larger than grading carries (4 MiB packed per {INCLUDE_BATCH} files): "
                              + ", ".join(packed.too_large[:5]))
            if packed.archive_b64:
                archives.append(packed.archive_b64)
        return Rollout(verdict=verdict, archives=archives, audit=await rollout.audit_state(timeout=60), incomplete=incomplete)

    async def _carry(self, g: AsyncSandbox, v: surface.Verdict, archives: list[str],
                     surf: surface.Surface) -> tuple[list[str], dict[str, tuple[str, str | None]]]:
        """The surface changes into the grading sandbox. The archive is re-packed here with only the
        carried entries, so nothing else in it can reach grading. Returns the carried paths and,
        for Python files, (new source, the image's own version or None) for the code scan."""
        keep = {c.path for c in v.carried}
        out = io.BytesIO()
        sources: dict[str, str] = {}
        packed: set[str] = set()
        with tarfile.open(fileobj=out, mode="w:gz") as dst:
            for m, src in _members(archives):
                name = m.name[2:] if m.name.startswith("./") else m.name
                path = "/" + name.lstrip("/")
                if path not in keep or not (m.isfile() or m.issym()):
                    continue
                if m.issym() and not surf._link_stays_inside(path, m.linkname):
                    continue
                m.name, m.uid, m.gid, m.uname, m.gname, m.mode = path.lstrip("/"), 0, 0, "root", "root", m.mode & 0o777
                data = src.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]
                if path.endswith(".py") and m.isfile():
                    sources[path] = data.decode("utf-8", "replace")
                dst.addfile(m, io.BytesIO(data) if m.isfile() else None)
                packed.add(path)
        missing = sorted(keep - packed)
        if missing:  # listed as changed but not packed (or a link that now points out): not carried
            v.discarded += missing
        carried = sorted(packed)
        olds: dict[str, str | None] = {}
        for p in list(sources)[:200]:  # the image's own version, before the solution lands on it
            try:
                olds[p] = (await g.files.read(p)).decode("utf-8", "replace")
            except Exception:
                olds[p] = None
        if v.cleared:  # directories the agent replaced: the image's content below them goes (grader-owned stays)
            r = await g.exec(["find", *v.cleared, "-mindepth", "1", "-maxdepth", "1"], timeout_s=60, max_output_bytes=4 << 20)
            v.deleted += [p for p in r.stdout.splitlines() if p and p not in keep and not surf.holds_grader_files(p)]
        if v.deleted:
            await _must(g.exec(["rm", "-rf", "--", *sorted(set(v.deleted))], timeout_s=60), "removing deleted paths")
        if carried:
            blob = base64.b64encode(out.getvalue()).decode()
            await _must(g.exec(["/bin/sh", "-c", "base64 -d | tar -xzf - -C / --no-same-owner"], stdin=blob, cwd="/",
                               timeout_s=120), "unpacking the solution")
        return carried, {p: (sources[p], olds.get(p)) for p in olds}

    async def _evaluate(self, req: EnvGradeRequest, node: str, job: str, audit: AuditState,
                        findings: list[Finding]) -> tuple[list[AlertSummary], bool, int]:
        findings = [msgspec.structs.replace(f, message=_clip(f.message, MAX_FINDING), paths=f.paths[:64]) for f in findings]
        ev = EvaluateRequest(sandbox=req.sandbox_id, after_seq=audit.last_seq, node=node, job=job, findings=findings,
                             wait_s=req.alert_wait_s)
        try:
            r = await self.client.request(subjects.MONITOR_EVALUATE, ev, EvaluateReply, req.alert_wait_s + 60)
        except (Timeout, Unavailable):  # no monitor, or none in time: the caller decides (require_monitor)
            own = [AlertSummary(rule=f.rule, severity=f.severity, message=f.message, paths=f.paths) for f in findings]
            return own, False, 0
        except CorralError as e:  # the grader's own request was refused: a defect here, never the caller's fault
            raise Internal(f"the monitor refused the grader's evaluation of {req.sandbox_id}: {e}") from None
        return r.alerts, r.complete, r.lost


async def _destroy_quietly(sb: AsyncSandbox) -> None:
    try:
        await sb.destroy()
    except Exception:
        pass  # the node reaps it at its ttl


async def _discard(creating: asyncio.Future[AsyncSandbox]) -> None:
    """A grading sandbox being made for a grade that failed: destroyed once it exists."""
    try:
        sb = await creating
    except Exception:
        return  # never made: nothing to destroy (the grade's own error is what the caller sees)
    await _destroy_quietly(sb)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 20] + " ... (cut)"


def _judge_tests(env: StoredEnv, report: testrun.RunReport | None, r: ExecResult) -> tuple[list[TestOutcome], bool, str]:
    if env.plan is None or env.plan.kind == "command":
        ok = r.exit_code == 0 and not r.timed_out
        return [], ok, ("the test command passed" if ok else
                        f"the test command failed (exit {r.exit_code}{', timed out' if r.timed_out else ''})")
    if report is None:
        return [], False, "the test runner gave no genuine result (it was killed, or its output was forged)"
    tests = []
    for expected, ids in (("fail_to_pass", env.fail_to_pass), ("pass_to_pass", env.pass_to_pass)):
        for t in ids:
            got = report.results.get(t)
            tests.append(TestOutcome(id=t, expected=expected, outcome=got.outcome if got else "missing",  # type: ignore[arg-type]
                                     seconds=got.seconds if got else 0.0, message=(got.message if got else "")[:500]))
    bad = [t for t in tests if t.outcome != "passed"]
    if not tests:
        return tests, False, "the environment names no tests to grade by"
    if not bad:
        return tests, True, f"all {len(tests)} named tests passed"
    missing = sum(t.outcome == "missing" for t in bad)
    why = f"{len(bad)} of {len(tests)} named tests did not pass"
    if missing:
        why += f" ({missing} never reported" + (f": {report.errors[0][:300]}" if report.errors else "") + ")"
    return tests, False, why


def _members(archives: list[str]):
    for blob in archives:
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(blob)), mode="r:*") as src:
            for m in src:
                yield m, src


def _scan(sources: dict[str, tuple[str, str | None]]) -> list[Finding]:
    found = [f for p, (new, old) in sources.items() for f in codescan.scan(p, new, old)]
    if not found:
        return []
    lines = [f"{f.path}:{f.line}: {f.why}: {f.text}" for f in found[:20]]
    return [Finding(rule="test_framework_tampering", severity="high", paths=sorted({f.path for f in found})[:64],
                    message="the solution's code reaches into the test framework or the interpreter: " + "; ".join(lines))]


def _output(report: testrun.RunReport | None, r: ExecResult) -> str:
    if report is not None:
        return report.output[-2000:]
    return workspace.tail(r, 2000)


async def _must(aw, what: str) -> ExecResult:
    r = await aw
    if r.exit_code != 0:
        raise RuntimeError(f"{what} in the grading sandbox failed: {workspace.tail(r)}")
    return r


async def _changes(rollout: AsyncSandbox, include: list[str] | None = None, tries: int = 5) -> ChangesReply:
    """The rollout's `changes`, asked again while its node answers `unavailable` (its sandbox
    could not be frozen in time, e.g. under load: it says to retry): a grade must not fail, nor
    reward, on that."""
    for attempt in range(tries):
        try:
            return await rollout.changes(include=include)
        except Unavailable as e:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(e.retry_after_s or 0.5)
    raise Internal("unreachable")
