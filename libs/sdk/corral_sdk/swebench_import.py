"""SWE-bench-format task instances (JSONL) plus a local git repository -> corral EnvSpecs.

An instance names a repository, the commit the agent starts from (`base_commit`), the reference
fix (`patch`), the tests that expose the issue (`test_patch`) and which tests must pass after the
fix (`FAIL_TO_PASS`, `PASS_TO_PASS`), in the field names of `swebench.types.SWEbenchInstance`.
The environment made of it:

- files: the repository's tree at base_commit (`git archive`: the history after it never reaches
  the sandbox), committed as one fresh commit in the workdir by the set-up, which the builder's
  git pin then keeps as the only history;
- hidden_files: the files test_patch touches, as it leaves them (so they are removed from the
  visible tree: an agent sees neither the new tests nor the old version of those files);
- solution: `patch`; test_command: pytest on the test files test_patch touches (SWE-bench's test
  directives), runner pytest, fail_to_pass/pass_to_pass as given;
- set-up: the instance's `pre_install` and `install` commands (the keys of SWE-bench's per-repo
  specs), run offline in the sandbox after the tree is committed.

Every instance is checked here before anything is built: fields present and typed, base_commit a
commit of the repository, test_patch and patch applying to it in that order. A bad instance gets
one clear error and the others go on. `fail_pass_from_logs` is how instances are made from a
repository's history the SWE-bench way: SWE-bench's own pytest log parser reads `pytest -rA` logs
of the code before and after the fix."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from corral_common import extras
from corral_common.contract.envs import EnvSpec, GitPin, RolloutLimits, Solution
from corral_common.contract.errors import InvalidRequest

from .pypi_env import read_tree

DEFAULT_TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
MAX_INLINE_BYTES = 6 * 1024 * 1024  # a build request is one bus message (8 MB max payload)
GIT = "git -c user.email=corral@localhost -c user.name=corral"
# files whose changes would change how the tests run: put back as built before grading
PYTEST_CONFIG = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
TestIds = list[str] | str  # SWE-bench's datasets store these lists as JSON text


class SwebenchInstance(msgspec.Struct, kw_only=True):
    """One instance; the field names are SWE-bench's (swebench.types.SWEbenchInstance). The first
    seven are required; the rest default as SWE-bench leaves them empty."""

    instance_id: Annotated[str, Meta(min_length=1, max_length=256)]
    repo: Annotated[str, Meta(min_length=1, max_length=256)]
    base_commit: Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{4,64}$")]
    patch: Annotated[str, Meta(min_length=1)]
    test_patch: Annotated[str, Meta(min_length=1)]
    FAIL_TO_PASS: TestIds
    PASS_TO_PASS: TestIds
    problem_statement: str = ""
    hints_text: str = ""
    created_at: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    pre_install: list[str] = []
    install: str = ""
    test_cmd: str = ""


class ImportOutcome(msgspec.Struct, kw_only=True):
    """One line of the file: the spec made of it, or why none could be."""

    line: int
    instance_id: str = ""
    spec: EnvSpec | None = None
    error: str = ""


def swebench_fields() -> frozenset[str]:
    """SWE-bench's instance fields, from the installed package (its schema is the reference)."""
    types = extras.require("swebench.types", "swebench", "reading SWE-bench instances")
    return frozenset(types.SWEbenchInstance.__annotations__)


def _ids(value: TestIds, field: str) -> list[str]:
    if isinstance(value, list):
        return value
    try:
        out = json.loads(value) if value.strip() else []
    except json.JSONDecodeError:
        raise InvalidRequest(f"{field} is neither a list nor JSON text of one") from None
    if not isinstance(out, list) or not all(isinstance(t, str) for t in out):
        raise InvalidRequest(f"{field} must be a list of test ids")
    return out


def env_name(instance_id: str, prefix: str = "") -> str:
    """`astropy__astropy-12907` -> `astropy-astropy-12907` (an env name is lower-case [a-z0-9-])."""
    name = re.sub(r"[^a-z0-9]+", "-", (prefix + instance_id).lower()).strip("-")
    if not name:
        raise InvalidRequest(f"instance_id {instance_id!r} gives no usable environment name")
    return name[:63].rstrip("-")


def find_repo(repo_dir: str, repo: str) -> str:
    """`repo_dir` itself when it is a git work tree, else the clone of `owner/name` under it
    (`owner__name`, `name` or `owner/name`, the layouts SWE-bench tooling leaves)."""
    owner, _, name = repo.rpartition("/")
    candidates = [repo_dir] + [os.path.join(repo_dir, c) for c in (f"{owner}__{name}", name, repo) if c]
    for c in candidates:
        if os.path.isdir(c) and _git(c, "rev-parse", "--is-inside-work-tree", check=False).stdout.strip() == "true":
            top = _git(c, "rev-parse", "--show-toplevel").stdout.strip()
            if os.path.realpath(top) == os.path.realpath(c):
                return c
    raise InvalidRequest(f"repo {repo!r}: no git repository at {repo_dir} or under it ({', '.join(candidates[1:])})")


def _git(cwd: str, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise InvalidRequest(f"git {' '.join(args[:2])} failed: {(r.stderr or r.stdout).strip()[-500:]}")
    return r


def patch_paths(patch: str, field: str) -> tuple[list[str], list[str]]:
    """(paths the patch leaves in place, paths it deletes), relative to the repository."""
    unidiff = extras.require("unidiff", "swebench", "reading SWE-bench patches")
    try:
        ps = unidiff.PatchSet(patch)
    except unidiff.UnidiffParseError as e:
        raise InvalidRequest(f"{field} is not a unified diff: {e}") from None
    if not len(ps):
        raise InvalidRequest(f"{field} changes no file")
    kept = [f.path for f in ps if not f.is_removed_file]
    gone = [f.path for f in ps if f.is_removed_file]
    return kept, gone


def _apply(tree: str, patch: str, field: str, after: str = "") -> None:
    r = _git(tree, "apply", "--whitespace=nowarn", "-", stdin=patch, check=False)
    if r.returncode != 0:
        where = f" after {after}" if after else ""
        raise InvalidRequest(f"{field} does not apply to base_commit{where}: {(r.stderr or r.stdout).strip()[-600:]}")


def make_spec(inst: SwebenchInstance, repo_dir: str, *, prefix: str = "", limits: RolloutLimits | None = None,
              workdir: str = "/repo") -> EnvSpec:
    """The EnvSpec of one instance; InvalidRequest naming what is wrong with it."""
    f2p, p2p = _ids(inst.FAIL_TO_PASS, "FAIL_TO_PASS"), _ids(inst.PASS_TO_PASS, "PASS_TO_PASS")
    if not f2p:
        raise InvalidRequest("FAIL_TO_PASS is empty: nothing would tell a fix from no fix")
    repo = find_repo(repo_dir, inst.repo)
    if _git(repo, "rev-parse", "--verify", "--quiet", f"{inst.base_commit}^{{commit}}", check=False).returncode != 0:
        raise InvalidRequest(f"base_commit {inst.base_commit} is not a commit of {repo}")
    test_kept, test_gone = patch_paths(inst.test_patch, "test_patch")
    gold_kept, _ = patch_paths(inst.patch, "patch")
    with tempfile.TemporaryDirectory(prefix="corral-swebench-") as tmp:
        base, tested = os.path.join(tmp, "base"), os.path.join(tmp, "tested")
        os.makedirs(base)
        archive = subprocess.run(["git", "archive", "--format=tar", inst.base_commit], cwd=repo, capture_output=True,
                                 timeout=300)
        if archive.returncode != 0:
            raise InvalidRequest(f"git archive {inst.base_commit} failed: {archive.stderr.decode(errors='replace')[-500:]}")
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True, timeout=300)
        shutil.copytree(base, tested, symlinks=True)
        # as the verifier and the grader will see it: the tests as test_patch leaves them, then the fix
        _apply(tested, inst.test_patch, "test_patch")
        _apply(tested, inst.patch, "patch", after="test_patch")
        files, skipped = read_tree(base, exclude=(".git/*",))
        hidden: dict[str, str] = {}
        for p in test_kept:
            try:
                with open(os.path.join(tested, p), encoding="utf-8") as f:
                    hidden[p] = f.read()
            except (UnicodeDecodeError, FileNotFoundError):
                raise InvalidRequest(f"test_patch leaves {p} as a file that is not UTF-8 text: hidden tests travel as text") from None
    binary = sorted(set(skipped) & set(gold_kept))
    if binary:
        raise InvalidRequest(f"patch changes {binary[0]}, which is not a text file: the tree travels as text")
    for p in [*test_kept, *test_gone]:
        files.pop(p, None)
    size = sum(len(t.encode()) for t in files.values()) + sum(len(t.encode()) for t in hidden.values())
    if size > MAX_INLINE_BYTES:
        raise InvalidRequest(f"the tree at base_commit is {size / 2**20:.1f} MiB of text: over the {MAX_INLINE_BYTES / 2**20:.0f} MiB "
                             "a build request carries inline")
    tests = [p for p in test_kept if p.endswith(".py")]
    if not tests:
        raise InvalidRequest("test_patch touches no Python test file: pytest would have nothing to run")
    test_cmd = inst.test_cmd or DEFAULT_TEST_CMD
    setup = [f"git init -q -b main . && {GIT} add -A && {GIT} commit -qm 'base {inst.base_commit[:12]}'"]
    setup += [c for c in [*inst.pre_install, inst.install] if c.strip()]
    grader_files = sorted(p for p in files if os.path.basename(p) in PYTEST_CONFIG and p not in gold_kept)
    description = inst.problem_statement or f"Resolve {inst.instance_id} in {inst.repo}: make the failing tests pass."
    spec = EnvSpec(
        name=env_name(inst.instance_id, prefix), workdir=workdir, files=files, setup=setup,
        test_command=f"{test_cmd} {' '.join(tests)}", runner="pytest", hidden_files=hidden,
        solution=Solution(patch=inst.patch), git=GitPin(path=workdir), grader_files=grader_files,
        fail_to_pass=f2p, pass_to_pass=[t for t in p2p if t not in f2p], limits=limits or RolloutLimits(),
        description=description[:4096],
        labels={"source": "swebench", "instance_id": inst.instance_id[:256], "repo": inst.repo[:256],
                "base_commit": inst.base_commit[:64]} | ({"swebench_version": inst.version} if inst.version else {}),
    )
    spec.validate()
    return spec


def read_instances(lines: Iterable[str], repo_dir: str, *, prefix: str = "", limits: RolloutLimits | None = None) -> list[ImportOutcome]:
    """Every non-blank line of a JSONL file, each to its spec or its error."""
    fields = swebench_fields()
    out: list[ImportOutcome] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        o = ImportOutcome(line=n)
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            o.error = f"not JSON: {e}"
            out.append(o)
            continue
        if isinstance(raw, dict):
            o.instance_id = str(raw.get("instance_id", ""))
        try:
            if not isinstance(raw, dict):
                raise InvalidRequest("an instance must be a JSON object")
            missing = sorted(f for f in ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS",
                                         "PASS_TO_PASS") if f not in raw)
            if missing:
                raise InvalidRequest(f"missing required SWE-bench field(s): {', '.join(missing)}")
            unknown = sorted(set(raw) - fields - set(SwebenchInstance.__struct_fields__))
            try:
                inst = msgspec.convert(raw, type=SwebenchInstance)
            except msgspec.ValidationError as e:
                raise InvalidRequest(f"{e}") from None
            o.spec = make_spec(inst, repo_dir, prefix=prefix, limits=limits)
            if unknown:
                o.spec.labels["swebench_ignored"] = ",".join(unknown)[:256]
        except InvalidRequest as e:
            o.error = e.message
        out.append(o)
    return out


def fail_pass_from_logs(before: str, after: str) -> tuple[list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS) from `pytest -rA` logs of the test files before and after the
    fix, read by SWE-bench's own pytest log parser: failing (or absent) before and passing after,
    and passing in both."""
    parsers = extras.require("swebench.harness.log_parsers.python", "swebench", "SWE-bench's pytest log parser")
    b, a = parsers.parse_log_pytest(before, None), parsers.parse_log_pytest(after, None)
    f2p = sorted(t for t, s in a.items() if s == "PASSED" and b.get(t) != "PASSED")
    p2p = sorted(t for t, s in a.items() if s == "PASSED" and b.get(t) == "PASSED")
    return f2p, p2p
