"""One environment build: set-up in a build sandbox, the writable layer snapshotted into an image on
top of the base (through the node-agent and image-cache), then verification; only an environment
that passes every check is accepted into the catalog."""
from __future__ import annotations

import os
import time

import msgspec

from corral_common.contract import labels, subjects
from corral_common.contract.envs import (
    ENV_LABEL,
    ENV_VERSION_LABEL,
    CheckResult,
    EnvBuildResult,
    EnvRecord,
    EnvSpec,
    ProtectedFile,
    VerifyReport,
    digest,
    spec_digest,
)
from corral_common.contract.errors import CorralError, InvalidRequest, NotFound
from corral_common.contract.images import ImageDeleteReply, NameRequest
from corral_common.contract.messages import SandboxSpec
from corral_sdk.client import AsyncClient, AsyncSandbox

from . import gitpin, surface, testrun, verify, workspace
from .catalog import EnvCatalog, StoredEnv
from .progress import Progress


class BuildConfig:
    def __init__(self, files_roots: list[str], build_memory_mb: int = 2048, build_disk_mb: int = 1536):
        self.files_roots = [os.path.realpath(r) for r in files_roots]
        self.build_memory_mb = build_memory_mb
        self.build_disk_mb = build_disk_mb


def image_name(spec_name: str, version: str) -> str:
    return f"env-{spec_name}-{version}"


def surface_roots(spec: EnvSpec) -> list[str]:
    """The solution surface as absolute paths; refused where it would cover what decides how code
    runs (a surface of `/usr` would carry a replaced interpreter into grading)."""
    roots = sorted({spec.abspath(p) for p in spec.solution_surface}) or [spec.workdir]
    roots = sorted({*roots, *(spec.abspath(p) for p in spec.service_state)})
    for r in roots:
        if surface.tampers(r) or any(p.startswith(r.rstrip("/") + "/") for p in surface.RUNTIME_PREFIXES) or r == "/":
            raise InvalidRequest(f"solution_surface {r!r} covers where the interpreter, libraries or shell start-up files live: "
                                 "grading must not take those from the agent; name the directories of the solution instead")
    return roots


def record_for(spec: EnvSpec, version: str, job: str) -> EnvRecord:
    prot = [ProtectedFile(path=spec.abspath(p), size=len(c.encode()), sha256=digest(c))
            for p, c in sorted({**spec.hidden_files, **spec.solution.files}.items())]
    return EnvRecord(name=spec.name, version=version, image=image_name(spec.name, version), workdir=spec.workdir,
                     test_command=spec.test_command, test_timeout_s=spec.test_timeout_s, limits=spec.limits,
                     spec_digest=spec_digest(spec), created_at=time.time(), build_seconds=0.0, protected=prot,
                     canaries={spec.abspath(p): c for p, c in spec.canaries.items()}, labels=spec.labels,
                     description=spec.description, job=job, runner=testrun.plan_for(spec).kind,
                     solution_surface=surface_roots(spec), services=spec.services,
                     service_state=sorted({spec.abspath(p) for p in spec.service_state}))


class Builder:
    def __init__(self, client: AsyncClient, catalog: EnvCatalog, cfg: BuildConfig):
        self.client, self.catalog, self.cfg = client, catalog, cfg

    def visible_files(self, spec: EnvSpec) -> dict[str, bytes]:
        files = {spec.abspath(p): c.encode() for p, c in spec.files.items()}
        if spec.files_dir:
            root = os.path.realpath(spec.files_dir)
            if not any(root == r or root.startswith(r + "/") for r in self.cfg.files_roots):
                allowed = ", ".join(self.cfg.files_roots) or "none (start the env-builder with --files-root DIR)"
                raise InvalidRequest(f"files_dir {spec.files_dir!r} is outside the directories this env-builder may read: {allowed}")
            if not os.path.isdir(root):
                raise InvalidRequest(f"files_dir {spec.files_dir!r} is not a directory on the env-builder's host")
            for rel, data in workspace.read_dir(root).items():
                files.setdefault(spec.abspath(rel), data)
        clash = set(files) & set(spec.hidden_paths())
        if clash:
            raise InvalidRequest(f"files_dir holds hidden path(s) {sorted(clash)}: hidden tests must not be agent-visible")
        return files

    async def build(self, spec: EnvSpec, job: str, build_id: str, progress: Progress) -> EnvBuildResult:
        t0 = time.perf_counter()
        spec.validate()
        plan = testrun.plan_for(spec)
        surface_roots(spec)
        visible = self.visible_files(spec)
        d = spec_digest(spec)
        same = await self.catalog.find_digest(spec.name, d)
        if same is not None and spec.version in ("", same.record.version):
            await progress("done", 1.0, f"unchanged spec: {spec.name}:{same.record.version} is already in the catalog")
            return EnvBuildResult(build_id=build_id, accepted=True, report=same.record.report or VerifyReport(accepted=True),
                                  env=same.record, cached=True)
        version = spec.version or await self.catalog.next_version(spec.name)
        stored = StoredEnv(state="building", record=record_for(spec, version, job), reserved_at=time.time(),
                           hidden_files={spec.abspath(p): c for p, c in spec.hidden_files.items()}, solution=spec.solution,
                           plan=plan)
        for _ in range(5):  # racing builders of the same name: take the next free version
            try:
                await self.catalog.reserve(stored)
                break
            except CorralError:
                if spec.version:
                    raise
                version = await self.catalog.next_version(spec.name)
                stored.record = record_for(spec, version, job)
        image = stored.record.image
        accepted = False
        try:
            checks = await self._build_image(spec, visible, stored, job, build_id, progress)
            if all(c.ok for c in checks):
                await progress("verify", 0.65, "4 sandboxes: unsolved x2, solved x2; scanning for protected content")
                v = await verify.verify(self.client, spec, plan, image, job)
                checks += v.checks
                stored.fail_to_pass, stored.pass_to_pass, stored.test_files = v.fail_to_pass, v.pass_to_pass, v.test_files
                stored.record.tests_named = len(v.fail_to_pass) + len(v.pass_to_pass)
            report = VerifyReport(accepted=all(c.ok for c in checks), checks=checks)
            # the catalog's copy keeps no evidence: hidden-test output would leak to anyone who can `get`
            stored.record.report = VerifyReport(accepted=report.accepted,
                                                checks=[msgspec.structs.replace(c, evidence="") for c in checks])
            stored.record.build_seconds = round(time.perf_counter() - t0, 2)
            if report.accepted:
                stored.record.created_at = time.time()
                await self.catalog.accept(stored)
                accepted = True
                await progress("done", 1.0, f"{spec.name}:{version} accepted as image {image}")
                return EnvBuildResult(build_id=build_id, accepted=True, report=stored.record.report, env=stored.record)
            await progress("rejected", 1.0, report.summary())
            return EnvBuildResult(build_id=build_id, accepted=False, report=report)
        except BaseException as e:
            await progress("failed", 1.0, str(e))
            raise
        finally:
            if not accepted:
                await self.catalog.release(spec.name, version)
                await self._delete_image(image)

    async def _build_image(self, spec: EnvSpec, visible: dict[str, bytes], stored: StoredEnv, job: str, build_id: str,
                           progress: Progress) -> list[CheckResult]:
        """Set-up and snapshot; returns the checks so far (a failed one ends the build)."""
        await progress("sandbox", 0.02, f"build sandbox from {spec.base_image}")
        ttl = spec.setup_timeout_s * max(1, len(spec.setup)) + 900
        bspec = SandboxSpec(image=spec.base_image, cpu=max(1.0, spec.limits.cpu), memory_mb=max(self.cfg.build_memory_mb, spec.limits.memory_mb),
                            disk_mb=max(self.cfg.build_disk_mb, spec.limits.disk_mb), pids_max=4096, ttl_s=min(ttl, 7 * 86400),
                            workdir=spec.workdir, job=job,
                            labels={labels.ROLE: "env-build", ENV_LABEL: spec.name, labels.BUILD: build_id})
        try:
            sb = await self.client.create_spec(bspec, timeout=120, wait_for_capacity_s=verify.CAPACITY_WAIT_S)
        except NotFound as e:
            raise InvalidRequest(f"base_image {spec.base_image!r} cannot be used: {e.message}") from None
        try:
            return await self._in_build_sandbox(sb, spec, visible, stored, build_id, progress)
        finally:
            try:
                await sb.destroy()
            except Exception:  # cleanup: the build's own outcome matters; a sandbox left behind expires with its TTL
                pass

    async def _in_build_sandbox(self, sb: AsyncSandbox, spec: EnvSpec, visible: dict[str, bytes], stored: StoredEnv,
                                build_id: str, progress: Progress) -> list[CheckResult]:
        checks: list[CheckResult] = []
        t = time.perf_counter()
        await progress("files", 0.05, f"{len(visible)} files into {spec.workdir}")
        await workspace.put_files(sb, visible)
        for i, cmd in enumerate(spec.setup):
            await progress("setup", 0.1 + 0.4 * i / max(1, len(spec.setup)), f"setup {i + 1}/{len(spec.setup)}: {cmd[:80]}")
            r = await sb.exec(["/bin/sh", "-c", cmd], cwd=spec.workdir, timeout_s=spec.setup_timeout_s, max_output_bytes=256 * 1024)
            if r.exit_code != 0 or r.timed_out:
                checks.append(CheckResult(name="setup", ok=False, detail=f"setup command {i + 1} failed: {cmd[:200]}",
                                          evidence=workspace.tail(r), seconds=round(time.perf_counter() - t, 2)))
                return checks
        for p in spec.grader_files:
            try:
                stored.grader_files[spec.abspath(p)] = (await sb.files.read(spec.abspath(p))).decode()
            except Exception as e:
                checks.append(CheckResult(name="setup", ok=False, detail=f"grader file {p!r} is missing after setup", evidence=str(e)))
                return checks
        checks.append(CheckResult(name="setup", ok=True, detail=f"{len(visible)} files, {len(spec.setup)} setup commands",
                                  seconds=round(time.perf_counter() - t, 2)))
        if spec.git is not None:
            t = time.perf_counter()
            await progress("pin_git", 0.5, f"pinning {spec.git.path} at {spec.git.commit}")
            r = await sb.exec(["/bin/sh", "-c", gitpin.pin_script(spec.git.path, spec.git.commit)], timeout_s=600)
            ok = r.exit_code == 0
            checks.append(CheckResult(name="pin_git", ok=ok, detail=r.stdout.strip()[-200:] if ok else "pinning the repository failed",
                                      evidence="" if ok else workspace.tail(r), seconds=round(time.perf_counter() - t, 2)))
            if not ok:
                return checks
        t = time.perf_counter()
        await progress("snapshot", 0.55, f"writable layer -> image {stored.record.image}")
        await sb.snapshot(name=stored.record.image, labels={ENV_LABEL: spec.name, ENV_VERSION_LABEL: stored.record.version})
        checks.append(CheckResult(name="snapshot", ok=True, detail=f"image {stored.record.image}", seconds=round(time.perf_counter() - t, 2)))
        return checks

    async def _delete_image(self, image: str) -> None:
        try:
            await self.client.request(subjects.IMAGE_DELETE, NameRequest(name=image), ImageDeleteReply, 60)
        except Exception:
            pass  # never made (the build failed before its snapshot)
