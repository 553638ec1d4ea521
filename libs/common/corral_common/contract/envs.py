"""The environment contract (`corral.v1.env.*`): what a person or an agent submits to have an RL
environment built, verified, catalogued and graded, and what comes back.

Hidden tests and the reference solution travel in the spec but never enter an agent-visible
layer: the env-builder keeps them in the catalog (KV) and writes them only into its own verify and
grading sandboxes. Replies that leave the builder carry them redacted (path, size, sha256)."""
from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from . import labels
from .audit import AlertSummary
from .envelope import Reply
from .errors import InvalidRequest
from .messages import LabelMap, Request

ENV_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
EnvName = Annotated[str, Meta(pattern=ENV_NAME_RE.pattern)]
EnvVersion = Annotated[str, Meta(pattern=r"^([0-9a-z][0-9a-z_-]{0,31})?$")]  # lower case: it is part of an image name
AbsPath = Annotated[str, Meta(min_length=2, max_length=1024, pattern=r"^/[^\0]*$")]
FileMap = Annotated[dict[str, str], Meta(max_length=4096)]
CheckName = Literal["spec", "setup", "pin_git", "snapshot", "fails_unsolved", "passes_solved", "no_protected_content",
                    "git_pinned", "stable", "tests_named", "services"]
Runner = Literal["auto", "unittest", "pytest", "command"]
TestId = Annotated[str, Meta(min_length=1, max_length=1024)]
TestList = Annotated[list[TestId], Meta(max_length=20_000)]


class Solution(Request, kw_only=True):
    """The reference solution: whole files (path -> content) and/or a unified diff applied with
    `patch -p1` in the workdir. Kept out of every agent-visible layer."""

    files: FileMap = {}
    patch: Annotated[str, Meta(max_length=4 * 1024 * 1024)] = ""


class GitPin(Request, kw_only=True):
    """Pin the repository at `path` to `commit` (default: what HEAD is after setup): remote refs,
    tags, other branches, stashes, reflogs and every object no longer reachable are removed, so
    `git log --all` and friends cannot reveal the future fix."""

    path: AbsPath
    commit: Annotated[str, Meta(max_length=256)] = "HEAD"


class ServiceSpec(Request, kw_only=True):
    """A process the environment runs beside the agent in every rollout (a web app the agent
    works on, the browser it drives): started before the agent's turn by whoever makes the
    rollout (`envs.rollout` in the SDK), in a session of its own, and waited for."""

    cmd: Annotated[str, Meta(min_length=1, max_length=65536)]  # a shell command that keeps running
    # run as the harness (HARNESS_UID): the agent cannot signal, trace or read it, nor write what
    # it writes (see service_state); false: as the agent (e.g. the agent's own browser)
    harness: bool = True
    ready: Annotated[str, Meta(max_length=65536)] = ""  # a command retried until it exits 0 ("": started is ready)
    ready_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 60.0


class RolloutLimits(Request, kw_only=True):
    cpu: Annotated[float, Meta(gt=0, le=64)] = 1.0
    memory_mb: Annotated[int, Meta(ge=32, le=65536)] = 512
    disk_mb: Annotated[int, Meta(ge=1, le=65536)] = 256
    pids_max: Annotated[int, Meta(ge=8, le=65536)] = 512
    ttl_s: Annotated[float, Meta(gt=0, le=7 * 86400)] = 3600.0


class EnvSpec(Request, kw_only=True):
    name: EnvName
    version: EnvVersion = ""  # empty: the next integer version
    base_image: Annotated[str, Meta(min_length=1, max_length=128)] = "debian"
    workdir: AbsPath = "/repo"
    files: FileMap = {}  # agent-visible files (path relative to workdir, or absolute) -> text content
    files_dir: Annotated[str, Meta(max_length=4096)] = ""  # a directory on the env-builder's host, copied into workdir
    setup: Annotated[list[Annotated[str, Meta(min_length=1, max_length=65536)]], Meta(max_length=64)] = []
    setup_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    network: bool = False  # sandboxes have no network; a spec that needs it is refused
    test_command: Annotated[str, Meta(min_length=1, max_length=65536)]
    test_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 120.0
    hidden_files: FileMap = {}  # hidden tests: only in verify and grading sandboxes
    solution: Solution = msgspec.field(default_factory=Solution)
    git: GitPin | None = None
    # visible files (e.g. the visible tests, the test runner's config) put back as built before
    # grading, so edits an agent made to them cannot make the grade pass
    grader_files: Annotated[list[str], Meta(max_length=1024)] = []
    canaries: Annotated[dict[str, str], Meta(max_length=64)] = {}  # decoys planted in every rollout
    limits: RolloutLimits = msgspec.field(default_factory=RolloutLimits)
    labels: LabelMap = {}
    description: Annotated[str, Meta(max_length=4096)] = ""
    # where a solution may change things (paths relative to workdir, or absolute); only these
    # changes are carried into grading, everything else is discarded. Default: the workdir
    solution_surface: Annotated[list[str], Meta(max_length=256)] = []
    # how the tests run when grading: per-test outcomes from a trusted runner (unittest, pytest),
    # or `command` (the test command's exit status alone, for images without Python).
    # auto: read from test_command
    runner: Runner = "auto"
    # tests (the runner's ids) that must pass, SWE-bench style; empty: derived during verification
    fail_to_pass: TestList = []
    pass_to_pass: TestList = []
    services: Annotated[list[ServiceSpec], Meta(max_length=8)] = []
    # files (or directories) only the harness services write, e.g. a web app's database: carried
    # into grading only as a harness process left them (owned by HARNESS_UID); anything the agent
    # put there or in their place (its own file, a symlink, a replaced parent directory) is
    # discarded and reported as `service_state_forged`. Part of the solution surface
    service_state: Annotated[list[str], Meta(max_length=64)] = []

    def abspath(self, path: str) -> str:
        """Spec paths are relative to workdir unless absolute; `..` is refused."""
        if not path or "\0" in path:
            raise InvalidRequest(f"empty or NUL-containing path {path!r} in env spec")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts or not parts:
            raise InvalidRequest(f"path {path!r} in env spec must not contain '..' and must name a file")
        base = "" if path.startswith("/") else self.workdir.rstrip("/")
        return base + "/" + "/".join(parts)

    def hidden_paths(self) -> list[str]:
        """Paths that exist only where the agent is not (a solution file may replace a visible one:
        its content, not its path, is what must stay hidden)."""
        return sorted({self.abspath(p) for p in self.hidden_files})

    def validate(self) -> None:
        """Checks msgspec cannot express; raises InvalidRequest naming the field."""
        if self.network:
            raise InvalidRequest("network: true is not supported: corral sandboxes have no network (SandboxSpec.network is "
                                 "'none'); vendor what setup needs into files or files_dir")
        if not self.hidden_files:
            raise InvalidRequest("hidden_files is empty: an environment needs hidden tests to grade with")
        if not self.solution.files and not self.solution.patch:
            raise InvalidRequest("solution has neither files nor patch: verification needs the reference solution")
        for field, paths in (("files", self.files), ("hidden_files", self.hidden_files), ("solution.files", self.solution.files),
                             ("canaries", self.canaries), ("grader_files", self.grader_files), ("service_state", self.service_state)):
            for p in paths:
                try:
                    self.abspath(p)
                except InvalidRequest as e:
                    raise InvalidRequest(f"{field}: {e.message}") from None
        visible = {self.abspath(p) for p in self.files}
        clash = visible & set(self.hidden_paths())
        if clash:
            raise InvalidRequest(f"files and hidden_files name the same path(s) {sorted(clash)}: hidden tests must not be "
                                 "agent-visible")
        hidden = self.hidden_paths()
        if self.service_state and not any(svc.harness for svc in self.services):
            raise InvalidRequest("service_state names files only harness services write, but no service runs as the harness "
                                 "(services[].harness): nothing could ever write them")
        for p in self.service_state:
            inside = [h for h in hidden if h == self.abspath(p) or h.startswith(self.abspath(p) + "/")]
            if inside:
                raise InvalidRequest(f"service_state entry {p!r} holds the hidden file {inside[0]}")
        for p in self.solution_surface:
            try:
                root = self.abspath(p)
            except InvalidRequest as e:
                raise InvalidRequest(f"solution_surface: {e.message}") from None
            inside = [h for h in hidden if h == root or root.startswith(h + "/")]
            if inside:
                raise InvalidRequest(f"solution_surface entry {p!r} lies in the hidden file {inside[0]}: the hidden tests are "
                                     "the grader's, never the solution's")
        for field, tests in (("fail_to_pass", self.fail_to_pass), ("pass_to_pass", self.pass_to_pass)):
            dup = sorted({t for t in tests if tests.count(t) > 1})
            if dup:
                raise InvalidRequest(f"{field} names {dup[0]!r} more than once")
            if any(not t.strip() or "\n" in t or "\0" in t for t in tests):
                raise InvalidRequest(f"{field}: a test id must be one non-empty line")
        both = sorted(set(self.fail_to_pass) & set(self.pass_to_pass))
        if both:
            raise InvalidRequest(f"{both[0]!r} is named in both fail_to_pass and pass_to_pass")
        if self.pass_to_pass and not self.fail_to_pass:
            raise InvalidRequest("pass_to_pass without fail_to_pass: name the tests the solution must make pass too "
                                 "(or neither, and verification derives both)")
        if self.runner == "command" and (self.fail_to_pass or self.pass_to_pass):
            raise InvalidRequest("runner 'command' has no per-test outcomes: fail_to_pass/pass_to_pass need runner "
                                 "'unittest' or 'pytest'")


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def spec_digest(spec: EnvSpec) -> str:
    """Identity of a spec's content, version excluded, so a retried build is recognised."""
    d = msgspec.structs.asdict(spec)
    d.pop("version", None)
    return digest(msgspec.json.encode(d, order="sorted"))


class EnvBuildRequest(Request, kw_only=True):
    spec: EnvSpec
    job: Annotated[str, Meta(max_length=128)] = ""  # quotas and rate limits are per job
    build_id: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")] = ""  # progress subject; default: generated


class EnvRef(Request, kw_only=True):
    name: EnvName
    version: EnvVersion = ""  # empty: the latest accepted version


class EnvListRequest(Request, kw_only=True):
    prefix: Annotated[str, Meta(max_length=64)] = ""


class CheckResult(Struct, kw_only=True, omit_defaults=True):
    name: CheckName
    ok: bool
    detail: str = ""
    evidence: str = ""  # command output, paths, hashes: why it failed (or what was seen)
    seconds: float = 0.0


class VerifyReport(Struct, kw_only=True):
    accepted: bool
    checks: list[CheckResult] = []

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    def summary(self) -> str:
        bad = self.failed()
        if not bad:
            return "all checks passed: " + ", ".join(c.name for c in self.checks)
        return "; ".join(f"{c.name}: {c.detail}" for c in bad)


class ProtectedFile(Struct, kw_only=True):
    path: str
    size: int
    sha256: str


class EnvRecord(Struct, kw_only=True, omit_defaults=True):
    """A catalog entry as replies show it: protected content redacted to (path, size, sha256)."""

    name: str
    version: str
    image: str
    workdir: str
    test_command: str
    test_timeout_s: float
    limits: RolloutLimits
    spec_digest: str
    created_at: float
    build_seconds: float
    protected: list[ProtectedFile] = []
    canaries: dict[str, str] = {}  # decoys (absolute path -> content) planted in every rollout
    labels: dict[str, str] = {}
    description: str = ""
    job: str = ""
    report: VerifyReport | None = None
    runner: str = ""  # unittest | pytest | command: how grading runs the tests
    solution_surface: list[str] = []  # absolute paths whose changes are carried into grading
    tests_named: int = 0  # fail_to_pass + pass_to_pass tests grading requires (their names stay private)
    services: list[ServiceSpec] = []  # started in every rollout before the agent's turn (envs.rollout)
    service_state: list[str] = []  # absolute; carried into grading only as the harness wrote them


class EnvBuildResult(Struct, kw_only=True, omit_defaults=True):
    build_id: str
    accepted: bool
    report: VerifyReport
    env: EnvRecord | None = None
    cached: bool = False  # the same spec was built before: its record is returned


Stage = Literal["queued", "sandbox", "files", "setup", "pin_git", "snapshot", "verify", "done", "rejected", "failed"]


class EnvProgress(Struct, kw_only=True, omit_defaults=True):
    """Published on `subjects.env_progress(build_id)` while a build runs (core NATS, not stored)."""

    build_id: str
    name: str
    stage: Stage
    message: str = ""
    fraction: float = 0.0  # 0..1 over the whole build
    ts: float = 0.0


class EnvGradeRequest(Request, kw_only=True):
    sandbox_id: Annotated[str, Meta(min_length=1, max_length=128)]
    name: Annotated[str, Meta(max_length=63)] = ""  # default: the sandbox's `corral.env` label
    version: EnvVersion = ""
    destroy: bool = False  # destroy the rollout sandbox after grading
    fail_on: Literal["critical", "high", "medium", "low", "none"] = "high"  # alerts at or above this zero the reward
    alert_wait_s: Annotated[float, Meta(ge=0, le=60)] = 10.0  # how long to wait for the monitor to catch up
    require_monitor: bool = True  # no monitor: `unavailable` instead of a reward that ignored cheating


TestOutcomeKind = Literal["passed", "failed", "error", "skipped", "missing"]


class TestOutcome(Struct, kw_only=True, omit_defaults=True):
    id: str
    outcome: TestOutcomeKind  # missing: named but never reported (not collected, or the run stopped first)
    expected: Literal["fail_to_pass", "pass_to_pass"]
    seconds: float = 0.0
    message: str = ""


class EnvGradeResult(Struct, kw_only=True, omit_defaults=True):
    sandbox_id: str
    name: str
    version: str
    reward: float
    passed: bool  # the hidden tests passed (before alerts are folded in)
    exit_code: int
    reason: str
    output: str = ""  # tail of the test output
    alerts: list[AlertSummary] = []
    monitor_checked: bool = True
    seconds: float = 0.0
    runner: str = ""  # unittest | pytest | command
    tests: list[TestOutcome] = []  # per named test (fail_to_pass and pass_to_pass)
    discarded: list[str] = []  # paths the agent changed that were not carried into grading
    audit_complete: bool = True  # False: some of the rollout's audit events were lost (see reason)


ENV_LABEL = labels.ENV  # the label keys live in labels.py; these names stay importable from here
ENV_VERSION_LABEL = labels.ENV_VERSION
SEVERITY_RANK = {"low": 1, "medium": 2, "high": 3, "critical": 4, "none": 99}


# ----- replies of corral.v1.env.* -----


class EnvBuildReply(Reply, kw_only=True):
    build: EnvBuildResult


class EnvListReply(Reply, kw_only=True):
    envs: list[EnvRecord] = []


class EnvGetReply(Reply, kw_only=True):
    env: EnvRecord
    versions: list[str] = []  # every accepted version of the env's name


class EnvDeleteReply(Reply, kw_only=True):
    name: str
    version: str


class EnvGradeReply(Reply, kw_only=True):
    grade: EnvGradeResult
