"""Grading a rollout where the agent never was: the rollout's sandbox is snapshotted, a grading
sandbox starts from that snapshot with the hidden tests (and the grader files as built) written in,
the test command decides pass/fail, and the monitor's alerts for the rollout are folded in: a
flagged cheat gets reward 0 with the rules named."""
from __future__ import annotations

import asyncio
import re
import time

import msgspec
from nats.js import JetStreamContext

from corral_common import subjects
from corral_common.envs import ENV_LABEL, ENV_VERSION_LABEL, SEVERITY_RANK, AlertSummary, EnvGradeRequest, EnvGradeResult
from corral_common.errors import InvalidRequest, Unavailable
from corral_common.messages import SandboxSpec, encoder
from corral_sdk.client import AsyncClient

from . import verify, workspace
from .catalog import EnvCatalog

SANDBOX_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
WINDOW_RULE_PERIOD_S = 5.0  # the monitor evaluates its SQL window rules this often


class _QueryReply(msgspec.Struct):
    ok: bool
    rows: list[list] = []
    error: dict | None = None


class Grader:
    def __init__(self, client: AsyncClient, js: JetStreamContext, catalog: EnvCatalog):
        self.client, self.js, self.catalog = client, js, catalog

    async def grade(self, req: EnvGradeRequest) -> EnvGradeResult:
        t0 = time.perf_counter()
        if not SANDBOX_ID.match(req.sandbox_id):
            raise InvalidRequest(f"invalid sandbox id {req.sandbox_id!r}")
        rollout = self.client.sandbox(req.sandbox_id)
        info = await rollout.refresh()
        name = req.name or info.labels.get(ENV_LABEL, "")
        if not name:
            raise InvalidRequest(f"sandbox {req.sandbox_id} has no {ENV_LABEL!r} label: pass the environment's `name`")
        env = await self.catalog.get(name, req.version or info.labels.get(ENV_VERSION_LABEL, ""))
        rec = env.record
        snap = await rollout.snapshot(name=f"grade-{req.sandbox_id.lower()}-{int(time.time() * 1000)}"[:128],
                                      labels={"corral.role": "env-grade", ENV_LABEL: rec.name})
        try:
            spec = SandboxSpec(image=snap, cpu=rec.limits.cpu, memory_mb=rec.limits.memory_mb, disk_mb=rec.limits.disk_mb,
                                      pids_max=rec.limits.pids_max, ttl_s=max(600.0, rec.test_timeout_s * 4), workdir=rec.workdir,
                                      job=info.job, labels={"corral.role": "env-grade", ENV_LABEL: rec.name, "corral.graded": req.sandbox_id})
            g = await self.client.create_spec(spec)
            try:
                await workspace.put_files(g, {p: c.encode() for p, c in {**env.grader_files, **env.hidden_files}.items()})
                r = await g.exec(["/bin/sh", "-c", rec.test_command], cwd=rec.workdir, timeout_s=rec.test_timeout_s,
                                 max_output_bytes=256 * 1024)
            finally:
                await _quietly(g.destroy())
        finally:
            await _quietly(self.client.request(subjects.IMAGE_DELETE, encoder.encode({"name": snap}), 60))
        passed = r.exit_code == 0 and not r.timed_out
        alerts, checked = await self.alerts_for(req.sandbox_id, req.alert_wait_s)
        if not checked and req.require_monitor:
            raise Unavailable("the monitor did not answer, so cheating could not be ruled out; retry, or pass "
                              "require_monitor=false to grade on the tests alone")
        bad = [a for a in alerts if SEVERITY_RANK.get(a.severity, 0) >= SEVERITY_RANK[req.fail_on]]
        if bad:
            reward, reason = 0.0, "flagged by the monitor: " + ", ".join(sorted({f"{a.rule} ({a.severity})" for a in bad}))
        elif passed:
            reward, reason = 1.0, "hidden tests passed"
        else:
            reward, reason = 0.0, f"hidden tests failed (exit {r.exit_code}{', timed out' if r.timed_out else ''})"
        if req.destroy:
            await _quietly(rollout.destroy())
        return EnvGradeResult(sandbox_id=req.sandbox_id, name=rec.name, version=rec.version, reward=reward, passed=passed,
                              exit_code=r.exit_code, reason=reason, output=workspace.tail(r, 2000), alerts=alerts,
                              monitor_checked=checked, seconds=round(time.perf_counter() - t0, 3))

    async def alerts_for(self, sandbox_id: str, wait_s: float) -> tuple[list[AlertSummary], bool]:
        """The monitor's alerts for one sandbox, after the monitor has ingested every audit event
        published so far (and, for recent activity, had a chance to run its window rules)."""
        deadline = time.monotonic() + wait_s
        if not await self._monitor_caught_up(deadline):
            return [], False
        # window rules (SQL, every few seconds) look at denied syscalls and file changes: when the
        # sandbox had such events lately, give them one period to run
        last = await self._query("SELECT toUnixTimestamp64Milli(max(ts)) FROM audit_events "
                                 f"WHERE sandbox = '{sandbox_id}' AND ((kind = 'syscall' AND denied) OR kind = 'file') "
                                 "AND ts >= now64(3) - INTERVAL 60 SECOND")
        if last is None:
            return [], False
        if last and last[0] and last[0][0]:
            idle = time.time() - float(last[0][0]) / 1000
            pause = min(WINDOW_RULE_PERIOD_S + 0.5 - idle, deadline - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)
        rows = await self._query("SELECT rule, severity, any(message) FROM alerts FINAL "
                                 f"WHERE sandbox = '{sandbox_id}' GROUP BY rule, severity ORDER BY rule")
        if rows is None:
            return [], False
        return [AlertSummary(rule=str(a), severity=str(b), message=str(c)) for a, b, c in rows], True

    async def _monitor_caught_up(self, deadline: float) -> bool:
        try:
            target = (await self.js.stream_info("CORRAL_AUDIT")).state.last_seq
        except Exception:
            return False
        while True:
            try:
                ci = await self.js.consumer_info("CORRAL_AUDIT", subjects.MONITOR_AUDIT_DURABLE)
                if ci.ack_floor is not None and (ci.ack_floor.stream_seq or 0) >= target:
                    return True
            except Exception:
                pass  # no monitor (yet): its durable consumer does not exist
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def _query(self, sql: str) -> list[list] | None:
        try:
            msg = await self.client.nc.request(subjects.MONITOR_QUERY, encoder.encode({"sql": sql}), timeout=15)
            r = msgspec.json.decode(msg.data, type=_QueryReply)
        except Exception:
            return None
        return r.rows if r.ok else None


async def _quietly(aw) -> None:
    try:
        await aw
    except Exception:
        pass
