"""Trajectories on the node: `corral.v1.traj.open|get|list|delete`, the sandbox op `restore`,
and replay, which wraps exec: a step already in the log is answered from it, a new one runs
through the wrapped exec and is logged (trajectory.py holds the log)."""
from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics, tenancy
from corral_common.contract import subjects
from corral_common.contract.envelope import decode_reply
from corral_common.contract.errors import Conflict, Forbidden, InvalidRequest, NotFound
from corral_common.contract.images import ImageDeleteReply, NameRequest
from corral_common.contract.messages import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    RestoreRequest,
    TrajGetRequest,
    TrajListRequest,
    TrajMeta,
    TrajOpenRequest,
    TrajRef,
    encoder,
)
from corral_common.contract.replies import RestoreReply, TrajDeleteReply, TrajGetReply, TrajListReply, TrajReply

from ..snapshot import Snapshots
from ..substrates import Substrate
from ..substrates.base import Sandbox
from ..trajectory import TrajectoryLog
from .exec import ExecFn

log = logging.getLogger("corral.node")

REPLAYED = metrics.counter("corral_traj_replayed_total", "Trajectory steps answered from the log", ("node",))
IMAGE_DELETE_TIMEOUT_S = 30.0


class Trajectories:
    def __init__(self, nc: NATS, node: str, log_: TrajectoryLog, snapshots: Snapshots):
        self.nc = nc
        self.node = node
        self.traj = log_
        self.snapshots = snapshots

    def replay(self, run: ExecFn) -> ExecFn:
        """`run`, wrapped: an exec carrying `trajectory` and `step` is looked up in the log and
        answered from it (`replayed`, its output streamed again if asked), or run and recorded,
        with a snapshot when one is due. Execs without a trajectory go straight to `run`."""

        async def exec_step(msg: Msg, req: ExecRequest, sb: Sandbox, sub: Substrate) -> ExecResult:
            if bool(req.trajectory) != (req.step is not None):
                raise InvalidRequest("trajectory and step go together: give both or neither")
            if not req.trajectory:
                return await run(msg, req, sb, sub)

            async def snapshot() -> str:
                name = f"traj-{req.trajectory.lower()}-{req.step}"[:128]
                image, _, _ = await self.snapshots.take(sb, sub, name, {"trajectory": req.trajectory})
                return image.name

            result = await self.traj.run_step(req, sb.id, sb.spec, self.node, lambda: run(msg, req, sb, sub), snapshot)
            if result.replayed:
                REPLAYED.labels(self.node).inc()
                if req.stream and msg.reply:
                    for i, (name, text) in enumerate((("stdout", result.stdout), ("stderr", result.stderr))):
                        if text:
                            await self.nc.publish(msg.reply, encoder.encode(ExecChunk(stream=name, data=text, seq=i)))  # type: ignore[arg-type]
            return result

        return exec_step

    async def serve(self, responder: bus.Responder) -> None:
        for subject, handler, op in ((subjects.TRAJ_OPEN, self.on_open, "traj.open"), (subjects.TRAJ_GET, self.on_get, "traj.get"),
                                     (subjects.TRAJ_LIST, self.on_list, "traj.list"), (subjects.TRAJ_DELETE, self.on_delete, "traj.delete")):
            await responder.serve(subject, handler, op, queue=subjects.TRAJ_QUEUE)

    async def on_open(self, msg: Msg) -> TrajReply:
        r = bus.decode(msg.data, TrajOpenRequest)
        who = tenancy.caller(msg)
        spec = r.spec if who is None else msgspec.structs.replace(r.spec, tenant=who)
        now = time.time()
        meta = await self.traj.create(TrajMeta(id=r.id, sandbox_id=r.sandbox_id, spec=spec, created_at=now, updated_at=now,
                                               snapshot_every=r.snapshot_every))
        tenancy.check_owner(who, meta.spec.tenant, f"trajectory {r.id!r}")  # an existing one (create is idempotent)
        return TrajReply(trajectory=meta)

    async def on_get(self, msg: Msg) -> TrajGetReply:
        r = bus.decode(msg.data, TrajGetRequest)
        meta = await self.traj.get(r.id)
        tenancy.check_owner(tenancy.caller(msg), meta.spec.tenant, f"trajectory {r.id!r}")
        first = max(0, meta.last_step - 19) if r.from_step is None else r.from_step
        last = min(meta.last_step, first + r.limit - 1)
        entries, size = [], 0
        for e in await self.traj.entries_from(r.id, first, last):
            size += len(e.result.stdout) + len(e.result.stderr) + 512
            if size > 4 * 1024 * 1024 and entries:
                break  # keep the reply under the bus payload limit; the caller pages on
            entries.append(e)
        return TrajGetReply(trajectory=meta, recent=entries)

    async def on_list(self, msg: Msg) -> TrajListReply:
        r = bus.decode(msg.data, TrajListRequest)
        who = tenancy.caller(msg)
        out = []
        for tid in await self.traj.ids():
            if tid.startswith(r.prefix):
                m = await self.traj.maybe(tid)
                if m is not None and (who is None or m.spec.tenant == who):
                    out.append(m)
        return TrajListReply(trajectories=out)

    async def on_delete(self, msg: Msg) -> TrajDeleteReply:
        r = bus.decode(msg.data, TrajRef)
        meta = await self.traj.get(r.id)
        tenancy.check_owner(tenancy.caller(msg), meta.spec.tenant, f"trajectory {r.id!r}")
        await self.traj.delete(r.id)
        for sn in meta.snapshots:
            await self._delete_image(sn.image)
        return TrajDeleteReply(id=r.id, snapshots_removed=len(meta.snapshots))

    async def _delete_image(self, name: str) -> None:
        """A trajectory's snapshot image, deleted by the image-cache (the catalog's one writer)."""
        try:
            m = await self.nc.request(subjects.IMAGE_DELETE, encoder.encode(NameRequest(name=name)), timeout=IMAGE_DELETE_TIMEOUT_S)
            decode_reply(m.data, ImageDeleteReply)
        except NotFound:
            pass  # deleted already
        except Exception as e:
            logs.kv(log, logging.WARNING, "trajectory snapshot image not deleted", image=name, error=repr(e))

    async def restore(self, msg: Msg, sb: Sandbox, sub: Substrate) -> RestoreReply:
        """Bind a trajectory to this (new) sandbox, made from its last snapshot (or its original
        image), re-running for real the logged steps the snapshot does not contain."""
        r = bus.decode(msg.data, RestoreRequest)
        meta = await self.traj.get(r.trajectory)
        if meta.spec.tenant != sb.info.tenant:
            raise Forbidden(f"trajectory {r.trajectory!r} belongs to another tenant")
        base_step, base_image = (meta.snapshots[-1].step, meta.snapshots[-1].image) if meta.snapshots else (-1, meta.spec.image)
        if sb.info.image != base_image:
            raise Conflict(f"trajectory {meta.id!r} must be restored on a sandbox of image {base_image!r} "
                           f"(its last snapshot, after step {base_step}); this one runs {sb.info.image!r}")
        t0 = time.perf_counter()
        entries = await self.traj.steps_after(meta, base_step)
        for e in entries:
            await sub.exec(sb, e.request, None)
        meta.sandbox_id, meta.node = sb.id, self.node
        await self.traj.put(meta)
        logs.kv(log, logging.INFO, "trajectory restored", trajectory=meta.id, sandbox=sb.id, from_step=base_step,
                rerun=len(entries), seconds=round(time.perf_counter() - t0, 3))
        return RestoreReply(trajectory=meta, rerun_steps=len(entries), from_snapshot_step=base_step)
