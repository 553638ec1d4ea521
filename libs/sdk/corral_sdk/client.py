"""The asyncio client. Every call is one NATS request on a v1 subject; replies are decoded into
the contract's Structs and error replies become typed exceptions."""
from __future__ import annotations

import asyncio
import base64
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from corral_common import auth, config
from corral_common.contract import subjects
from corral_common.contract.envelope import R, decode_reply
from corral_common.contract.errors import Capacity, InvalidRequest, NotFound, Timeout, Unavailable
from corral_common.contract.messages import (
    AuditState,
    BatchProgress,
    ChangesReply,
    ChangesRequest,
    CreateBatchRequest,
    Empty,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileReadRequest,
    FileWriteRequest,
    ListRequest,
    RenewRequest,
    SandboxInfo,
    SandboxSpec,
    SnapshotRequest,
    encoder,
    new_id,
)
from corral_common.contract.replies import (
    CreateBatchReply,
    DestroyReply,
    ExecReply,
    FileReadReply,
    FileWriteReply,
    InfoReply,
    RunReply,
    SandboxListReply,
    SandboxReply,
    SnapshotReply,
    decode_exec_frame,
)

from . import ports
from .ports import PortForward


class _ReplyMark(msgspec.Struct):
    """What tells a reply (it has `ok`) from the progress events streamed before it."""

    ok: bool | None = None


_reply_mark = msgspec.json.Decoder(_ReplyMark)

if TYPE_CHECKING:
    from .alerts import Alerts
    from .envs import Envs
    from .trajectory import Trajectories, Trajectory

# how long a request nobody answered is asked again when the bus is a NATS cluster: a service
# whose server failed reconnects to another within about a second (measured: tests/integration/
# test_cluster.py); on one server nobody answering means nobody is there
FAILOVER_GRACE_S = 3.0
# in a cluster, a request safe to repeat that has had no answer for this long is asked one more time
# (the first asking stays in flight; the first answer wins): a request routed to a service whose
# NATS server died in between is lost inside that server, and this client, on a live server,
# sees no reconnect that would tell it to ask again
HEDGE_AFTER_S = 15.0


class AsyncClient:
    def __init__(self, nc: NATS, own: bool):
        self.nc = nc
        self._own = own
        # resolved at the connection's next reconnect (own connections only: the callback is ours)
        self._reconnect: asyncio.Future[None] | None = None
        self._tracks_reconnects = False
        self.hedge_after_s = HEDGE_AFTER_S

    @classmethod
    async def connect(cls, url: str | None = None, nc: NATS | None = None, creds: str | None = None) -> AsyncClient:
        """Connect to `url` (default $CORRAL_NATS_URL, else the local stack) as the identity in
        `creds` (a credentials file; default $CORRAL_NATS_CREDS, else the local stack's)."""
        if nc is not None:
            return cls(nc, own=False)
        url = config.nats_url(url)
        made: list[AsyncClient] = []

        async def reconnected() -> None:
            for c in made:
                c._reconnected()

        try:
            conn = await nats.connect(auth.servers(url), name="corral-sdk", max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                      connect_timeout=5, allow_reconnect=True, reconnected_cb=reconnected,
                                      **auth.connect_options(url, creds))
        except Exception as e:
            raise Unavailable(f"cannot connect to NATS at {url}: {e}") from None
        client = cls(conn, own=True)
        client._tracks_reconnects = True
        made.append(client)
        return client

    def _reconnected(self) -> None:
        fut, self._reconnect = self._reconnect, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _next_reconnect(self) -> asyncio.Future[None]:
        if self._reconnect is None:
            self._reconnect = asyncio.get_running_loop().create_future()
        return self._reconnect

    async def _ask(self, subject: str, payload: bytes, timeout: float, resend: bool) -> Msg:
        """nc.request; with `resend` (a request that is safe to repeat: idempotent by its
        request_id, or a read), asked again whenever the connection comes back from a reconnect
        meanwhile (a reply sent while this client was between servers is lost for good, and
        waiting it out would cost the whole timeout), and also after HEDGE_AFTER_S without an
        answer: a request a queue-group member took just as it died (its server had not yet seen
        its connection close; on a cluster, its server went) is lost, and another member answers
        the repeat."""
        if not resend:
            return await self.nc.request(subject, payload, timeout=timeout)
        deadline = time.monotonic() + timeout
        hedge_at = time.monotonic() + self.hedge_after_s
        asks: list[asyncio.Future[Msg]] = []
        try:
            while True:
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    raise NatsTimeout
                if not asks or now >= hedge_at:
                    asks.append(asyncio.ensure_future(self.nc.request(subject, payload, timeout=left)))
                    if now >= hedge_at:
                        # once: a repeat waits in the service for the first asking's outcome
                        # (polling its record), so more of them would only multiply that work
                        hedge_at = float("inf")
                back = self._next_reconnect()
                waits: list[asyncio.Future[Any]] = [*asks, back]
                await asyncio.wait(waits, timeout=min(left, hedge_at - now), return_when=asyncio.FIRST_COMPLETED)
                for a in [a for a in asks if a.done()]:
                    asks.remove(a)
                    if a.exception() is None:
                        return a.result()
                    if not asks and not back.done():
                        raise a.exception()  # type: ignore[misc]  # the only asking failed: as nc.request would
                if back.done():
                    for a in asks:
                        a.cancel()
                    asks = []
        finally:
            for a in asks:
                a.cancel()

    def _clustered(self) -> bool:
        """Whether the server this client talks to is one of a NATS cluster (its INFO says so)."""
        info = getattr(self.nc, "_server_info", None) or {}
        return bool(info.get("cluster"))

    async def close(self) -> None:
        if self._own:
            await self.nc.drain()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, subject: str, body: msgspec.Struct | bytes, typ: type[R], timeout: float, sandbox_id: str | None = None,
                      resend: bool = False, settle: bool = False) -> R:
        """One request; its success reply decoded as `typ`, an error reply raised as its CorralError.
        `resend`: the request is safe to repeat (see _ask). `settle` (with `resend`): an
        `unavailable` answer with a retry hint (another attempt of the same request_id is still
        at work) is asked again after the hint while `timeout` lasts, its answer the last one's."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self._request_once(subject, body, typ, max(0.001, deadline - time.monotonic()), sandbox_id, resend)
            except Unavailable as e:
                if not (settle and resend) or not e.retry_after_s or time.monotonic() + e.retry_after_s >= deadline:
                    raise
                await asyncio.sleep(e.retry_after_s)

    async def _request_once(self, subject: str, body: msgspec.Struct | bytes, typ: type[R], timeout: float, sandbox_id: str | None,
                            resend: bool) -> R:
        payload = body if isinstance(body, bytes) else encoder.encode(body)
        pause = 0.05
        grace = time.monotonic() + (FAILOVER_GRACE_S if self._clustered() else 0.0)
        try:
            while True:
                try:
                    msg = await self._ask(subject, payload, timeout, resend)
                    break
                except NoRespondersError:
                    # nobody got it, so asking again runs nothing twice: in a cluster, the service may
                    # be moving to another server (its old one failed) and is back within a second
                    if time.monotonic() + pause > grace:
                        raise
                    await asyncio.sleep(pause)
                    pause *= 2
        except NoRespondersError:
            if sandbox_id:
                raise NotFound(f"no node owns sandbox {sandbox_id!r}: it was destroyed, expired, or never existed") from None
            raise Unavailable(f"nobody serves {subject}: is the corral stack running?") from None
        except NatsTimeout:
            raise Timeout(f"no reply on {subject} within {timeout:g}s") from None
        except MaxPayloadError:
            raise InvalidRequest(f"request of {len(payload)} bytes is larger than the bus allows "
                                 f"({self.nc.max_payload} bytes); split it (e.g. several files.write calls)") from None
        return decode_reply(msg.data, typ)

    # ---------------------------------------------------------------- sandboxes

    async def create(self, image: str = "busybox", substrate: str = "container", *, timeout: float = 60.0, **kw: Any) -> AsyncSandbox:
        spec = SandboxSpec(image=image, substrate=substrate, **kw)  # type: ignore[arg-type]
        r = await self.request(subjects.SANDBOX_CREATE, spec, SandboxReply, timeout, resend=bool(spec.request_id))
        return AsyncSandbox(self, r.sandbox)

    async def create_spec(self, spec: SandboxSpec, timeout: float = 60.0, wait_for_capacity_s: float = 0.0) -> AsyncSandbox:
        """Create from a full spec. `wait_for_capacity_s` > 0: a `capacity` answer (backpressure:
        every node full or running hot) is retried after its retry hint until that long has
        passed, instead of raised at once. Retries reuse one request_id, so none creates twice."""
        if wait_for_capacity_s > 0 and not spec.request_id:
            spec = msgspec.structs.replace(spec, request_id=new_id("req"))
        deadline = time.monotonic() + wait_for_capacity_s
        while True:
            try:
                r = await self.request(subjects.SANDBOX_CREATE, spec, SandboxReply, timeout, resend=bool(spec.request_id))
                break
            except (Capacity, Unavailable) as e:
                pause = min(max(e.retry_after_s or 1.0, 0.1), 5.0)
                if time.monotonic() + pause > deadline or (isinstance(e, Unavailable) and e.retry_after_s is None):
                    raise
                await asyncio.sleep(pause)
        return AsyncSandbox(self, r.sandbox)

    def trajectory(self, trajectory_id: str, image: str = "busybox", substrate: str = "container", *,
                   snapshot_every: int = 10, keepalive_s: float | None = None, **kw: Any) -> Trajectory:
        """A resumable rollout: `async with client.trajectory("id", image="debian") as t: await t.exec(...)`."""
        from .trajectory import Trajectory

        spec = SandboxSpec(image=image, substrate=substrate, **kw)  # type: ignore[arg-type]
        return Trajectory(self, trajectory_id, spec, snapshot_every=snapshot_every, keepalive_s=keepalive_s)

    @property
    def trajectories(self) -> Trajectories:
        from .trajectory import Trajectories

        return Trajectories(self)

    async def create_batch(self, count: int, image: str = "busybox", substrate: str = "container", *, timeout: float = 300.0,
                           progress: Callable[[BatchProgress], Any] | None = None, batch_id: str | None = None,
                           **kw: Any) -> list[AsyncSandbox]:
        """`count` sandboxes of one spec; items that could not be made are left out (see
        `create_batch_reply` for the per-item failures). `request_id=` makes it idempotent: a retry
        returns the same sandboxes and makes only what is missing. `progress(BatchProgress)` (plain
        or async function) is called on each progress event and on the final one (`done`)."""
        r = await self.create_batch_reply(count, image, substrate, timeout=timeout, progress=progress, batch_id=batch_id, **kw)
        return [AsyncSandbox(self, i) for i in r.sandboxes]

    async def create_batch_reply(self, count: int, image: str = "busybox", substrate: str = "container", *, timeout: float = 300.0,
                                 progress: Callable[[BatchProgress], Any] | None = None, batch_id: str | None = None,
                                 **kw: Any) -> CreateBatchReply:
        """create_batch, answering the whole reply: `.sandboxes`, `.failed` (BatchFailure: index, code,
        message), `.batch_id`, and `.truncated`, which counts sandboxes made but left out of a reply
        too large for the bus (list them by job or labels)."""
        spec = SandboxSpec(image=image, substrate=substrate, **kw)  # type: ignore[arg-type]
        if progress is None:
            req = CreateBatchRequest(spec=spec, count=count, batch_id=batch_id)
            return await self.request(subjects.SANDBOX_CREATE_BATCH, req, CreateBatchReply, timeout, resend=bool(spec.request_id),
                                      settle=True)
        # the events come on the request's own reply route (stream_progress), not from
        # corral.events, which a tenant may not subscribe to
        req = CreateBatchRequest(spec=spec, count=count, batch_id=batch_id, stream_progress=True)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(subjects.SANDBOX_CREATE_BATCH, encoder.encode(req), reply=inbox)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = await sub.next_msg(timeout=max(0.001, deadline - time.monotonic()))
                except NatsTimeout:
                    raise Timeout(f"no reply on {subjects.SANDBOX_CREATE_BATCH} within {timeout:g}s") from None
                if msg.headers and msg.headers.get("Status") == "503":
                    raise Unavailable(f"nobody serves {subjects.SANDBOX_CREATE_BATCH}: is the corral stack running?")
                try:
                    is_reply = _reply_mark.decode(msg.data).ok is not None
                except (msgspec.DecodeError, msgspec.ValidationError):
                    is_reply = True  # not an event: decode_reply says what is wrong with it
                if is_reply:  # the reply (success or error)
                    return decode_reply(msg.data, CreateBatchReply)
                try:
                    ev = msgspec.json.decode(msg.data, type=BatchProgress)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue  # not an event of this contract version: nothing to report
                out = progress(ev)
                if inspect.isawaitable(out):
                    await out
        finally:
            await sub.unsubscribe()

    async def run(self, cmd: str | list[str], *, image: str = "busybox", substrate: str = "function", stdin: str = "",
                  env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 60.0,
                  max_output_bytes: int = 1024 * 1024, timeout: float | None = None, **spec: Any) -> ExecResult:
        """Run one command in a fresh sandbox that is gone when this returns (`corral.v1.sandbox.run`).

        `substrate="function"` (default) is corral's lightest path; "container" and "docker" work
        too. `**spec` are SandboxSpec fields (cpu, memory_mb, disk_mb, pids_max, workdir, job,
        labels, ...); `env` is the command's environment. With `request_id=` the command runs at
        most once: a retry with the same id returns the first run's result (`replayed=True`)."""
        from corral_common.contract.messages import RunRequest, RunSpec

        req = RunRequest(spec=RunSpec(image=image, substrate=substrate, **spec),  # type: ignore[arg-type]
                         exec=ExecRequest(cmd=cmd, stdin=stdin, env=env or {}, cwd=cwd, timeout_s=timeout_s,
                                          max_output_bytes=max_output_bytes))
        r = await self.request(subjects.SANDBOX_RUN, req, RunReply, timeout or timeout_s + 45, resend=bool(req.spec.request_id))
        return r.result

    async def call(self, fn: Any, *args: Any, image: str = "debian", substrate: str = "function", timeout_s: float = 60.0,
                   spec: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a fresh sandbox with python3; returns its value or raises
        `RemoteError` with the remote traceback. The function's source and JSON arguments are sent:
        see corral_sdk.functions for the limits. `spec`: SandboxSpec fields (cpu, memory_mb, ...)."""
        from . import functions

        argv, stdin = functions.encode_call(fn, args, kwargs)
        r = await self.run(argv, image=image, substrate=substrate, stdin=stdin, timeout_s=timeout_s,
                           max_output_bytes=functions.MAX_OUTPUT, **(spec or {}))
        return functions.decode_result(r, fn)

    async def list(self, job: str | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        r = await self.request(subjects.SANDBOX_LIST, ListRequest(job=job, labels=labels), SandboxListReply, 10.0, resend=True)
        return r.sandboxes

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox (e.g. one created by another process)."""
        now = 0.0
        return AsyncSandbox(self, SandboxInfo(id=sandbox_id, node="", state="running", substrate="container", image="", created_at=now, expires_at=now))

    @property
    def envs(self) -> Envs:
        """Environments: `await client.envs.build(spec)`, `.rollout(name)`, `.grade(sandbox)`, `.list()`."""
        from .envs import Envs

        return Envs(self)

    @property
    def alerts(self) -> Alerts:
        """The monitor's alerts: `async with client.alerts.subscribe(job="j") as alerts: async for a in alerts: ...`."""
        from .alerts import Alerts

        return Alerts(self)


class AsyncFiles:
    def __init__(self, sb: AsyncSandbox):
        self._sb = sb

    async def read(self, path: str, max_bytes: int = 16 * 1024 * 1024) -> bytes:
        r = await self._sb._call("files.read", FileReadRequest(path=path, max_bytes=max_bytes), FileReadReply)
        return base64.b64decode(r.file.content_b64)

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def write(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        data = content.encode() if isinstance(content, str) else content
        await self._sb._call("files.write", FileWriteRequest(path=path, content_b64=base64.b64encode(data).decode(), mode=mode), FileWriteReply)


class AsyncSandbox:
    def __init__(self, client: AsyncClient, info: SandboxInfo):
        self.client = client
        self.info = info
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    @classmethod
    async def create(cls, image: str = "busybox", substrate: str = "container", *, nats_url: str | None = None, **kw: Any) -> AsyncSandbox:
        """Create a sandbox with its own connection (closed on destroy)."""
        client = await AsyncClient.connect(nats_url)
        try:
            sb = await client.create(image=image, substrate=substrate, **kw)
        except BaseException:
            await client.close()
            raise
        sb._owns_client = True
        return sb

    _owns_client = False

    async def _call(self, op: str, body: msgspec.Struct, typ: type[R], timeout: float = 30.0) -> R:
        return await self.client.request(subjects.sandbox_op(self.id, op), body, typ, timeout, sandbox_id=self.id)

    async def exec(self, cmd: str | list[str], *, stdin: str = "", env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float = 60.0, session: str = "", max_output_bytes: int = 1024 * 1024,
                   trajectory: str = "", step: int | None = None, on_divergence: str = "error", shell: str = "sh",
                   harness: bool = False) -> ExecResult:
        """`session="name"`: run in that persistent shell (cwd and exports carry over), started as
        `shell` ("sh" or "bash") on first use. `harness=True`: run as the harness's own uid, which
        the agent's processes cannot read, signal or forge (a grader's or trainer's commands)."""
        req = ExecRequest(cmd=cmd, stdin=stdin, env=env or {}, cwd=cwd, timeout_s=timeout_s, session=session, shell=shell,  # type: ignore[arg-type]
                          max_output_bytes=max_output_bytes, trajectory=trajectory, step=step, harness=harness,
                          on_divergence=on_divergence)  # type: ignore[arg-type]
        r = await self._call("exec", req, ExecReply, timeout=timeout_s + 15)
        return r.result

    async def exec_stream(self, cmd: str | list[str], *, timeout_s: float = 600.0, **kw: Any) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yield ExecChunk as output is produced, then the final ExecResult."""
        req = ExecRequest(cmd=cmd, timeout_s=timeout_s, stream=True, **kw)
        nc = self.client.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subjects.sandbox_op(self.id, "exec"), encoder.encode(req), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout_s + 15)
                except NatsTimeout:
                    raise Timeout(f"exec on {self.id} sent nothing for {timeout_s + 15:g}s") from None
                if msg.headers and msg.headers.get("Status") == "503":
                    raise NotFound(f"no node owns sandbox {self.id!r}")
                frame = decode_exec_frame(msg.data)
                if isinstance(frame, ExecChunk):
                    yield frame
                    continue
                yield frame.result
                return
        finally:
            await sub.unsubscribe()

    async def call(self, fn: Any, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` inside this sandbox (python3 needed); see corral_sdk.functions."""
        from . import functions

        argv, stdin = functions.encode_call(fn, args, kwargs)
        r = await self.exec(argv, stdin=stdin, timeout_s=timeout_s, max_output_bytes=functions.MAX_OUTPUT)
        return functions.decode_result(r, fn)

    async def forward(self, port: int, local_port: int = 0, host: str = "127.0.0.1") -> PortForward:
        """Listen on host:local_port (0: a free port, see `.local_port`); each connection reaches
        127.0.0.1:`port` inside the sandbox over the bus. `close()` it, or `async with` it."""
        return await PortForward(self, port, local_port, host).start()

    async def connect_port(self, port: int, timeout: float = 30.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """One TCP stream to 127.0.0.1:`port` inside the sandbox, over the bus."""
        return await ports.connect_port(self, port, timeout)

    async def refresh(self, timeout: float = 30.0) -> SandboxInfo:
        r = await self._call("info", Empty(), InfoReply, timeout=timeout)
        self.info = r.sandbox
        return self.info

    async def renew(self, ttl_s: float | None = None) -> SandboxInfo:
        """Extend the lease: the sandbox now expires ttl_s (default: its own ttl_s) from now."""
        r = await self._call("renew", RenewRequest(ttl_s=ttl_s or None), SandboxReply)
        self.info = r.sandbox
        return self.info

    async def snapshot(self, name: str = "", labels: dict[str, str] | None = None, *, memory: bool = False) -> str:
        """Snapshot the sandbox's filesystem as an image; returns the image name. `memory=True`:
        the whole running guest (microvm, vm): a create of the image with the same substrate and
        sizes resumes its processes where they were; other substrates answer invalid_request."""
        r = await self._call("snapshot", SnapshotRequest(name=name, labels=labels or {}, memory=memory), SnapshotReply, timeout=600)
        return r.image.name

    async def fork(self, *, timeout: float = 120.0, **kw: Any) -> AsyncSandbox:
        """A new sandbox on this one's node and image whose files start as a copy of this one's
        (frozen for the copy; its processes are not copied). `kw`: SandboxSpec fields for the
        fork (cpu, memory_mb, disk_mb, ttl_s, labels, ...); cpu and memory default to this one's,
        and its protections, environment and workdir are this one's with `kw`'s added."""
        if self.info.cpu > 0:
            kw.setdefault("cpu", self.info.cpu)
        if self.info.memory_mb > 0:
            kw.setdefault("memory_mb", self.info.memory_mb)
        spec = SandboxSpec(fork_of=self.id, **kw)  # the scheduler gives it the source's substrate and image
        return await self.client.create_spec(spec, timeout=timeout)

    async def changes(self, include: list[str] | None = None, exclude: list[str] | None = None, *,
                      max_archive_bytes: int = 4 * 1024 * 1024, max_entries: int = 50_000, timeout: float = 120.0) -> ChangesReply:
        """What the sandbox changed against its image, read by its node outside the sandbox (frozen
        meanwhile); the changed regular files and symlinks under `include` come as a gzip'd tar
        in `archive_b64`. Paths are absolute."""
        req = ChangesRequest(include=include or [], exclude=exclude or [], max_archive_bytes=max_archive_bytes, max_entries=max_entries)
        return await self._call("changes", req, ChangesReply, timeout)

    async def audit_state(self, timeout: float = 30.0) -> AuditState:
        """Have the node publish every audit event of this sandbox so far, and say up to which
        CORRAL_AUDIT stream sequence that is and what was lost."""
        return await self._call("audit", Empty(), AuditState, timeout)

    async def pause(self) -> None:
        await self._call("pause", Empty(), SandboxReply)

    async def resume(self) -> None:
        await self._call("resume", Empty(), SandboxReply)

    async def destroy(self) -> None:
        try:
            await self._call("destroy", Empty(), DestroyReply, timeout=60)
        finally:
            if self._owns_client:
                await self.client.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.destroy()
        except NotFound:
            pass
