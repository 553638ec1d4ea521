"""`corral.node.<node>.run` (from the scheduler's `corral.v1.sandbox.run`): a fresh sandbox, one
exec, audited like any other, then gone. The reply goes out as soon as the command has ended; the
teardown follows, and a `destroyed` event marks its end."""
from __future__ import annotations

import logging
import shlex
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import bus, metrics
from corral_common.contract import envelope
from corral_common.contract.audit import AuditEvent, event_id
from corral_common.contract.errors import CorralError, InvalidRequest
from corral_common.contract.messages import Event, NodeRun, SandboxInfo, new_id
from corral_common.contract.replies import RunReply

from ..audit.wiring import AuditWiring
from ..events import Events
from ..lifecycle import DESTROY_SECONDS
from ..sandbox_labels import sandbox_labels
from ..table import SandboxTable
from .exec import EXEC_SECONDS, bus_limit, fit_to_bus

log = logging.getLogger("corral.node")

RUN_SECONDS = metrics.histogram(
    "corral_run_seconds", "One-shot run (create, exec, until the command ended) as seen by the node", ("node", "substrate"),
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 5, 30, 300),
)


class Run:
    def __init__(self, nc: NATS, node: str, table: SandboxTable, audit: AuditWiring, events: Events):
        self.nc = nc
        self.node = node
        self.table = table
        self.audit = audit
        self.events = events

    async def on_run(self, msg: Msg) -> None:
        req = bus.decode(msg.data, NodeRun)
        spec, ereq = req.spec, req.exec
        sub = self.table.substrate_for(spec, one_shot=True)
        if isinstance(ereq.cmd, str) and not ereq.cmd.strip():
            raise InvalidRequest("cmd is empty")
        if ereq.stream or ereq.session or ereq.trajectory:
            raise InvalidRequest("a one-shot run answers with one message and keeps nothing: stream, session and "
                                 "trajectory need a sandbox (create one, then exec)")
        token = object()
        self.table.admit_run(token, spec)
        # (an unknown image is the substrate's NotFound, raised before it sets anything up)
        now = time.time()
        info = SandboxInfo(id=new_id(), node=self.node, state="running", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=sandbox_labels(spec),
                           cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id, tenant=spec.tenant)
        t0 = time.perf_counter()
        try:
            result, finish = await sub.run(info, spec, ereq, None)
        except CorralError:
            await self.events.failed(info.id, "run failed", job=spec.job, info=info)
            raise
        finally:
            self.table.done_running(token)
        result = fit_to_bus(result, bus_limit(self.nc))
        RUN_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
        EXEC_SECONDS.labels(self.node, sub.name).observe(result.duration_ms / 1000)
        self.audit.emit(AuditEvent(
            id=event_id(), ts=time.time(), node=self.node, sandbox=info.id, kind="exec", job=spec.job, labels=info.labels,
            cmd=ereq.cmd if isinstance(ereq.cmd, str) else shlex.join(ereq.cmd), cwd=ereq.cwd or spec.workdir,
            exit_code=result.exit_code, duration_ms=round(result.duration_ms, 3), stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr), timed_out=result.timed_out,
            detail={"substrate": sub.name, "one_shot": "1", **({"oom_killed": "1"} if result.oom_killed else {})},
        ))
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, envelope.encode(RunReply(result=result, sandbox_id=info.id, node=self.node)))
            except Exception:
                log.warning("could not publish run reply", extra={"fields": {"sandbox": info.id}})
        t1 = time.perf_counter()
        try:
            await finish()
        except Exception:
            log.exception("teardown after run failed", extra={"fields": {"sandbox": info.id}})
        DESTROY_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t1)
        self.audit.forget(info.id)
        info.state = "destroyed"
        await self.events.publish(Event(kind="destroyed", ts=time.time(), sandbox_id=info.id, node=self.node, job=spec.job,
                                        reason="one-shot run finished", info=info,
                                        detail={"exit_code": result.exit_code, "duration_ms": round(result.duration_ms, 3)}))
