"""The scheduler service: serves create, create_batch and list as a queue group, so several
replicas can run. Its state is in NATS KV: the node registry (from heartbeats), placements
(written by the owning node-agent) and request ids (for idempotent retries)."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.errors import Capacity, Code, Conflict, CorralError, InvalidRequest, NotFound, Unavailable, from_code
from corral_common.contract.messages import (
    CreateBatchRequest,
    ErrorBody,
    Heartbeat,
    JobQuota,
    ListRequest,
    NodeCreate,
    NodeCreateBatch,
    NodeItemResult,
    NodeRun,
    QuotaGetRequest,
    QuotaSetRequest,
    RunRequest,
    SandboxInfo,
    SandboxSpec,
    encoder,
    new_id,
    ok,
)
from corral_common.contract.replies import QuotaGetReply, QuotaReply, QuotaUsage

from . import batch, placement
from .quotas import KV_QUOTAS, JobTotals, Usage, check_fair_share, check_quota
from .registry import NodeState, Policy, Registry, Reservation
from .runs import BeforeRun, RunOnce

log = logging.getLogger("corral.scheduler")

PLACEMENTS = metrics.counter("corral_scheduler_placements_total", "Sandboxes placed", ("node",))
REJECTIONS = metrics.counter("corral_scheduler_rejections_total", "Create requests refused", ("code",))
BATCH_SECONDS = metrics.histogram("corral_scheduler_batch_seconds", "Time to place a create_batch")
NODES_ALIVE = metrics.gauge("corral_scheduler_nodes_alive", "Nodes with a recent heartbeat")
PLANNED_SUBSTRATES = {"microvm": "Firecracker microVMs", "vm": "QEMU VMs"}
QUOTA_SET = subjects.QUOTA_SET
QUOTA_GET = subjects.QUOTA_GET


ONE_SHOT_SUBSTRATES = {"function"}
RUN_SLACK_S = 30.0  # beyond the exec's own timeout: image set-up, runc, teardown of a timed-out call
LOST_MEMORY_S = 600.0  # how long a lost node's sandboxes are remembered (for orphan answers)


class _Reply(msgspec.Struct):
    ok: bool
    sandbox: SandboxInfo | None = None
    error: dict | None = None
    replied: bool = False  # the node answered the client itself (NodeCreate.reply_to)
    counted_at: float | None = None  # from then on (node clock) the node's heartbeats count it


def _node_error(r: _Reply) -> CorralError:
    """A node's error reply as the exception it stands for."""
    err = r.error or {}
    return from_code(err.get("code", "internal"), err.get("message", "node refused"), err.get("retry_after_s"))


class _BatchReply(msgspec.Struct):
    ok: bool
    results: list[NodeItemResult] | None = None
    error: ErrorBody | None = None
    counted_at: float | None = None  # from then on (node clock) the node's heartbeats count what it made


_batch_reply_decoder = msgspec.json.Decoder(_BatchReply)
_reply_decoder = msgspec.json.Decoder(_Reply)
_info_decoder = msgspec.json.Decoder(SandboxInfo)


class SchedulerConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    node_timeout_s: float = 30.0
    batch_parallelism: int = 64
    stale_after_s: float = 5.0
    cpu_overcommit: float = 8.0
    hot_cpu: float = 0.85
    memory_headroom: float = 0.05
    fair_share_below_free: float = 0.1


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.registry = Registry(cfg.stale_after_s)
        self.policy = Policy(cpu_overcommit=cfg.cpu_overcommit, hot_cpu=cfg.hot_cpu, memory_headroom=cfg.memory_headroom)
        self.placed: dict[str, SandboxInfo] = {}
        self.by_node: dict[str, set[str]] = {}  # node -> ids of its placements
        self.totals = JobTotals()
        self.quotas: dict[str, JobQuota] = {}
        self.kv_node_put: dict[str, float] = {}
        self.pending: dict[str, Usage] = {}
        self.tasks: set[asyncio.Task] = set()
        # sandboxes whose placements this replica deleted when their node was declared lost:
        # id -> (node, when); a call to one waits for the node to show up again before `not_found`
        self.lost_recent: dict[str, tuple[str, float]] = {}
        # creates this replica is placing (set when the node's answer is recorded): the node may
        # have answered the client directly, whose next call must not be answered `not_found`
        self.placing: dict[str, asyncio.Event] = {}

    async def run(self, stop: asyncio.Event) -> None:
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.nc = await bus.connect(self.cfg.nats_url, name="corral-scheduler")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.kv_nodes = await bus.ensure_kv(self.js, subjects.KV_NODES)
        self.kv_placements = await bus.ensure_kv(self.js, subjects.KV_PLACEMENTS)
        self.kv_requests = await bus.ensure_kv(self.js, subjects.KV_REQUESTS, ttl=24 * 3600)
        self.run_once = RunOnce(self.kv_requests)
        self.kv_quotas = await bus.ensure_kv(self.js, KV_QUOTAS)
        self.quota_watcher = await self.kv_quotas.watchall()
        self._spawn(self._watch_quotas())
        await self._load_nodes()
        self.watcher = await self.kv_placements.watchall()
        self._spawn(self._watch_placements())
        await self.nc.subscribe(subjects.NODE_HEARTBEAT, cb=self._on_heartbeat)
        self._spawn(self._lost_node_loop())
        self.responder = bus.Responder(self.nc, "scheduler", package="corral_scheduler")
        self.scatter = await bus.Scatter(self.nc).start()
        q = subjects.SCHEDULER_QUEUE
        await self.responder.serve(subjects.SANDBOX_CREATE, self._on_create, "create", queue=q)
        await self.responder.serve(subjects.SANDBOX_CREATE_BATCH, self._on_create_batch, "create_batch", queue=q)
        await self.responder.serve(subjects.SANDBOX_LIST, self._on_list, "list", queue=q)
        await self.responder.serve(QUOTA_SET, self._on_quota_set, "quota.set", queue=q)
        await self.responder.serve(QUOTA_GET, self._on_quota_get, "quota.get", queue=q)
        await self.responder.serve(subjects.SANDBOX_RUN, self._on_run, "run", queue=q)
        # answers `not_found` for sandboxes no node owns, so raw NATS clients get a JSON reply
        # instead of a bare "no responders" status
        for pattern in (f"{subjects.PREFIX}.sandbox.*.*", f"{subjects.PREFIX}.sandbox.*.files.*"):
            await self.nc.subscribe(pattern, queue=q + "-orphans", cb=self._on_orphan)
        metrics.UP.labels("scheduler").set(1)
        logs.kv(log, logging.INFO, "scheduler ready", metrics=self.metrics_url)
        await stop.wait()
        await self.responder.drain()
        for t in list(self.tasks):
            t.cancel()
        try:
            await self.watcher.stop()
        except Exception:  # shutting down: a watcher that fails to stop is dropped with the connection
            pass
        await self.nc.drain()
        logs.kv(log, logging.INFO, "scheduler stopped")

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------------ registry

    async def _load_nodes(self) -> None:
        try:
            keys = await self.kv_nodes.keys()
        except Exception:
            return
        for k in keys:
            try:
                e = await self.kv_nodes.get(k)
                hb = msgspec.json.decode(e.value, type=Heartbeat)
            except Exception:
                continue
            if time.time() - hb.ts < self.cfg.stale_after_s:
                self.registry.heartbeat(hb)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = msgspec.json.decode(msg.data, type=Heartbeat)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("malformed heartbeat ignored")
            return
        self.registry.heartbeat(hb)
        NODES_ALIVE.set(len(self.registry.alive()))
        # the registry in KV is for replicas and operators, not the hot path: refresh it every few
        # seconds per node rather than on every heartbeat (a thousand nodes beat every second)
        now = time.monotonic()
        if now - self.kv_node_put.get(hb.node, 0.0) >= 5.0 or hb.stopping:
            self.kv_node_put[hb.node] = now
            try:  # a plain publish into the bucket's stream: waiting for each ack here would queue
                # the heartbeats behind KV round trips until nodes looked stale (and were declared lost)
                await self.nc.publish(subjects.kv_key(subjects.KV_NODES, hb.node), msg.data)
            except Exception:  # the node heartbeats again in 50 ms, and that publish writes the entry
                pass

    async def _lost_node_loop(self) -> None:
        """A node that stops heartbeating is lost: its sandboxes are reported lost and dropped from
        the placements, so calls to them get `not_found` and new work goes elsewhere.

        `corral.events.node.<node>.lost` goes out only after the placements are deleted: a node
        that was alive all along (paused, overloaded, its agent restarting) hears it and writes
        its live sandboxes' placements back, and no delete of ours can land after that."""
        lost: set[str] = set()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for sid in [s for s, (_, t) in self.lost_recent.items() if now - t > LOST_MEMORY_S]:
                del self.lost_recent[sid]
            alive = {s.hb.node for s in self.registry.alive()}
            for node, st in list(self.registry.nodes.items()):
                if node in alive:
                    lost.discard(node)
                    continue
                if node in lost or st.hb.stopping:
                    continue
                lost.add(node)
                # by the per-node index: scanning 380,000 placements per lost node stalls the loop
                victims = [self.placed[sid] for sid in list(self.by_node.get(node, ())) if sid in self.placed]
                logs.kv(log, logging.WARNING, "node lost", node=node, sandboxes=len(victims))
                for info in victims:
                    self.lost_recent[info.id] = (node, now)
                    await self.nc.publish(subjects.event(info.id, "lost"), encoder.encode(
                        {"kind": "lost", "ts": time.time(), "sandbox_id": info.id, "node": node, "job": info.job,
                         "reason": f"node {node} stopped heartbeating"}))
                    try:
                        await self.kv_placements.delete(info.id)
                    except Exception as e:
                        logs.kv(log, logging.WARNING, "placement not deleted", sandbox=info.id, error=repr(e))
                await self.nc.publish(subjects.node_event(node, "lost"), encoder.encode({"node": node, "sandboxes": [v.id for v in victims]}))

    async def _watch_quotas(self) -> None:
        async for e in self.quota_watcher:
            if e is None:
                continue
            if e.operation in ("DEL", "PURGE") or not e.value:
                self.quotas.pop(e.key, None)
                continue
            try:
                self.quotas[e.key] = msgspec.json.decode(e.value, type=JobQuota)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("malformed quota ignored", extra={"fields": {"job": e.key}})

    def _quota(self, job: str) -> JobQuota | None:
        return self.quotas.get(job) or self.quotas.get("_default")

    async def _on_quota_set(self, msg: Msg) -> QuotaReply:
        r = bus.decode(msg.data, QuotaSetRequest)
        key = r.job or "_default"
        if not key.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise InvalidRequest(f"job {r.job!r} cannot hold a quota: use letters, digits, '-', '_' and '.'")
        for name, v in (("sandboxes", r.sandboxes), ("cpu", r.cpu), ("memory_mb", r.memory_mb)):
            if v is not None and v < 0:
                raise InvalidRequest(f"quota {name} must not be negative")
        q = JobQuota(sandboxes=r.sandboxes, cpu=r.cpu, memory_mb=r.memory_mb)
        await self.kv_quotas.put(key, msgspec.json.encode(q))
        self.quotas[key] = q
        return QuotaReply(job=key, quota=q)

    async def _on_quota_get(self, msg: Msg) -> QuotaGetReply:
        r = bus.decode(msg.data, QuotaGetRequest)
        q = self._quota(r.job)
        used = self.totals.of(r.job, self.pending)
        if r.job != "_default" and r.job not in self.quotas and used.sandboxes <= 0:
            default = self.quotas.get("_default")
            raise NotFound(f"job {r.job!r} is unknown: it holds no sandboxes and has no quota of its own"
                           + (f" (the _default quota applies to it: {msgspec.json.encode(default).decode()})" if default
                              else "; no _default quota is set either") + f"; set one with {QUOTA_SET}")
        return QuotaGetReply(job=r.job, quota=q, used=QuotaUsage(sandboxes=used.sandboxes, cpu=used.cpu, memory_mb=used.memory_mb))

    def _admit(self, spec: SandboxSpec, count: int) -> None:
        """Quota and fair-share checks, then count the request as pending for its job."""
        check_quota(spec.job, self._quota(spec.job), self.totals.of(spec.job, self.pending), spec, count)
        alive = [s for s in self.registry.alive() if spec.substrate in s.hb.substrates]
        total = sum(s.hb.capacity.memory_mb for s in alive)
        free = sum(max(0, s.free(self.policy)[1]) for s in alive)
        check_fair_share(spec.job, self.totals, total, free, spec, self.cfg.fair_share_below_free)
        p = self.pending.setdefault(spec.job, Usage())
        p.sandboxes += count
        p.cpu += spec.cpu * count
        p.memory_mb += spec.memory_mb * count

    def _settle(self, spec: SandboxSpec, count: int = 1) -> None:
        p = self.pending.get(spec.job)
        if p is None:
            return
        p.sandboxes -= count
        p.cpu -= spec.cpu * count
        p.memory_mb -= spec.memory_mb * count
        if p.sandboxes <= 0:
            self.pending.pop(spec.job, None)

    def _set_placed(self, info: SandboxInfo) -> None:
        if self.lost_recent:
            self.lost_recent.pop(info.id, None)
        old = self.placed.get(info.id)
        self.placed[info.id] = info
        if old is not None:
            if old.node != info.node:
                self._by_node_discard(old)
                self.by_node.setdefault(info.node, set()).add(info.id)
            if old.job == info.job and old.cpu == info.cpu and old.memory_mb == info.memory_mb:
                return  # the same sandbox seen again (reply, then the KV watch): totals unchanged
            self.totals.add(old, -1)
        else:
            self.by_node.setdefault(info.node, set()).add(info.id)
        self.totals.add(info)

    def _unplace(self, sid: str) -> None:
        old = self.placed.pop(sid, None)
        if old is not None:
            self.totals.add(old, -1)
            self._by_node_discard(old)

    def _by_node_discard(self, info: SandboxInfo) -> None:
        ids = self.by_node.get(info.node)
        if ids is not None:
            ids.discard(info.id)
            if not ids:
                del self.by_node[info.node]

    async def _watch_placements(self) -> None:
        async for e in self.watcher:
            if e is None:  # end of the initial values
                continue
            if e.operation in ("DEL", "PURGE") or not e.value:
                self._unplace(e.key)
                continue
            try:
                self._set_placed(_info_decoder.decode(e.value))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue

    # ------------------------------------------------------------------ create

    async def _on_create(self, msg: Msg) -> bytes | None:
        """`corral.v1.sandbox.create`. The node is asked to answer the client directly (one hop
        less on a create's path: client -> scheduler -> node -> client); if it did, this replica
        only records the placement, otherwise it relays the node's answer."""
        spec = bus.decode(msg.data, SandboxSpec)
        box: list[bool] = []
        info = await self.create(spec, reply_to=msg.reply or "", replied=box)
        return None if box else ok(sandbox=info)

    def _check_substrate(self, spec: SandboxSpec, one_shot: bool = False) -> None:
        if spec.substrate in ONE_SHOT_SUBSTRATES and not one_shot:
            raise InvalidRequest(f"substrate {spec.substrate!r} is one-shot: send {{\"spec\", \"exec\"}} to {subjects.SANDBOX_RUN} "
                                 f"(SDK client.run / client.call); for a sandbox that stays use 'container' or 'docker'")
        if spec.substrate in PLANNED_SUBSTRATES:
            raise InvalidRequest(f"substrate {spec.substrate!r} ({PLANNED_SUBSTRATES[spec.substrate]}) is planned but not available yet; "
                                 f"available: {', '.join(sorted(self.registry.substrates())) or 'none'}")
        have = self.registry.substrates()
        if have and spec.substrate not in have:
            raise InvalidRequest(f"no node offers substrate {spec.substrate!r}; available: {', '.join(sorted(have))}")

    async def create(self, spec: SandboxSpec, admitted: bool = False, reply_to: str = "", replied: list | None = None) -> SandboxInfo:
        """Place one sandbox. With `reply_to`, the node that makes it may answer there itself; it
        did if `replied` (a list) comes back holding True."""
        self._check_substrate(spec)
        if not admitted:
            self._admit(spec, 1)
        try:
            return await self._create(spec, reply_to, replied)
        finally:
            if not admitted:
                self._settle(spec)

    async def _create(self, spec: SandboxSpec, reply_to: str = "", replied: list | None = None) -> SandboxInfo:
        if not spec.request_id:
            return await self._place(new_id(), spec, reply_to, replied)
        key = "r" + hashlib.sha256(spec.request_id.encode()).hexdigest()[:40]
        sid = new_id()
        try:
            await self.kv_requests.create(key, sid.encode())
        except KeyWrongLastSequenceError:
            return await self._existing(key, spec.request_id)
        except Exception as e:
            if "wrong last sequence" in str(e).lower() or "key exists" in str(e).lower():
                return await self._existing(key, spec.request_id)
            raise
        try:
            return await self._place(sid, spec, reply_to, replied)
        except BaseException:
            try:
                await self.kv_requests.delete(key)  # let a retry try again
            except Exception as e:
                logs.kv(log, logging.WARNING, "request entry not deleted: a retry waits for it to expire", request=key, error=repr(e))
            raise

    async def _existing(self, key: str, request_id: str) -> SandboxInfo:
        """A retry of a request already seen: answer with the sandbox it made (or is making)."""
        deadline = time.monotonic() + self.cfg.node_timeout_s + 5
        while time.monotonic() < deadline:
            try:
                e = await self.kv_requests.get(key)
            except KeyNotFoundError:
                e = None
            if e is None or not e.value:
                raise Unavailable(f"an earlier attempt with request_id {request_id!r} failed; retry", retry_after_s=0.1)
            sid = e.value.decode()
            info = self.placed.get(sid)
            if info is None:
                try:
                    pe = await self.kv_placements.get(sid)
                    info = msgspec.json.decode(pe.value, type=SandboxInfo) if pe and pe.value else None
                except KeyNotFoundError:
                    info = None
            if info is not None:
                return info
            await asyncio.sleep(0.02)
        raise CorralError(f"request_id {request_id!r} is still being placed by another attempt", Code.TIMEOUT)

    async def _place(self, sid: str, spec: SandboxSpec, reply_to: str = "", replied: list | None = None) -> SandboxInfo:
        done = self.placing[sid] = asyncio.Event()
        try:
            return await self._place_on_a_node(sid, spec, reply_to, replied)
        finally:
            self.placing.pop(sid, None)
            done.set()

    async def _place_on_a_node(self, sid: str, spec: SandboxSpec, reply_to: str, replied: list | None) -> SandboxInfo:
        alive = self.registry.alive()
        tried: list[str] = []
        last: CorralError | None = None
        timed_out = False
        for st, res in self._attempts(alive, spec, tried):
            try:
                r = await self._ask_node(st.hb.node, sid, spec, reply_to, replied)
            except CorralError as e:
                st.reservations.remove(res)
                if e.code == Code.CONFLICT and (held := await self._held_elsewhere(sid, st.hb.node)) is not None:
                    return held
                if e.code in (Code.CAPACITY, Code.UNAVAILABLE, Code.TIMEOUT):
                    timed_out = timed_out or e.code == Code.TIMEOUT
                    last = e
                    continue
                REJECTIONS.labels(e.code.value).inc()
                raise
            except BaseException:
                st.reservations.remove(res)
                raise
            info = r.sandbox
            assert info is not None
            st.settle(res, r.counted_at if r.counted_at is not None else info.created_at)
            PLACEMENTS.labels(st.hb.node).inc()
            self._set_placed(info)
            return info
        if timed_out and (held := await self._held_elsewhere(sid, "")) is not None:
            return held  # a node that did not answer in time made it meanwhile
        raise self._no_room("a sandbox", spec, alive, tried, last, retry_after_s=1.0)

    async def _held_elsewhere(self, sid: str, refused_by: str) -> SandboxInfo | None:
        """The sandbox `sid` as placed by a node other than `refused_by`, if one holds it: a node
        this create was sent to earlier did not answer in time, and made it after all. Nodes claim
        a create's placement key (compare-and-set) before they answer, so the one that did is the
        only one holding it; the others undo theirs and answer `conflict`."""
        info = await self._placement(sid)
        if info is None or info.node == refused_by or info.state not in ("running", "paused"):
            return None
        self._set_placed(info)
        PLACEMENTS.labels(info.node).inc()
        return info

    def _attempts(self, alive: list, spec: SandboxSpec, tried: list[str]):
        """The (up to three) best candidate nodes for spec, one at a time, each with a reservation
        held for the attempt (the caller removes it, or keeps it once placed) and named in tried."""
        for st in placement.candidates(alive, spec, self.policy)[:3]:
            res = Reservation(cpu=spec.cpu, memory_mb=spec.memory_mb)
            st.reservations.append(res)
            tried.append(st.hb.node)
            yield st, res

    def _no_room(self, what: str, spec: SandboxSpec, alive: list, tried: list[str], last: CorralError | None,
                 retry_after_s: float) -> Capacity:
        """The `capacity` answer when no candidate node took the request: what was asked, the room
        there is, and what the nodes tried said."""
        REJECTIONS.labels("capacity").inc()
        detail = f"; tried {', '.join(tried)}: {last.message}" if last else ""
        return Capacity(f"no node has room for {what} with cpu={spec.cpu:g}, memory_mb={spec.memory_mb}, substrate={spec.substrate} "
                        f"({placement.describe_room(alive, self.policy)}){detail}", retry_after_s=retry_after_s)

    async def _ask_node(self, node: str, sid: str, spec: SandboxSpec, reply_to: str = "", replied: list | None = None) -> _Reply:
        """The node's success reply to a create (its `sandbox` set), or its error raised."""
        data = encoder.encode(NodeCreate(sandbox_id=sid, spec=spec, reply_to=reply_to))
        try:
            resp = await self.nc.request(subjects.node_create(node), data, timeout=self.cfg.node_timeout_s)
        except NoRespondersError:
            raise Unavailable(f"node {node} is not answering") from None
        except NatsTimeout:
            raise CorralError(f"node {node} did not answer within {self.cfg.node_timeout_s:g}s", Code.TIMEOUT) from None
        r = _reply_decoder.decode(resp.data)
        if not r.ok or r.sandbox is None:
            raise _node_error(r)
        if r.replied and replied is not None:
            replied.append(True)
        return r

    async def _on_run(self, msg: Msg) -> bytes:
        """`corral.v1.sandbox.run`: place a one-shot call on a node offering its substrate (spread,
        like create; the next candidate on `capacity`/`unavailable`) and relay the node's answer
        `{"ok", "result", "sandbox_id", "node"}`. No sandbox is recorded: it is gone when the reply
        arrives. With `spec.request_id` the call runs at most once (runs.py): a retry gets the
        first attempt's reply, marked `replayed`."""
        req = bus.decode(msg.data, RunRequest)
        spec = req.spec.to_spec()
        self._check_substrate(spec, one_shot=True)
        if isinstance(req.exec.cmd, str) and not req.exec.cmd.strip():
            raise InvalidRequest("exec.cmd is empty")
        if req.exec.stream or req.exec.session or req.exec.trajectory:
            raise InvalidRequest("a one-shot run answers with one message and keeps nothing: exec.stream, exec.session "
                                 "and exec.trajectory need a sandbox (create one, then exec)")
        if not spec.request_id:
            try:
                return await self._run(spec, req)
            except BeforeRun as e:
                raise e.err from None
        return await self.run_once.run(spec.request_id, req, req.exec.timeout_s + RUN_SLACK_S,
                                       lambda: self._run(spec, req))

    async def _run(self, spec: SandboxSpec, req: RunRequest) -> bytes:
        """The node's reply to the run; BeforeRun for errors that leave nothing to keep (no room,
        a node's error reply), a plain `timeout` when a node took the call and never answered."""
        alive = self.registry.alive()
        data = encoder.encode(NodeRun(spec=spec, exec=req.exec))
        tried: list[str] = []
        last: CorralError | None = None
        for st, res in self._attempts(alive, spec, tried):
            try:
                resp = await self.nc.request(subjects.node_run(st.hb.node), data, timeout=req.exec.timeout_s + RUN_SLACK_S)
            except NoRespondersError:
                last = Unavailable(f"node {st.hb.node} is not answering")
                continue
            except NatsTimeout:
                raise CorralError(f"node {st.hb.node} did not answer the run within {req.exec.timeout_s + RUN_SLACK_S:g}s",
                                  Code.TIMEOUT) from None
            finally:
                st.reservations.remove(res)
            if resp.data.startswith(b'{"ok":true'):
                PLACEMENTS.labels(st.hb.node).inc()
                return resp.data
            e = _node_error(msgspec.json.decode(resp.data, type=_Reply))
            if e.code in (Code.CAPACITY, Code.UNAVAILABLE):
                last = e
                continue
            REJECTIONS.labels(e.code.value).inc()
            raise BeforeRun(e)
        raise BeforeRun(self._no_room("a run", spec, alive, tried, last, retry_after_s=0.5))

    async def _on_create_batch(self, msg: Msg) -> bytes:
        """`corral.v1.sandbox.create_batch`: plan the batch, one request per node (see batch.py),
        partial success per item, progress events, idempotent with `spec.request_id`."""
        req = bus.decode(msg.data, CreateBatchRequest)
        spec = req.spec
        self._check_substrate(spec)
        rid = spec.request_id
        batch_id = req.batch_id or (batch.default_batch_id(rid) if rid else new_id("batch"))
        ids = [batch.item_id(rid, i) for i in range(req.count)] if rid else [new_id() for _ in range(req.count)]
        results: list[SandboxInfo | CorralError | None] = [None] * req.count
        digest = batch.spec_digest(spec) if rid else ""
        record = await self._batch_record(rid) if rid else None
        if record is not None:
            self._check_same_batch(rid, record, req.count, digest, spec)
            if not record.done:
                record = None  # an attempt that did not finish (its replica died) or is still running
        failed_before = set(record.failed) if record is not None else set()
        todo: list[tuple[int, str]] = []
        for i, sid in enumerate(ids):
            info = self.placed.get(sid)
            if info is not None:
                results[i] = info
            elif record is not None and i not in failed_before:
                results[i] = await self._gone_or_placed(sid, i)
            else:
                todo.append((i, sid))
        if todo:
            self._check_batch_room(spec, len(todo))
            if rid and record is None:
                await self._start_record(rid, req.count, digest, spec)
            self._admit(spec, len(todo))
        progress = batch.Progress(self.nc, batch_id, req.count, job=spec.job, request_id=rid)
        progress.placed = sum(1 for r in results if isinstance(r, SandboxInfo))
        progress.failed = sum(1 for r in results if isinstance(r, CorralError))
        progress.start()
        t0 = time.perf_counter()
        try:
            if todo:
                await self._place_batch(spec, todo, results, progress)
        finally:
            await progress.done()
        BATCH_SECONDS.observe(time.perf_counter() - t0)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [{"index": i, "code": r.code.value, "message": r.message} for i, r in enumerate(results) if isinstance(r, CorralError)]
        if rid:
            try:
                await self.kv_requests.put(batch.record_key(rid), msgspec.json.encode(
                    batch.BatchRecord(count=req.count, failed=[f["index"] for f in failed], digest=digest)))
            except Exception:
                log.warning("batch record not written", extra={"fields": {"batch_id": batch_id}})
        logs.kv(log, logging.INFO, "batch placed", batch_id=batch_id, count=req.count, placed=len(made), failed=len(failed),
                seconds=round(time.perf_counter() - t0, 3))
        if not made:
            first = failed[0]
            raise from_code(first["code"], f"none of the {req.count} sandboxes could be created: {first['message']}")
        return batch.reply(batch_id, made, failed, limit=max(64 * 1024, (self.nc.max_payload or 1 << 20) - 1024))

    @staticmethod
    def _check_same_batch(rid: str, record: batch.BatchRecord, count: int, digest: str, spec: SandboxSpec) -> None:
        """A request_id names one batch: the same count and spec on every retry."""
        if record.count != count:
            raise Conflict(f"request_id {rid!r} was used for a batch of {record.count}, not {count}: "
                           f"use a new request_id for a different batch")
        if record.digest and record.digest != digest:
            raise Conflict(f"request_id {rid!r} was used for a batch of {record.count} with a different spec "
                           f"(this one: {batch.describe(spec)}): a retry must send the same spec; "
                           f"use a new request_id for a different batch")

    async def _start_record(self, rid: str, count: int, digest: str, spec: SandboxSpec) -> None:
        """Note the batch's count and spec digest before anything is made, so that a concurrent
        attempt, or a retry after this replica died, with another spec is refused too."""
        try:
            await self.kv_requests.create(batch.record_key(rid), msgspec.json.encode(
                batch.BatchRecord(count=count, digest=digest, done=False)))
            return
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:
            if "wrong last sequence" not in str(e).lower() and "key exists" not in str(e).lower():
                log.warning("batch record not written", extra={"fields": {"request_id": rid, "error": str(e)}})
                return
        other = await self._batch_record(rid)  # another attempt wrote one first
        if other is not None:
            self._check_same_batch(rid, other, count, digest, spec)

    async def _batch_record(self, rid: str) -> batch.BatchRecord | None:
        try:
            e = await self.kv_requests.get(batch.record_key(rid))
        except KeyNotFoundError:
            return None
        if e is None or not e.value:
            return None
        try:
            return msgspec.json.decode(e.value, type=batch.BatchRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _gone_or_placed(self, sid: str, index: int) -> SandboxInfo | CorralError:
        """An item an earlier attempt made that this replica does not see placed (yet)."""
        info = await self._placement(sid)
        if info is not None:
            return info
        return NotFound(f"item {index} (sandbox {sid}) was made by an earlier attempt of this batch and is gone "
                        f"(destroyed, expired or its node lost); it is not made again")

    async def _placement(self, sid: str) -> SandboxInfo | None:
        info = self.placed.get(sid)
        if info is not None:
            return info
        try:
            e = await self.kv_placements.get(sid)
        except KeyNotFoundError:
            return None
        except Exception:
            return None
        if e is None or not e.value:
            return None
        try:
            return _info_decoder.decode(e.value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _check_batch_room(self, spec: SandboxSpec, count: int) -> None:
        alive = self.registry.alive()
        usable = [s for s in alive if spec.substrate in s.hb.substrates and not s.hot(self.policy)]
        free = [s.free(self.policy) for s in usable]
        free_cpu = sum(max(0.0, f[0]) for f in free)
        free_mem = sum(max(0, f[1]) for f in free)
        free_n = sum(max(0, f[2]) for f in free)
        if spec.cpu * count > free_cpu + 1e-9 or spec.memory_mb * count > free_mem or count > free_n:
            REJECTIONS.labels("capacity").inc()
            raise Capacity(
                f"a batch of {count} x (cpu={spec.cpu:g}, memory_mb={spec.memory_mb}) does not fit: "
                f"free {free_cpu:g} cpu, {free_mem} MiB, {free_n} slots across {len(alive)} node(s)", retry_after_s=5.0,
            )

    async def _place_batch(self, spec: SandboxSpec, todo: list[tuple[int, str]], results: list, progress: batch.Progress) -> None:
        """Plan `todo` over the live nodes, send each node its share in one request, plan what
        nodes refused again elsewhere (up to three rounds). Each item ends as a SandboxInfo or an
        error in `results`; the job's pending admission is settled item by item."""
        refused: set[str] = set()
        last: dict[int, CorralError] = {}
        pending = todo

        async def resolve(i: int, value: SandboxInfo | CorralError) -> None:
            results[i] = value
            self._settle(spec)

        try:
            for _round in range(3):
                if not pending:
                    break
                alive = [s for s in self.registry.alive() if s.hb.node not in refused]
                assignment = batch.plan(alive, spec, len(pending), self.policy)
                groups: list[tuple[NodeState, list[tuple[int, str]]]] = []
                pos = 0
                for st, k in assignment:
                    for j in range(pos, pos + k, batch.NODE_BATCH_MAX):
                        groups.append((st, pending[j:min(pos + k, j + batch.NODE_BATCH_MAX)]))
                    pos += k
                overflow = pending[pos:]
                if overflow:
                    err = Capacity(f"no node has room for more sandboxes with cpu={spec.cpu:g}, memory_mb={spec.memory_mb}, "
                                   f"substrate={spec.substrate} ({placement.describe_room(self.registry.alive(), self.policy)})",
                                   retry_after_s=1.0)
                    for i, _ in overflow:
                        await resolve(i, last.get(i, err))
                    await progress.add(failed=len(overflow))
                retry: list[tuple[int, str]] = []
                reqs, sent = [], []
                for st, chunk in groups:
                    k = len(chunk)
                    res = Reservation(cpu=spec.cpu * k, memory_mb=spec.memory_mb * k, n=k)
                    st.reservations.append(res)
                    rid = spec.request_id
                    items = [NodeCreate(sandbox_id=sid, spec=msgspec.structs.replace(spec, request_id=f"{rid}#{i}") if rid else spec)
                             for i, sid in chunk]
                    reqs.append((subjects.node_create_batch(st.hb.node), encoder.encode(NodeCreateBatch(items=items)), None))
                    sent.append((st, chunk, res))
                timeout = self.cfg.node_timeout_s + 0.25 * max((len(c) for _, c in groups), default=0)
                async for j, msg in self.scatter.requests(reqs, timeout):
                    st, chunk, res = sent[j]
                    await self._node_reply(st, spec, chunk, res, msg, timeout, resolve, retry, refused, last, progress)
                pending = retry
            for i, _ in pending:
                await resolve(i, last.get(i) or Capacity("no node took this item after three rounds", retry_after_s=1.0))
            if pending:
                await progress.add(failed=len(pending))
        finally:
            for i, _ in todo:  # cancelled: release what is still counted as pending
                if results[i] is None:
                    self._settle(spec)

    async def _node_reply(self, st: NodeState, spec: SandboxSpec, chunk: list[tuple[int, str]], res: Reservation, msg: Msg | None,
                          timeout: float, resolve, retry: list, refused: set[str], last: dict[int, CorralError],
                          progress: batch.Progress) -> None:
        """One node's answer to its share of a batch: record what it made, plan again what it
        refused for room (`capacity`, `unavailable`, or `conflict` for an item held elsewhere that
        is not visible yet), fail the rest."""
        node, k = st.hb.node, len(chunk)
        whole: CorralError | None = None
        reply: _BatchReply | None = None
        if msg is None:
            # the node may still make them: with a request_id a retry of the batch finds them
            whole = CorralError(f"node {node} did not answer within {timeout:g}s", Code.TIMEOUT)
        elif bus.no_responders(msg):
            whole = Unavailable(f"node {node} is not answering")
        else:
            try:
                reply = _batch_reply_decoder.decode(msg.data)
                if not reply.ok or reply.results is None or len(reply.results) != k:
                    err = reply.error or ErrorBody(code="internal", message=f"node {node} answered a batch of {k} with "
                                                                             f"{len(reply.results or [])} results")
                    whole = from_code(err.code, err.message, err.retry_after_s)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                whole = CorralError(f"node {node} sent a malformed batch reply: {e}", Code.INTERNAL)
        made = failed = 0
        if whole is not None:
            st.reservations.remove(res)
            if whole.code in (Code.CAPACITY, Code.UNAVAILABLE):
                refused.add(node)
                for i, sid in chunk:
                    last[i] = whole
                retry.extend(chunk)
                return
            REJECTIONS.labels(whole.code.value).inc()
            for i, _ in chunk:
                await resolve(i, whole)
            await progress.add(failed=k)
            return
        assert reply is not None and reply.results is not None
        for (i, sid), r in zip(chunk, reply.results):
            if r.ok and r.sandbox is not None:
                self._set_placed(r.sandbox)
                await resolve(i, r.sandbox)
                made += 1
                continue
            e = r.error or ErrorBody(code="internal", message="node gave no reason")
            err = from_code(e.code, e.message, e.retry_after_s)
            if err.code == Code.CONFLICT:  # another attempt of this batch made it elsewhere
                info = await self._placement(sid)
                if info is not None:
                    await resolve(i, info)
                    made += 1
                    continue
            if err.code in (Code.CAPACITY, Code.UNAVAILABLE, Code.CONFLICT):
                if err.code == Code.CAPACITY:
                    refused.add(node)
                last[i] = err
                retry.append((i, sid))
                continue
            REJECTIONS.labels(err.code.value).inc()
            await resolve(i, err)
            failed += 1
        res.n, res.cpu, res.memory_mb = made, spec.cpu * made, spec.memory_mb * made
        st.settle(res, reply.counted_at if reply.counted_at is not None else time.time())
        if made:
            PLACEMENTS.labels(node).inc(made)
        await progress.add(placed=made, failed=failed)

    # ------------------------------------------------------------------ list / orphans

    async def _on_list(self, msg: Msg) -> bytes:
        req = bus.decode(msg.data, ListRequest)
        out = []
        for info in self.placed.values():
            if req.job is not None and info.job != req.job:
                continue
            if req.node is not None and info.node != req.node:
                continue
            if req.labels and any(info.labels.get(k) != v for k, v in req.labels.items()):
                continue
            out.append(info)
        out.sort(key=lambda i: i.created_at)
        return ok(sandboxes=out)

    async def _on_orphan(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        sid = parts[3]
        if not msg.reply:
            return
        info = self.placed.get(sid)
        if info is None and sid in self.placing:
            # being placed by this replica: its node may have answered the client directly
            # before its answer to us was read; decide once it is recorded
            try:
                await asyncio.wait_for(self.placing[sid].wait(), self.cfg.node_timeout_s + 5)
            except (TimeoutError, KeyError):
                pass
            info = self.placed.get(sid)
        if info is None and sid not in self.lost_recent:
            await asyncio.sleep(0.05)  # let a just-created placement reach the watcher
            info = self.placed.get(sid)
        if info is not None:
            node = info.node
        elif sid in self.lost_recent:
            node = self.lost_recent[sid][0]
        else:
            for wait in (0.0, 0.25):  # another replica may have placed it, its KV write in flight
                await asyncio.sleep(wait)
                if sid in self.placed:
                    return
                try:
                    await self.kv_placements.get(sid)
                    return  # owned: its node answers
                except KeyNotFoundError:
                    pass
                except Exception:
                    return
            await self.nc.publish(msg.reply, encoder.encode({"ok": False, "error": {
                "code": "not_found", "message": f"no node owns sandbox {sid!r}: it was destroyed, expired, or never existed"}}))
            return
        if self.registry.is_alive(node):
            return  # owned by a live node: it answers
        # the node looks lost, but it may only have been paused or slow and be answering right
        # now, its next heartbeat on the way: give it one heartbeat interval before saying no
        await asyncio.sleep(min(max(self.registry.interval(node), 0.2), self.cfg.stale_after_s))
        if self.registry.is_alive(node):
            return
        now_info = self.placed.get(sid)
        if now_info is not None and now_info.node != node and self.registry.is_alive(now_info.node):
            return
        await self.nc.publish(msg.reply, encoder.encode({"ok": False, "error": {
            "code": "not_found", "message": f"sandbox {sid!r} was on node {node}, which is lost (no heartbeat)"}}))
