"""Trajectories for RL frameworks: a rollout's steps logged on the bus, so a preempted trainer
that restarts the same rollout fast-forwards through the steps it already took.

    async with client.trajectory("rollout-17", image="debian", cpu=0.5) as t:
        r = await t.exec("pytest -x")     # step 0, 1, 2, ... counted for you

Resuming with the same id re-issues steps from 0: logged steps come back at once with
`replayed=True` (never executed twice); the first new step runs for real. If the sandbox itself
was lost, a new one is made from the trajectory's last snapshot and the logged steps after it are
re-run on the node before the rollout continues."""
from __future__ import annotations

import asyncio
import builtins
import contextlib
from typing import TYPE_CHECKING, Any

import msgspec

from corral_common.contract import subjects
from corral_common.contract.errors import NotFound, Timeout, Unavailable
from corral_common.contract.messages import (
    ExecRequest,
    ExecResult,
    RestoreRequest,
    SandboxSpec,
    TrajEntry,
    TrajGetRequest,
    TrajListRequest,
    TrajMeta,
    TrajOpenRequest,
    TrajRef,
)
from corral_common.contract.replies import RestoreReply, TrajDeleteReply, TrajGetReply, TrajListReply, TrajReply
from corral_common.contract.traj import input_hash

if TYPE_CHECKING:
    from .client import AsyncClient, AsyncSandbox


class Trajectories:
    """List, inspect and delete trajectories (`client.trajectories`)."""

    def __init__(self, client: AsyncClient):
        self.client = client

    async def list(self, prefix: str = "") -> list[TrajMeta]:
        return (await self.client.request(subjects.TRAJ_LIST, TrajListRequest(prefix=prefix), TrajListReply, 30.0)).trajectories

    async def get(self, tid: str) -> tuple[TrajMeta, builtins.list[TrajEntry]]:
        """The trajectory and its 20 most recent steps."""
        r = await self.client.request(subjects.TRAJ_GET, TrajGetRequest(id=tid), TrajGetReply, 30.0)
        return r.trajectory, r.recent

    async def entries(self, tid: str) -> tuple[TrajMeta, builtins.list[TrajEntry]]:
        """The trajectory and every logged step, fetched in pages."""
        out: builtins.list[TrajEntry] = []
        step = 0
        while True:
            r = await self.client.request(subjects.TRAJ_GET, TrajGetRequest(id=tid, from_step=step), TrajGetReply, 30.0, resend=True)
            page = r.recent
            out += page
            if not page or page[-1].step >= r.trajectory.last_step:
                return r.trajectory, out
            step = page[-1].step + 1

    async def delete(self, tid: str) -> None:
        await self.client.request(subjects.TRAJ_DELETE, TrajRef(id=tid), TrajDeleteReply, 30.0)


class Trajectory:
    def __init__(self, client: AsyncClient, tid: str, spec: SandboxSpec, snapshot_every: int = 10, keepalive_s: float | None = None):
        self.client = client
        self.id = tid
        self.spec = spec
        self.snapshot_every = snapshot_every
        self.keepalive_s = keepalive_s if keepalive_s is not None else max(1.0, min(60.0, spec.ttl_s / 3))
        self.step = 0
        self.sandbox: AsyncSandbox | None = None
        self.resumed = False
        self.rerun_steps = 0
        self.lost_wait_s = 60.0
        self._log: dict[int, TrajEntry] = {}
        self.fast_forwarded = 0
        self._keepalive: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Trajectory:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        tr = Trajectories(self.client)
        try:
            meta, entries = await tr.entries(self.id)
            # resuming: the logged steps are answered here, without a round trip per step
            self._log = {e.step: e for e in entries}
        except NotFound:
            meta = None
        if meta is None:
            sb = await self.client.create_spec(self.spec)
            r = await self.client.request(subjects.TRAJ_OPEN, TrajOpenRequest(id=self.id, sandbox_id=sb.id, spec=self.spec,
                                                                              snapshot_every=self.snapshot_every), TrajReply, 30.0)
            if r.trajectory.sandbox_id != sb.id:  # another opener won the race
                await sb.destroy()
                sb = await self._attach(r.trajectory)
            self.sandbox = sb
        else:
            self.resumed = True
            self.sandbox = await self._attach(meta)
        self._keepalive = asyncio.create_task(self._renew_loop())

    async def _attach(self, meta: TrajMeta) -> AsyncSandbox:
        sb = self.client.sandbox(meta.sandbox_id)
        deadline = asyncio.get_running_loop().time() + self.lost_wait_s
        while True:
            try:
                await sb.refresh(timeout=3)
                return sb
            except NotFound:
                break
            except (Timeout, Unavailable) as e:
                # its node may have died (no answer, or the scheduler says its agent is not
                # running): the scheduler declares it lost within seconds, or a restarted agent
                # adopts the sandbox
                if asyncio.get_running_loop().time() > deadline:
                    raise
                if isinstance(e, Unavailable):
                    await asyncio.sleep(min(max(e.retry_after_s or 1.0, 0.1), 2.0))

        # the sandbox is gone: a new one from the last snapshot, then the node re-runs the rest
        image = meta.snapshots[-1].image if meta.snapshots else meta.spec.image
        sb = await self.client.create_spec(msgspec.structs.replace(meta.spec, image=image, request_id=""))
        r = await sb._call("restore", RestoreRequest(trajectory=self.id), RestoreReply, timeout=3600)
        self.rerun_steps = r.rerun_steps
        return sb

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s)
            with contextlib.suppress(Exception):
                assert self.sandbox is not None
                await self.sandbox.renew()

    async def exec(self, cmd: str | list[str], **kw: Any) -> ExecResult:
        assert self.sandbox is not None, "use `async with client.trajectory(...)` or await open()"
        logged = self._log.pop(self.step, None)
        if logged is not None:
            req = ExecRequest(cmd=cmd, stdin=kw.get("stdin") or "", env=kw.get("env") or {}, cwd=kw.get("cwd"),
                              session=kw.get("session") or "")
            if logged.input_hash == input_hash(req):
                self.step += 1
                self.fast_forwarded += 1
                return msgspec.structs.replace(logged.result, replayed=True)
            self._log.clear()  # diverged: the node decides (conflict, or truncate if asked)
        r = await self.sandbox.exec(cmd, trajectory=self.id, step=self.step, **kw)
        self.step += 1
        return r

    async def close(self) -> None:
        """Stop renewing the lease; the sandbox lives on until its ttl (resume may still come)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def finish(self, delete_log: bool = False) -> None:
        """The rollout is done: destroy the sandbox (and optionally the log and its snapshots)."""
        await self.close()
        if self.sandbox is not None:
            with contextlib.suppress(NotFound):
                await self.sandbox.destroy()
        if delete_log:
            await Trajectories(self.client).delete(self.id)
