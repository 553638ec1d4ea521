"""`corral eval`: any agent policy, run many times on one environment and graded.

A policy is an async function `(sandbox, task) -> None`: it acts only through the SDK sandbox it
is given (exec, files), the way a model-driven agent would, and `task` tells it what the
environment asks for and within which limits. Each rollout is a fresh sandbox of the environment
(`client.envs.rollout`), the policy's turn, then the grade (`client.envs.grade`: hidden tests and
the monitor's alerts), with the sandbox destroyed whatever happened. `evaluate` runs N of them C at
a time and returns typed results; eval_report.py turns them into tables, JSON and a PNG."""
from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import msgspec

from corral_common.contract.audit import AlertSummary
from corral_common.contract.envs import EnvRecord, RolloutLimits, TestOutcome
from corral_common.contract.errors import CorralError, InvalidRequest, NotFound

from .client import AsyncClient, AsyncSandbox


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy is told: the environment, its description (the issue to solve), where the
    code is, how its visible tests run, and the rollout's resource limits."""

    env: str
    version: str
    description: str
    workdir: str
    limits: RolloutLimits
    rollout: int  # index of this rollout in the run
    visible_test_hint: str = ""  # the env's test command, as the README of a repository would say it


Policy = Callable[[AsyncSandbox, Task], Awaitable[object]]


class NamedPolicy(msgspec.Struct, frozen=True):
    name: str
    fn: Policy


class RolloutResult(msgspec.Struct, kw_only=True):
    """One rollout. `reward` None: it got no grade (`error` says why: create, policy or grade)."""

    i: int
    policy: str
    sandbox: str = ""
    substrate: str = ""  # where it ran, as its node said
    reward: float | None = None
    passed: bool | None = None
    reason: str = ""
    error: str = ""
    alerts: list[AlertSummary] = []
    tests: list[TestOutcome] = []
    discarded: list[str] = []
    create_s: float = 0.0
    agent_s: float = 0.0
    grade_s: float = 0.0
    grader_s: float = 0.0  # the grader's own time (inside grade_s)
    total_s: float = 0.0

    @property
    def rules(self) -> list[str]:
        return sorted({a.rule for a in self.alerts})

    def tests_passed(self) -> int:
        return sum(t.outcome == "passed" for t in self.tests)


class Percentiles(msgspec.Struct):
    p50: float
    p90: float
    p99: float


class TestTally(msgspec.Struct, kw_only=True):
    """One named test across all graded rollouts."""

    id: str
    expected: str
    passed: int = 0
    failed: int = 0
    error: int = 0
    skipped: int = 0
    missing: int = 0


class AlertTally(msgspec.Struct, kw_only=True):
    rule: str
    severity: str
    rollouts: int
    example: str


class EvalSummary(msgspec.Struct, kw_only=True):
    env: str
    version: str
    rollouts: int
    concurrency: int
    graded: int
    errors: int
    rewarded: int
    mean_reward: float
    flagged: int  # rollouts with at least one alert
    wall_s: float
    rollouts_per_s: float
    left_behind: int  # sandboxes of the run's job still alive afterwards
    create_s: Percentiles
    agent_s: Percentiles
    grade_s: Percentiles
    total_s: Percentiles


class EvalReport(msgspec.Struct, kw_only=True):
    summary: EvalSummary
    rows: list[RolloutResult]
    tests: list[TestTally]
    alerts: list[AlertTally]


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def percentiles(xs: Sequence[float]) -> Percentiles:
    return Percentiles(p50=round(pct(xs, 50), 3), p90=round(pct(xs, 90), 3), p99=round(pct(xs, 99), 3))


def load_policy(ref: str) -> NamedPolicy:
    """`module:function` (module importable, the current directory included) -> the policy."""
    mod_name, sep, fn_name = ref.partition(":")
    if not sep or not mod_name or not fn_name:
        raise InvalidRequest(f"--policy {ref!r}: expected module:function, e.g. my_agent:act")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise InvalidRequest(f"--policy {ref!r}: cannot import {mod_name!r}: {e}") from None
    fn: object = mod
    for part in fn_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise InvalidRequest(f"--policy {ref!r}: {mod_name} has no attribute {fn_name!r}")
    if not callable(fn):
        raise InvalidRequest(f"--policy {ref!r}: {fn_name} is not callable")
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise InvalidRequest(f"--policy {ref!r}: {fn_name} must be an async function (sandbox, task) -> None")
    return NamedPolicy(fn_name, cast(Policy, fn))  # an async callable, checked just above


def task_for(env: EnvRecord, i: int) -> Task:
    return Task(env=env.name, version=env.version, description=env.description, workdir=env.workdir, limits=env.limits,
                rollout=i, visible_test_hint=env.test_command)


async def run_one(client: AsyncClient, env: EnvRecord, i: int, policy: NamedPolicy, *, job: str, fail_on: str = "high",
                  labels: dict[str, str] | None = None, substrate: str = "") -> RolloutResult:
    """Create (on `substrate`, or the spec's default), act, grade, destroy. Every CorralError (and
    a policy's own exception) becomes the row's `error`; the sandbox is destroyed on every path."""
    row = RolloutResult(i=i, policy=policy.name)
    sb: AsyncSandbox | None = None
    t0 = time.perf_counter()
    stage = "create"
    try:
        on: dict[str, Any] = {"substrate": substrate} if substrate else {}
        sb = await client.envs.rollout_of(env, job=job, labels={**(labels or {}), "policy": policy.name, "rollout": str(i)}, **on)
        row.sandbox, row.substrate, row.create_s = sb.id, sb.info.substrate, time.perf_counter() - t0
        stage = "policy"
        t1 = time.perf_counter()
        await policy.fn(sb, task_for(env, i))
        row.agent_s = time.perf_counter() - t1
        stage = "grade"
        t2 = time.perf_counter()
        g = await client.envs.grade(sb, destroy=True, fail_on=fail_on)
        sb = None
        row.grade_s = time.perf_counter() - t2
        row.reward, row.passed, row.reason, row.alerts = g.reward, g.passed, g.reason, g.alerts
        row.tests, row.discarded, row.grader_s = g.tests, g.discarded, g.seconds
    except CorralError as e:
        row.error = f"{stage}: {e.code.value}: {e.message}"
    except Exception as e:  # noqa: BLE001 - a policy is user code: its failure is this rollout's, not the run's
        row.error = f"{stage}: {type(e).__name__}: {e}"
    finally:
        if sb is not None:
            try:
                await sb.destroy()
            except CorralError:
                pass  # already gone (ttl, or the grader destroyed it before failing): nothing is left to free
    row.total_s = time.perf_counter() - t0
    return row


async def evaluate(client: AsyncClient, env: str, policies: Sequence[NamedPolicy], rollouts: int, concurrency: int, *,
                   version: str = "", job: str = "eval", fail_on: str = "high", labels: dict[str, str] | None = None,
                   on_done: Callable[[RolloutResult], object] | None = None, substrate: str = "") -> EvalReport:
    """`rollouts` rollouts of `env`, policies dealt round-robin, `concurrency` in flight at once,
    on `substrate` ("": the default, `container`). `on_done(row)` is called as each finishes
    (progress display)."""
    if rollouts < 1 or concurrency < 1:
        raise InvalidRequest("rollouts and concurrency must be at least 1")
    if not policies:
        raise InvalidRequest("no policy to evaluate")
    record = await client.envs.get(env, version)
    rows: list[RolloutResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(rollouts):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            row = await run_one(client, record, i, policies[i % len(policies)], job=job, fail_on=fail_on, labels=labels,
                                substrate=substrate)
            rows.append(row)
            if on_done is not None:
                on_done(row)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, rollouts))))
    wall = time.perf_counter() - t0
    left = await _still_alive(client, job)
    rows.sort(key=lambda r: r.i)
    return EvalReport(summary=_summary(record, rows, concurrency, wall, left), rows=rows, tests=_tests(rows),
                      alerts=_alerts(rows))


async def _still_alive(client: AsyncClient, job: str) -> int:
    """Sandboxes of the run's job that still answer: the listing is the scheduler's table, which
    learns of a destroy an instant after its answer (the node's placement delete reaches its watch),
    so each listed one is asked itself; one that answers `not_found` is gone."""
    alive = 0
    for info in await client.list(job=job):
        try:
            await client.sandbox(info.id).refresh(timeout=10)
        except NotFound:
            continue
        except CorralError:
            pass  # no clear answer (its node down): counted as left behind, not hidden
        alive += 1
    return alive


def _summary(env: EnvRecord, rows: list[RolloutResult], concurrency: int, wall: float, left: int) -> EvalSummary:
    graded = [r for r in rows if r.reward is not None]
    return EvalSummary(
        env=env.name, version=env.version, rollouts=len(rows), concurrency=concurrency, graded=len(graded),
        errors=len(rows) - len(graded), rewarded=sum((r.reward or 0) > 0 for r in graded),
        mean_reward=round(sum(r.reward or 0 for r in rows) / max(1, len(rows)), 3), flagged=sum(bool(r.alerts) for r in rows),
        wall_s=round(wall, 3), rollouts_per_s=round(len(rows) / wall, 3) if wall > 0 else 0.0, left_behind=left,
        create_s=percentiles([r.create_s for r in rows if r.sandbox]), agent_s=percentiles([r.agent_s for r in graded]),
        grade_s=percentiles([r.grade_s for r in graded]), total_s=percentiles([r.total_s for r in rows]))


def _tests(rows: list[RolloutResult]) -> list[TestTally]:
    tally: dict[str, TestTally] = {}
    for r in rows:
        for t in r.tests:
            tt = tally.setdefault(t.id, TestTally(id=t.id, expected=t.expected))
            setattr(tt, t.outcome, getattr(tt, t.outcome) + 1)
    return sorted(tally.values(), key=lambda t: (t.expected, t.id))


def _alerts(rows: list[RolloutResult]) -> list[AlertTally]:
    seen: dict[str, AlertTally] = {}
    for r in rows:
        for rule in r.rules:
            a = next(a for a in r.alerts if a.rule == rule)
            if rule in seen:
                seen[rule].rollouts += 1
            else:
                seen[rule] = AlertTally(rule=rule, severity=a.severity, rollouts=1, example=a.message[:200])
    return sorted(seen.values(), key=lambda a: (-a.rollouts, a.rule))
