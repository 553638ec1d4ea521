"""A sandbox's operations, `corral.v1.sandbox.<id>.<op>`, served by the node that holds it and
dispatched by a table: op name -> handler."""
from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from corral_common import bus, tenancy
from corral_common.contract import subjects
from corral_common.contract.audit import AuditEvent
from corral_common.contract.envelope import Reply
from corral_common.contract.errors import Capacity, Forbidden, InvalidRequest
from corral_common.contract.messages import (
    AuditState,
    ChangesReply,
    ChangesRequest,
    ExecRequest,
    FileContent,
    FileReadRequest,
    FileWriteRequest,
    RenewRequest,
    SnapshotRequest,
)
from corral_common.contract.replies import (
    DestroyReply,
    ExecReply,
    FileReadReply,
    FileWriteReply,
    InfoReply,
    SandboxReply,
    SandboxUsageInfo,
    SnapshotReply,
)

from ..audit.wiring import AuditWiring
from ..lifecycle import Lifecycle
from ..placements import Placements
from ..snapshot import Snapshots
from ..substrates import Substrate
from ..substrates.base import Sandbox
from ..table import SandboxTable
from ..tunnels import Tunnels
from .exec import ExecFn
from .traj import Trajectories

OpHandler = Callable[[Msg, Sandbox, Substrate], Awaitable[Reply]]

MAX_EXECS_PER_SANDBOX = 64


class _Empty(msgspec.Struct, forbid_unknown_fields=False):
    """The body of the ops that take no arguments (anything is accepted, as before there were any)."""


class SandboxOps:
    def __init__(self, table: SandboxTable, lifecycle: Lifecycle, audit: AuditWiring, placements: Placements,
                 snapshots: Snapshots, exec_: ExecFn, trajectories: Trajectories, tunnels: Tunnels):
        self.table = table
        self.lifecycle = lifecycle
        self.audit = audit
        self.placements = placements
        self.snapshots = snapshots
        self.exec = exec_  # the exec handler, replay-wrapped
        self.ops: dict[str, OpHandler] = {
            "exec": self._exec,
            "info": self._info,
            "files.read": self._read,
            "files.write": self._write,
            "destroy": self._destroy,
            "pause": self._pause,
            "resume": self._resume,
            "snapshot": self._snapshot,
            "changes": self._changes,
            "audit": self._audit,
            "renew": self._renew,
            "restore": trajectories.restore,
            "port.open": tunnels.on_open,
        }

    def handler(self, sid: str) -> bus.Handler:
        """The handler of `corral.v1.sandbox.<sid>.>`."""
        prefix = f"{subjects.PREFIX}.sandbox.{sid}."

        async def handle(msg: Msg) -> Reply:
            op = msg.subject[len(prefix):]
            sb, sub = self.table.live(sid)
            fn = self.ops.get(op)
            if fn is None:
                raise InvalidRequest(f"unknown sandbox operation {op!r}; known: {', '.join(subjects.SANDBOX_OPS)}")
            who = tenancy.caller(msg)
            if who is not None and who != sb.info.tenant:
                self.audit.emit(AuditEvent(**self.audit.base(sid), kind="access", op=op, denied=True,
                                           detail={"tenant": who, "owner": sb.info.tenant or "(operator)"}))
                raise Forbidden(f"sandbox {sid} belongs to another tenant")
            return await fn(msg, sb, sub)

        return handle

    async def _exec(self, msg: Msg, sb: Sandbox, sub: Substrate) -> ExecReply:
        req = bus.decode(msg.data, ExecRequest)
        if isinstance(req.cmd, str) and not req.cmd.strip():
            raise InvalidRequest("cmd is empty")
        # each exec holds pipes, a cgroup and a task on this node: one sandbox's callers cannot
        # take them all
        if sb.running_execs >= MAX_EXECS_PER_SANDBOX:
            raise Capacity(f"sandbox {sb.id} has {sb.running_execs} execs running, the most allowed; wait for one to end",
                           retry_after_s=0.5)
        sb.running_execs += 1
        try:
            return ExecReply(result=await self.exec(msg, req, sb, sub))
        finally:
            sb.running_execs -= 1

    async def _info(self, msg: Msg, sb: Sandbox, sub: Substrate) -> InfoReply:
        bus.decode(msg.data, _Empty)
        u = await sub.usage(sb)
        return InfoReply(sandbox=sb.info, usage=SandboxUsageInfo(cpu_ns=u.cpu_ns, memory_bytes=u.memory_bytes, pids=u.pids))

    async def _read(self, msg: Msg, sb: Sandbox, sub: Substrate) -> FileReadReply:
        r = bus.decode(msg.data, FileReadRequest)
        await self.audit.check_file_read(sb, r.path)
        data, mode = await sub.read_file(sb, r.path, r.max_bytes)
        return FileReadReply(file=FileContent(path=r.path, content_b64=base64.b64encode(data).decode(), size=len(data), mode=mode))

    async def _write(self, msg: Msg, sb: Sandbox, sub: Substrate) -> FileWriteReply:
        w = bus.decode(msg.data, FileWriteRequest)
        try:
            data = base64.b64decode(w.content_b64, validate=True)
        except ValueError:
            raise InvalidRequest("content_b64 is not valid base64") from None
        await sub.write_file(sb, w.path, data, w.mode, w.make_parents)
        return FileWriteReply(path=w.path, size=len(data))

    async def _destroy(self, msg: Msg, sb: Sandbox, sub: Substrate) -> DestroyReply:
        bus.decode(msg.data, _Empty)
        await self.lifecycle.destroy(sb.id, "destroyed by request")
        return DestroyReply(sandbox_id=sb.id)

    async def _pause(self, msg: Msg, sb: Sandbox, sub: Substrate) -> SandboxReply:
        # after any freeze-and-read in progress (changes, snapshot, fork), whose thaw would undo it
        async with sb.changes_lock:
            await sub.pause(sb)
        sb.info.state = "paused"
        await self.placements.put(sb)
        return SandboxReply(sandbox=sb.info)

    async def _resume(self, msg: Msg, sb: Sandbox, sub: Substrate) -> SandboxReply:
        async with sb.changes_lock:
            await sub.resume(sb)
        sb.info.state = "running"
        await self.placements.put(sb)
        return SandboxReply(sandbox=sb.info)

    async def _snapshot(self, msg: Msg, sb: Sandbox, sub: Substrate) -> SnapshotReply:
        req = bus.decode(msg.data, SnapshotRequest)
        if req.memory and not sub.snapshots_memory:
            raise InvalidRequest(f"substrate {sub.name!r} cannot snapshot memory: {sub.memory_snapshot_gap}; "
                                 "snapshot its files (memory: false), or fork it (fork_of)")
        image, layer, uploaded = await self.snapshots.take(sb, sub, req.name, req.labels, req.memory)
        return SnapshotReply(image=image, layer=layer.digest, size=layer.size, uploaded_bytes=uploaded)

    async def _changes(self, msg: Msg, sb: Sandbox, sub: Substrate) -> ChangesReply:
        return await sub.changes(sb, bus.decode(msg.data, ChangesRequest))

    async def _audit(self, msg: Msg, sb: Sandbox, sub: Substrate) -> AuditState:
        bus.decode(msg.data, _Empty)
        await sub.audit_barrier(sb)
        return await self.audit.state(sb.id)

    async def _renew(self, msg: Msg, sb: Sandbox, sub: Substrate) -> SandboxReply:
        r = bus.decode(msg.data, RenewRequest)
        sb.info.expires_at = time.time() + (r.ttl_s or sb.spec.ttl_s)
        await self.placements.put(sb)
        return SandboxReply(sandbox=sb.info)
