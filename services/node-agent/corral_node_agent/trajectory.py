"""The trajectory log: exec steps that carry `trajectory` and `step` are appended to the
CORRAL_TRAJ stream (`corral.traj.<trajectory>.<step>`), with per-trajectory metadata in KV.

A step already in the log, issued again with the same inputs, is answered from the log
(`replayed: true`) without running: a preempted rollout that restarts from step 0 fast-forwards,
and non-idempotent commands never run twice. Every K steps the sandbox is snapshotted, so a
trajectory whose sandbox is lost resumes on a new sandbox made from the last snapshot, with the
logged steps after it re-run for real (`restore`).

`run_step` wraps an exec: the exec's own code knows nothing of trajectories. Any client gets this,
not only the SDK: the first exec of an unknown trajectory (at step 0) opens it, bound to that
sandbox, as `corral.v1.traj.open` would; the steps of one trajectory are serialised on the node
that owns its sandbox, so concurrent retries of a step run it once and the others replay it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from corral_common import bus
from corral_common.contract import subjects
from corral_common.contract.errors import Conflict, Forbidden, InvalidRequest, NotFound
from corral_common.contract.messages import ExecRequest, ExecResult, SandboxSpec, TrajEntry, TrajMeta, TrajSnapshot, encoder
from corral_common.contract.traj import bare, input_hash

log = logging.getLogger("corral.node.traj")
# how long a step that has run keeps trying to store its log entry while JetStream fails over
# (a stream leader election takes seconds); past it the step's result is answered unlogged
RECORD_WAIT_S = 30.0
# how far a trajectory's metadata may trail its log before a step is refused as skipping steps
# (each step in between is looked up in the log; a client's step far ahead is refused at once)
LAG_CHECK_STEPS = 16


def describe(req: ExecRequest) -> str:
    cmd = req.cmd if isinstance(req.cmd, str) else " ".join(req.cmd)
    return cmd if len(cmd) <= 200 else cmd[:200] + "..."


class TrajectoryLog:
    def __init__(self, js: JetStreamContext):
        self.js = js
        self.kv = None
        # trajectory id -> (its lock, how many execs hold or wait for it); dropped when unused
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    async def open(self) -> TrajectoryLog:
        self.kv = await bus.ensure_kv(self.js, subjects.KV_TRAJ)
        return self

    # ---------------------------------------------------------------- metadata

    async def get(self, tid: str) -> TrajMeta:
        e = await bus.kv_get(self.kv, tid, "the trajectory table")
        if e is None or not e.value:
            raise NotFound(f"unknown trajectory {tid!r}")
        return msgspec.json.decode(e.value, type=TrajMeta)

    async def maybe(self, tid: str) -> TrajMeta | None:
        try:
            return await self.get(tid)
        except NotFound:
            return None

    async def put(self, meta: TrajMeta) -> None:
        meta.updated_at = time.time()
        await self.kv.put(meta.id, encoder.encode(meta))

    async def create(self, meta: TrajMeta) -> TrajMeta:
        """Create unless it exists; return what is stored (the first opener wins a race)."""
        try:
            await self.kv.create(meta.id, encoder.encode(meta))
            return meta
        except Exception:
            return await self.get(meta.id)

    async def ids(self) -> list[str]:
        return sorted(await bus.kv_keys(self.kv))

    async def delete(self, tid: str) -> None:
        await self.get(tid)
        await self.js.purge_stream(subjects.TRAJ_STREAM, subject=subjects.traj_all(tid))
        await self.kv.delete(tid)

    # ---------------------------------------------------------------- entries

    async def entry(self, tid: str, step: int) -> TrajEntry | None:
        try:
            m = await self.js.get_last_msg(subjects.TRAJ_STREAM, subjects.traj_entry(tid, step))
        except NotFoundError:
            return None
        except Exception as e:
            if "no message found" in str(e).lower() or "not found" in str(e).lower():
                return None
            raise
        return msgspec.json.decode(m.data, type=TrajEntry)

    async def entries_from(self, tid: str, first: int, last: int) -> list[TrajEntry]:
        """Steps first..last in one pass over the stream (an ordered consumer), not one lookup
        per step: resuming a long trajectory costs one round of delivery."""
        if last < first:
            return []
        sub = await self.js.subscribe(subjects.traj_all(tid), ordered_consumer=True)
        found: dict[int, TrajEntry] = {}
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=5)
                except Exception:
                    break
                e = msgspec.json.decode(m.data, type=TrajEntry)
                if first <= e.step <= last:
                    found[e.step] = e
                if m.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return [found[s] for s in sorted(found)]

    @contextlib.asynccontextmanager
    async def _serial(self, tid: str) -> AsyncIterator[None]:
        """One step of a trajectory at a time on this node: between reading the log and recording
        the result nothing else of that trajectory may start, or two issues of a new step both see
        it unlogged and both run it. A trajectory's new steps run only in its bound sandbox, which
        lives on one node, so a lock in this process is enough."""
        lock, users = self._locks.get(tid) or (asyncio.Lock(), 0)
        self._locks[tid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[tid]
            if users == 1:
                del self._locks[tid]
            else:
                self._locks[tid] = (lock, users - 1)

    async def run_step(self, req: ExecRequest, sandbox_id: str, spec: SandboxSpec, node: str,
                       run: Callable[[], Awaitable[ExecResult]], snapshot: Callable[[], Awaitable[str]]) -> ExecResult:
        """An exec that carries `trajectory` and `step`: answered from the log (`replayed`), or
        `run` and logged (and `snapshot` taken when one is due, before the next step may start).

        Raises Conflict on a divergent command or a new step sent to another sandbox than the one
        the trajectory is bound to, InvalidRequest on a gap in the steps."""
        tid, step = req.trajectory, req.step
        assert step is not None
        async with self._serial(tid):
            logged = await self.check(req, sandbox_id, spec, node)
            if logged is not None:
                return logged
            result = await run()
            try:
                meta = await self.record(req, sandbox_id, node, result)
            except Exception as e:  # the bus stayed down past the retries: the caller still gets what ran
                log.error("trajectory step ran but is not logged", extra={"fields": {"trajectory": tid, "step": step, "error": repr(e)}})
                return result
            if meta is not None and self.snapshot_due(meta, step):
                await self.add_snapshot(tid, step, await snapshot())
            return result

    async def check(self, req: ExecRequest, sandbox_id: str, spec: SandboxSpec, node: str) -> ExecResult | None:
        """Before running a step: the logged result if it is a replay, None if it must run.

        The first step (0) of an unknown trajectory opens it, bound to this sandbox, with the
        defaults of `corral.v1.traj.open`: without metadata nothing would say which steps are
        logged, and every retry would run again. Raises Conflict on a divergent command or a new
        step outside the bound sandbox, InvalidRequest on a gap in the steps."""
        tid, step = req.trajectory, req.step
        assert step is not None
        meta = await self.maybe(tid)
        if meta is None and step == 0:
            now = time.time()
            meta = await self.create(TrajMeta(id=tid, sandbox_id=sandbox_id, spec=spec, node=node, created_at=now,
                                              updated_at=now))
            log.info("trajectory opened by its first exec", extra={"fields": {"trajectory": tid, "sandbox": meta.sandbox_id}})
        if meta is not None and meta.spec.tenant != spec.tenant:
            raise Forbidden(f"trajectory {tid!r} belongs to another tenant")
        last = meta.last_step if meta else -1
        if meta is not None and last + 1 < step <= last + 1 + LAG_CHECK_STEPS and await self._logged(tid, last + 1, step - 1):
            # the log has the steps in between: the metadata fell behind it (a step that ran while
            # its bucket failed over), and the log decides
            meta.last_step = last = step - 1
            await self.put(meta)
        if step > last + 1:
            raise InvalidRequest(
                f"step {step} of trajectory {tid!r} skips steps {last + 1}..{step - 1} "
                f"({'no steps are logged yet: start at step 0' if last < 0 else f'the last logged step is {last}'})")
        assert meta is not None
        entry = await self.entry(tid, step)
        if entry is not None and step > last:
            # logged, but the node stopped before the metadata caught up: the log decides
            meta.last_step = step
            await self.put(meta)
        if entry is not None:
            if entry.input_hash == input_hash(req):
                return msgspec.structs.replace(entry.result, replayed=True)
            if req.on_divergence != "truncate":
                raise Conflict(
                    f"step {step} of trajectory {tid!r} diverges from the log: logged `{describe(entry.request)}`, "
                    f"now `{describe(req)}` (send on_divergence=\"truncate\" to drop the log from step {step} on)")
        # the step runs (new, diverging with truncate, or gone from the stream): only where the state is
        if meta.sandbox_id and meta.sandbox_id != sandbox_id:
            raise Conflict(
                f"trajectory {tid!r} is bound to sandbox {meta.sandbox_id}; step {step} cannot run in {sandbox_id} "
                f"(send it to {meta.sandbox_id}, or restore the trajectory on this sandbox first)")
        if entry is not None:
            await self.truncate(tid, step)
        return None

    async def _logged(self, tid: str, first: int, last: int) -> bool:
        """Whether every step first..last has its entry in the log."""
        for s in range(first, last + 1):
            if await self.entry(tid, s) is None:
                return False
        return True

    async def truncate(self, tid: str, step: int) -> None:
        meta = await self.get(tid)
        for s in range(step, meta.last_step + 1):
            await self.js.purge_stream(subjects.TRAJ_STREAM, subject=subjects.traj_entry(tid, s))
        meta.last_step = step - 1
        meta.snapshots = [sn for sn in meta.snapshots if sn.step < step]
        await self.put(meta)
        log.info("trajectory truncated", extra={"fields": {"trajectory": tid, "from_step": step}})

    async def record(self, req: ExecRequest, sandbox_id: str, node: str, result: ExecResult) -> TrajMeta | None:
        """Append an executed step and advance the metadata (returned; None if the trajectory was
        deleted while the step ran)."""
        tid, step = req.trajectory, req.step
        assert step is not None
        entry = TrajEntry(trajectory=tid, step=step, input_hash=input_hash(req), request=bare(req), result=result,
                          sandbox_id=sandbox_id, ts=time.time())
        # the step has run: its entry must be stored even while a stream fails over, or a retry of
        # the step would run it again (the message id keeps a stored entry whose ack was lost single)
        data, msg_id = encoder.encode(entry), f"{tid}:{step}:{entry.input_hash}:{entry.ts}"
        await bus.while_jetstream_recovers(lambda: self.js.publish(subjects.traj_entry(tid, step), data, headers={"Nats-Msg-Id": msg_id}),
                                           f"trajectory {tid} step {step}", wait_s=RECORD_WAIT_S)
        meta = await self.maybe(tid)  # kv_get: retried while the bucket fails over
        if meta is None:
            return None  # deleted while the step ran
        if step > meta.last_step:
            meta.last_step = step
        meta.sandbox_id, meta.node = sandbox_id, node
        await bus.while_jetstream_recovers(lambda: self.put(meta), f"trajectory {tid}", wait_s=RECORD_WAIT_S)
        return meta

    def snapshot_due(self, meta: TrajMeta, step: int) -> bool:
        return meta.snapshot_every > 0 and (step + 1) % meta.snapshot_every == 0

    async def add_snapshot(self, tid: str, step: int, image: str) -> None:
        meta = await self.get(tid)
        meta.snapshots = [sn for sn in meta.snapshots if sn.step < step] + [TrajSnapshot(step=step, image=image)]
        await self.put(meta)

    async def steps_after(self, meta: TrajMeta, after: int) -> list[TrajEntry]:
        out = await self.entries_from(meta.id, after + 1, meta.last_step)
        missing = sorted(set(range(after + 1, meta.last_step + 1)) - {e.step for e in out})
        if missing:
            raise NotFound(f"steps {missing} of trajectory {meta.id!r} are missing from the log; cannot restore")
        return out
