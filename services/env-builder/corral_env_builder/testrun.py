"""Running an environment's tests with the trusted runner (sandbox_runner.py) and reading back
per-test outcomes: the runner is resolved from the spec, copied into the sandbox beside the hidden
tests, given a fresh nonce on stdin, and only its one nonce-tagged result line is believed."""
from __future__ import annotations

import secrets
import shlex
from pathlib import Path

import msgspec

from corral_common.contract.envs import EnvSpec, TestOutcomeKind
from corral_common.contract.errors import InvalidRequest
from corral_common.contract.messages import ExecResult
from corral_sdk.client import AsyncSandbox

from . import workspace

RUNNER_PATH = "/opt/corral-grader/runner.py"
RUNNER_SOURCE = (Path(__file__).parent / "sandbox_runner.py").read_bytes()
RESULT_TAG = "CORRAL-RESULT"


class RunnerPlan(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How an environment's tests run: `unittest` (discover from `start` with `pattern`, ids
    relative to `top`), `pytest` (`args` as given to pytest: paths, options), or `command`."""

    kind: str
    args: list[str] = []
    start: str = ""
    top: str = ""
    pattern: str = ""


class TestResult(msgspec.Struct, kw_only=True):
    outcome: TestOutcomeKind
    seconds: float = 0.0
    message: str = ""


class RunReport(msgspec.Struct, kw_only=True):
    results: dict[str, TestResult] = {}
    collected: dict[str, str] | None = None  # all-tests mode: id -> file
    errors: list[str] = []
    shadowing: list[str] = []
    violations: list[dict[str, str]] = []  # what the run-time guard refused or saw (event, why, path, line)
    worker_exit: int | None = None
    seconds: float = 0.0
    output: str = ""


def _shell_words(cmd: str) -> list[str]:
    """The words of the command that runs the tests: of `cd x && python3 -m pytest -q | tail`,
    the pytest part (a segment ends where the shell chains, pipes or redirects)."""
    try:
        words = shlex.split(cmd)
    except ValueError as e:
        raise InvalidRequest(f"test_command cannot be parsed: {e}") from None
    segments: list[list[str]] = [[]]
    for w in words:
        if w in ("|", "||", "&&", ";", "&") or w.endswith(";"):
            segments.append([])
        elif not w.startswith((">", "<", "2>", "1>")):
            segments[-1].append(w)
    for seg in segments:
        if any(_is_runner(w) for w in seg):
            return seg
    return segments[0]


def _is_runner(word: str) -> bool:
    return word in ("pytest", "py.test", "unittest") or word.endswith("/pytest")


def plan_for(spec: EnvSpec) -> RunnerPlan:
    """The runner an environment's tests need, from `runner` or (auto) from `test_command`."""
    words = _shell_words(spec.test_command)
    kind = spec.runner
    if kind == "auto":
        if any(_is_runner(w) and w != "unittest" for w in words):
            kind = "pytest"
        elif "unittest" in words:
            kind = "unittest"
        else:
            kind = "command"
    if kind == "command":
        return RunnerPlan(kind="command")
    after = next((i + 1 for i, w in enumerate(words) if _is_runner(w)), len(words))
    rest = words[after:]
    if kind == "pytest":
        return RunnerPlan(kind="pytest", args=[w for w in rest if w not in ("-x", "--exitfirst")])
    start, pattern, top = ".", "test*.py", ""
    if rest[:1] == ["discover"]:
        opts, pos = _discover_args(rest[1:])
        start = opts.get("start", pos[0] if pos else ".")
        pattern = opts.get("pattern", pos[1] if len(pos) > 1 else "test*.py")
        top = opts.get("top", pos[2] if len(pos) > 2 else "")
    else:
        names = [w for w in rest if not w.startswith("-")]
        if names:  # test modules, classes or methods by dotted name (from the workdir)
            return RunnerPlan(kind="unittest", args=[_dotted(n) for n in names], top=".")
    return RunnerPlan(kind="unittest", start=start, top=top or start, pattern=pattern)


def _dotted(name: str) -> str:
    """`tests/test_x.py` (which unittest also accepts) as the module name `tests.test_x`."""
    if name.endswith(".py"):
        name = name[:-3].replace("/", ".")
    if not all(part.isidentifier() for part in name.split(".")):
        raise InvalidRequest(f"runner unittest: {name!r} is not a test module, class or method name")
    return name


def _discover_args(words: list[str]) -> tuple[dict[str, str], list[str]]:
    names = {"-s": "start", "--start-directory": "start", "-p": "pattern", "--pattern": "pattern",
             "-t": "top", "--top-level-directory": "top"}
    opts: dict[str, str] = {}
    pos: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        key, _, val = w.partition("=")
        if key in names:
            if not val:
                i += 1
                val = words[i] if i < len(words) else ""
            opts[names[key]] = val
        elif not w.startswith("-"):
            pos.append(w)
        i += 1
    return opts, pos


def test_file(plan: RunnerPlan, workdir: str, test_id: str, collected_file: str) -> str:
    """The absolute path of the file that defines a test (the runner says it while collecting)."""
    if collected_file:
        return collected_file if collected_file.startswith("/") else f"{workdir.rstrip('/')}/{collected_file}"
    if plan.kind == "pytest":
        return f"{workdir.rstrip('/')}/{test_id.split('::', 1)[0]}"
    return ""


async def install(sb: AsyncSandbox, extra: dict[str, bytes] | None = None) -> None:
    """The runner (and any other grader files) into a sandbox, in one exec."""
    await workspace.put_files(sb, {RUNNER_PATH: RUNNER_SOURCE, **(extra or {})})


async def run(sb: AsyncSandbox, plan: RunnerPlan, workdir: str, timeout_s: float, tests: list[str] | None = None,
              carried: list[str] | None = None, added: dict[str, list[int]] | None = None,
              protected: list[str] | None = None) -> tuple[RunReport | None, ExecResult]:
    """Run `tests` (None: every test the plan discovers) with the runner already installed.
    Returns (report, exec result); report None when no genuine result line came back (the runner
    was killed, or its output was tampered with)."""
    nonce = secrets.token_hex(16)
    cfg = {"nonce": nonce, "kind": plan.kind, "workdir": workdir, "timeout_s": timeout_s, "tests": tests or [],
           "args": plan.args, "start": plan.start, "top": plan.top, "pattern": plan.pattern, "carried": carried or [],
           "added": added or {}, "protected": protected or []}
    r = await sb.exec(["python3", "-I", RUNNER_PATH], stdin=msgspec.json.encode(cfg).decode() + "\n", cwd=workdir,
                      timeout_s=timeout_s + 30, max_output_bytes=8 << 20, env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    return parse(r.stdout, nonce), r


def parse(stdout: str, nonce: str) -> RunReport | None:
    prefix = f"{RESULT_TAG} {nonce} "
    lines = [ln[len(prefix):] for ln in stdout.splitlines() if ln.startswith(prefix)]
    if len(lines) != 1:
        return None
    try:
        return msgspec.json.decode(lines[0], type=RunReport)
    except msgspec.ValidationError:
        return None


async def run_command(sb: AsyncSandbox, spec_command: str, workdir: str, timeout_s: float) -> ExecResult:
    return await sb.exec(["/bin/sh", "-c", spec_command], cwd=workdir, timeout_s=timeout_s, max_output_bytes=256 * 1024)
