"""The node-agent service: owns the sandboxes of one node.

It answers the scheduler's `corral.node.<node>.create`, then subscribes
`corral.v1.sandbox.<id>.>` for each sandbox it created, so every later call reaches it directly.
It publishes lifecycle events, heartbeats with capacity and actual use, expires sandboxes whose
lease ran out, and on start adopts or cleans what a crashed predecessor left behind."""
from __future__ import annotations

import asyncio
import base64
import codecs
import logging
import os
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.audit import AuditEvent, event_id
from corral_common.contract.errors import Capacity, Conflict, CorralError, Forbidden, InvalidRequest, NotFound, Unavailable
from corral_common.contract.images import ImageManifest
from corral_common.contract.messages import (
    AuditState,
    ChangesRequest,
    Event,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileContent,
    FileReadRequest,
    FileWriteRequest,
    Heartbeat,
    NodeCapacity,
    NodeCreate,
    NodeRun,
    NodeUsage,
    RenewRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    SnapshotRequest,
    TrajGetRequest,
    TrajListRequest,
    TrajMeta,
    TrajOpenRequest,
    TrajRef,
    encoder,
    new_id,
    ok,
)
from corral_common.layers import Catalog, ObjectStoreBackend, build_layer, check_image_name

from . import confine
from .audit_fanotify import FileAudit
from .audit_fanotify import norm as _norm_path
from .audit_files import FileActivity
from .audit_seccomp import SeccompListener, comm_of
from .auditlog import AuditLog
from .batchcreate import BatchCreate, clean_claims
from .claim import claim_placement
from .layermounts import LayerMounts
from .substrates import REGISTRY, Substrate
from .substrates.base import Sandbox
from .substrates.container import ContainerSubstrate
from .trajectory import TrajectoryLog
from .usage import Observed, UsageTracker
from .warmpool import PoolConfig, WarmPool

log = logging.getLogger("corral.node")

SANDBOXES = metrics.gauge("corral_sandboxes", "Live sandboxes on this node", ("node", "substrate"))
CREATE_SECONDS = metrics.histogram(
    "corral_sandbox_create_seconds", "Time to create a sandbox on the node", ("node", "substrate"),
    buckets=(0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
EXEC_SECONDS = metrics.histogram(
    "corral_exec_seconds", "Exec duration as seen by the node", ("node", "substrate"),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 300),
)
SNAPSHOT_SECONDS = metrics.histogram("corral_snapshot_seconds", "Time to snapshot a sandbox", ("node",),
                                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
REPLAYED = metrics.counter("corral_traj_replayed_total", "Trajectory steps answered from the log", ("node",))
RUN_SECONDS = metrics.histogram(
    "corral_run_seconds", "One-shot run (create, exec, until the command ended) as seen by the node", ("node", "substrate"),
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 5, 30, 300),
)
DESTROY_SECONDS = metrics.histogram("corral_sandbox_destroy_seconds", "Time to destroy a sandbox", ("node", "substrate"))
FILE_ACTIVITY_MODE = metrics.counter("corral_file_activity_watches_total", "Sandbox roots watched for file activity, by fanotify mode",
                                     ("node", "mode"))
WRITTEN_BACK = "placement written back after the node was declared lost"
WRITE_BACK_AGAIN_S = 3.0  # the second write-back, past a delete that was still on its way
EVENTS = metrics.counter("corral_node_events_total", "Lifecycle events published", ("node", "kind"))
LIMITS_DELAY_S = 0.2  # OOM kills / pids-limit hits are looked for this long after an exec ends
# file-activity drop reasons (audit_files.py) as the `loss` reasons a grader reads
LOSS_REASONS = {"rate_limit": "file events rate-limited", "queue_overflow": "fanotify queue overflow"}
RESTART_GAP = "node-agent restarted"


class AgentConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    node: str
    state_dir: str
    substrates: list[str] = msgspec.field(default_factory=lambda: ["container"])
    cpu: float = 0.0  # 0: the machine's cores
    cpu_overcommit: float = 8.0  # the most CPU requests may add up to, as a multiple of cpu
    memory_mb: int = 0  # 0: 90% of MemTotal
    max_sandboxes: int = 4096
    heartbeat_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    keep_sandboxes_on_exit: bool = False
    loader_wait_s: float = 60.0
    usage_top: int = 256  # sandboxes listed one by one in a heartbeat (busiest first)
    warm_pool: PoolConfig | None = None  # warm pools for the container substrate (warmpool.py)
    #: False (`--no-audit`): no audit events at all (exec log, file activity, denied syscalls are
    #: plain EPERM); protected paths are still enforced. For measuring the cost of auditing.
    audit: bool = True
    file_events_rate: float = 2000.0  # file-activity events per second per sandbox (token bucket rate)
    file_events_burst: float = 10000.0  # and its burst; beyond, events are dropped and the drop is audited


def _cmdline(pid: int) -> str:
    """A process's argv, NUL-separated (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return "\x00".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)[:1000]
    except OSError:
        return ""


def _mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


class NodeAgent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.node = cfg.node
        self.state_dir = f"{cfg.state_dir}/nodes/{cfg.node}"
        self.substrates: dict[str, Substrate] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self.substrate_of: dict[str, Substrate] = {}
        self.destroying: set[str] = set()
        self.runs: dict[object, SandboxSpec] = {}  # one-shot runs in flight (capacity)
        # creates accepted and not finished: they count against the node's room like its sandboxes
        # (six concurrent creates onto room for two must make two)
        self.creating: dict[str, SandboxSpec] = {}
        self.capacity = NodeCapacity(
            cpu=cfg.cpu or float(os.cpu_count() or 1),
            memory_mb=cfg.memory_mb or int(_mem_total_mb() * 0.9),
            sandboxes=cfg.max_sandboxes,
            cpu_overcommit_max=cfg.cpu_overcommit,
        )
        self.usage = UsageTracker(cfg.usage_top)
        self.usage_thread = ThreadPoolExecutor(1, thread_name_prefix="usage")  # never behind teardowns
        self.observed = Observed()
        self.observed_cpu = 0.0
        self.observed_mem_mb = 0
        self.tasks: set[asyncio.Task] = set()
        self.annotating: dict[str, set[asyncio.Task]] = {}  # sandbox -> git-ref events being annotated (audit waits)
        self.metrics_url = ""
        self.accepting = True
        self.pool: WarmPool | None = None
        self.kv_writes: dict[str, asyncio.Future] = {}  # placement writes in flight, per sandbox
        self.seccomp: SeccompListener | None = None  # audit sources, started in run()
        self.files_audit: FileAudit | None = None
        self.activity: FileActivity | None = None
        self.inflight: dict[str, dict[object, str]] = {}  # sandbox -> commands being executed (file-event context)
        self.limits: dict[str, tuple[int, int]] = {}  # sandbox -> (OOM kills, pids-limit hits) already reported
        self.run_infos: dict[str, SandboxInfo] = {}  # one-shot runs whose command is running (job, labels of their events)
        # sandbox -> (sandbox, substrate, commands) of execs that ended lately: their limits are
        # checked together LIMITS_DELAY_S later, off the exec path (or at destroy, if sooner)
        self.limits_due: dict[str, tuple[Sandbox, Substrate, list[str]]] = {}
        self.limits_timer: asyncio.TimerHandle | None = None
        self.adopted = 0  # sandboxes adopted at start (their placements are checked after the first heartbeat)
        self.write_back_lock = asyncio.Lock()

    # ------------------------------------------------------------------ start / stop

    async def run(self, stop: asyncio.Event) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        # teardowns, file ops and audit-mark updates block in threads (syscalls, runc delete):
        # more than the default cpu+4 workers, so a burst of destroys does not stall the rest
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(16, thread_name_prefix="node"))
        self.metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.nc = await bus.connect(self.cfg.nats_url, name=f"corral-node-agent-{self.node}")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.placements = await bus.ensure_kv(self.js, subjects.KV_PLACEMENTS)
        self.catalog = await Catalog(self.js).open()
        self.layers = LayerMounts(self.nc, self.catalog, self.node, f"{self.state_dir}/layers")
        await self._wait_loader()
        await self._start_audit_sources()
        for name in self.cfg.substrates:
            cls = REGISTRY.get(name)
            if cls is None:
                raise SystemExit(f"unknown substrate {name!r}; known: {', '.join(REGISTRY)}")
            sub = cls(self.node, self.state_dir, self.layers)  # type: ignore[call-arg]
            if sub.supports_seccomp_notify and self.seccomp is not None:
                sub.seccomp_listener = self.seccomp.path
                sub.seccomp_fds = self.seccomp.fds
            sub.run_watcher = self._watch_run
            await sub.start()
            self.substrates[name] = sub
        self.responder = bus.Responder(self.nc, "node-agent", package="corral_node_agent", metadata={"node": self.node})
        self.audit = AuditLog(self.js, self.node)
        self.audit.enabled = self.cfg.audit
        self.audit.context = self._audit_context
        self.audit.start()
        self.traj = await TrajectoryLog(self.js).open()
        # the scheduler declared this node lost (it missed our heartbeats: paused, overloaded,
        # restarting) and deleted our placements: write back those of the sandboxes still alive
        await self.nc.subscribe(subjects.node_event(self.node, "lost"), cb=self._on_declared_lost)
        await self._reconcile()
        await clean_claims(self)  # batch claims of creates a killed predecessor never finished
        # one subscription per sandbox (see _register), listed in discovery as one endpoint
        self.responder.declare("sandbox", subjects.sandbox_all("*"))
        await self.responder.serve(subjects.node_create(self.node), self._on_create, "create")
        await self.responder.serve(subjects.node_create_batch(self.node), BatchCreate(self).handle, "create_batch")
        await self.responder.serve(subjects.node_ping(self.node), self._on_ping, "ping")
        await self.responder.serve(subjects.node_run(self.node), self._on_run, "run")
        for subject, handler, op in ((subjects.TRAJ_OPEN, self._on_traj_open, "traj.open"), (subjects.TRAJ_GET, self._on_traj_get, "traj.get"),
                                     (subjects.TRAJ_LIST, self._on_traj_list, "traj.list"), (subjects.TRAJ_DELETE, self._on_traj_delete, "traj.delete")):
            await self.responder.serve(subject, handler, op, queue=subjects.TRAJ_QUEUE)
        self._start_pool()
        metrics.UP.labels("node-agent").set(1)
        self._spawn(self._heartbeat_loop())
        self._spawn(self._reaper_loop())
        logs.kv(log, logging.INFO, "node-agent ready", node=self.node, metrics=self.metrics_url,
                substrates=list(self.substrates), capacity=msgspec.to_builtins(self.capacity))
        await stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        self.accepting = False
        await self.responder.unserve(subjects.node_create(self.node))
        await self.responder.unserve(subjects.node_create_batch(self.node))
        await self._publish_heartbeat(stopping=True)
        if self.pool is not None:
            await self.pool.close()
        # creates already accepted finish first (no new ones start): one registered after the list
        # below was taken would outlive the agent, its placement left for the scheduler to find
        deadline = time.monotonic() + 60
        while self.creating and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.cfg.keep_sandboxes_on_exit:
            await asyncio.gather(*(self.destroy(sid, "node-agent shutdown") for sid in list(self.sandboxes)), return_exceptions=True)
            # destroys already in flight (requests, TTL) are skipped above: let them finish too
            deadline = time.monotonic() + 120
            while self.destroying and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        await self.responder.drain(timeout=5)
        for t in list(self.tasks):
            t.cancel()
        for sub in self.substrates.values():
            await sub.close()
        if not self.cfg.keep_sandboxes_on_exit:
            await self.layers.close()
        if self.seccomp is not None:
            await self.seccomp.close()
        if self.files_audit is not None:
            self.files_audit.close()
        if self.activity is not None:
            self.activity.close()
        if self.limits_timer is not None:  # kept sandboxes: their last execs' limits, now
            self.limits_timer.cancel()
            self._check_due_limits()
        await self.audit.close()
        try:
            await self.nc.drain()
        except Exception:  # shutting down: a connection already closed has nothing to drain
            pass
        self.usage_thread.shutdown(wait=False)
        metrics.UP.labels("node-agent").set(0)
        logs.kv(log, logging.INFO, "node-agent stopped", node=self.node, kept=len(self.sandboxes))

    async def _wait_loader(self) -> None:
        """Sandboxes need the node's image loader (image-cache); wait for it, say so if absent."""
        deadline = time.monotonic() + self.cfg.loader_wait_s
        warned = False
        while not await self.layers.ping():
            if time.monotonic() > deadline:
                raise SystemExit(f"no image loader answers on {subjects.node_loader(self.node, '*')}: start "
                                 f"`corral image-loader --node {self.node}` (corral up does)")
            if not warned:
                logs.kv(log, logging.WARNING, "waiting for the node's image loader", node=self.node)
                warned = True
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ audit sources

    async def _start_audit_sources(self) -> None:
        """The seccomp-notify listener and the fanotify group, before any sandbox exists (created
        or adopted). Denied syscalls of adopted sandboxes are not seen (runc sent their notify fd
        to our predecessor): they fail with ENOSYS, unaudited, until the sandbox is recreated."""
        path = f"{self.state_dir}/seccomp.sock"
        if not self.cfg.audit:
            logs.kv(log, logging.WARNING, "auditing is off (--no-audit): no exec log, file activity or denied-syscall events")
        elif len(path.encode()) < 100:
            self.seccomp = SeccompListener(path, self._on_denied_syscall, self.node, self._on_watched_syscall)
            await self.seccomp.start()
        else:
            logs.kv(log, logging.WARNING, "state dir too long for the seccomp socket; denied syscalls are not audited", path=path)
        try:
            self.files_audit = FileAudit(self.node, self._on_file_event, self._on_permission_overflow)
            self.files_audit.start()
        except OSError as e:
            self.files_audit = None
            logs.kv(log, logging.WARNING, "fanotify unavailable: protected paths and canaries are not enforced", error=str(e))
        if self.cfg.audit:
            try:
                self.activity = FileActivity(self.node, self._on_file_activity, rate=self.cfg.file_events_rate,
                                             burst=self.cfg.file_events_burst)
                self.activity.start()
            except OSError as e:
                self.activity = None
                logs.kv(log, logging.WARNING, "fanotify unavailable: file activity is not audited", error=str(e))

    def _audit_context(self, sid: str) -> dict:
        sb = self.sandboxes.get(sid)
        info = sb.info if sb is not None else self.run_infos.get(sid)
        return {"job": info.job, "labels": info.labels} if info else {}

    async def _audit_state(self, sid: str) -> AuditState:
        """`corral.v1.sandbox.<id>.audit`: read what the audit sources hold for the sandbox now
        (fanotify queues, waiting seccomp notifications, file-event drops not yet reported), then
        publish all of its events so far and wait for JetStream's acks."""
        if self.files_audit is not None:
            self.files_audit.drain()
        if self.activity is not None:
            self.activity.drain(sid)
        if self.seccomp is not None:
            self.seccomp.drain(sid)
        if self.cfg.audit:
            self._flush_limits(sid)
        pending = [t for t in self.annotating.get(sid, ()) if not t.done()]
        if pending:  # git-ref events being annotated: part of the record up to now
            await asyncio.wait(pending, timeout=10)
        return await self.audit.sync(sid)

    def _audit_base(self, sid: str) -> dict:
        sb = self.sandboxes.get(sid)
        info = sb.info if sb is not None else self.run_infos.get(sid)
        return {"id": event_id(), "ts": time.time(), "node": self.node, "sandbox": sid,
                "job": info.job if info else "", "labels": info.labels if info else {}}

    def _on_denied_syscall(self, sid: str, pid: int, comm: str, name: str, detail: dict[str, str]) -> None:
        self.audit.emit(AuditEvent(**self._audit_base(sid), kind="syscall", syscall=name, pid=pid, comm=comm,
                                   denied=True, op=detail.get("request", "") if name == "ioctl" else "", detail=detail))

    def _on_watched_syscall(self, sid: str, pid: int, comm: str, kind: str, op: str, target: str, denied: bool,
                            detail: dict[str, str]) -> None:
        """A connect/sendto to a non-loopback address (kind "net"), or a signal to a process
        outside the caller's exec (kind "signal")."""
        self.audit.emit(AuditEvent(**self._audit_base(sid), kind=kind, op=op, target=target, pid=pid, comm=comm,  # type: ignore[arg-type]
                                   syscall=op, denied=denied, detail=detail))

    def _on_file_event(self, sid: str, pid: int, kind: str, path: str, denied: bool) -> None:
        detail = {"protected": "1"} if kind == "file" else {"canary": "1"}
        self.audit.emit(AuditEvent(**self._audit_base(sid), kind=kind, op="open", path=path, pid=pid,  # type: ignore[arg-type]
                                   comm=comm_of(pid), denied=denied, detail=detail))

    def _on_permission_overflow(self, sids: list[str]) -> None:
        """The protected-path group's queue overflowed: whose events were lost is unknown, so every
        sandbox it watches has a gap."""
        for sid in sids:
            self.audit.loss(sid, "fanotify queue overflow (protected paths)", 0)

    def _on_file_activity(self, sid: str, op: str, path: str, pid: int, detail: dict[str, str]) -> None:
        if op == "dropped":  # rate-limited or a kernel queue overflow: this sandbox's record has a hole
            reason = LOSS_REASONS.get(detail.get("reason", ""), f"file events dropped ({detail.get('reason', '')})")
            try:
                n = int(detail.get("dropped", "0"))
            except ValueError:
                n = 0
            self.audit.loss(sid, reason, n)
        if op == "open" and "/.git/refs/heads/" in path:
            # read in a thread: .git/HEAD may carry a protected-path mark whose permission event
            # this very loop must answer
            # the git process's argv, and the commands in flight (in case it has exited already)
            ctx = {"cmdline": _cmdline(pid), "exec_cmd": "\n".join(self.inflight.get(sid, {}).values())[:2000]}
            comm = comm_of(pid)

            async def annotate() -> None:
                extra = await asyncio.to_thread(self._git_ref_detail, sid, path)
                self.audit.emit(AuditEvent(**self._audit_base(sid), kind="file", op=op, path=path, pid=pid, comm=comm,
                                           detail={**detail, **extra, **{k: v for k, v in ctx.items() if v}}))

            t = asyncio.create_task(annotate())
            self.tasks.add(t)
            self.annotating.setdefault(sid, set()).add(t)

            def done(t: asyncio.Task, sid: str = sid) -> None:
                self.tasks.discard(t)
                left = self.annotating.get(sid)
                if left is not None:
                    left.discard(t)
                    if not left:
                        del self.annotating[sid]

            t.add_done_callback(done)
            return
        self.audit.emit(AuditEvent(**self._audit_base(sid), kind="file", op=op, path=path, pid=pid,
                                   comm=comm_of(pid) if pid else "", detail=detail))

    def _git_ref_detail(self, sid: str, path: str) -> dict[str, str]:
        """A git process read a branch's ref file: which branch, which one HEAD is on, and the git
        command line, so the monitor can tell `git log other-branch` from ordinary work on HEAD's
        branch (git_history rule). Read from the sandbox's root (confined) while it is fresh."""
        repo, ref = path.split("/.git/refs/heads/", 1)
        out = {"git_ref": f"refs/heads/{ref}"}
        sb, sub = self.sandboxes.get(sid), self.substrate_of.get(sid)
        root = sub.audit_root(sb) if sb is not None and sub is not None else None
        if root and sub is not None and sub.name != "docker":
            try:
                head, _ = confine.read(root, f"{repo}/.git/HEAD", 4096)
                out["git_head"] = head.decode(errors="replace").strip().removeprefix("ref:").strip()
            except Exception:  # no git repository (or no readable HEAD): the info has no git_head
                pass
        return out

    async def _watch_activity(self, sb: Sandbox, sub: Substrate, inline: bool = False) -> None:
        """Start reporting the sandbox's file activity (its root filesystem's superblock)."""
        root = sub.audit_root(sb)
        if root is not None:
            await self._add_activity(sb.id, root, inline)

    async def _add_activity(self, sid: str, root: str, inline: bool = False) -> None:
        if self.activity is None:
            return
        try:
            mode = self.activity.add(sid, root) if inline else await asyncio.to_thread(self.activity.add, sid, root)
            FILE_ACTIVITY_MODE.labels(self.node, mode).inc()
        except OSError as e:
            logs.kv(log, logging.WARNING, "file activity of this sandbox is not audited", sandbox=sid, error=str(e))

    async def _watch_run(self, info: SandboxInfo, root: str) -> Callable[[], None]:
        """Substrate.run_watcher: a one-shot run's file activity, tagged like a sandbox's."""
        self.run_infos[info.id] = info
        sid = info.id
        await self._add_activity(sid, root)

        def stop() -> None:
            self._unwatch_activity(sid)
            self.run_infos.pop(sid, None)
        return stop

    def _check_limits(self, sb: Sandbox, sub: Substrate, cmd: str = "") -> None:
        """Report new OOM kills and pids-limit hits (after each exec, and every heartbeat for what
        background processes run into). The first look only sets the baseline."""
        self._report_limits(sb, _limit_counters(sb, sub), cmd)

    def _report_limits(self, sb: Sandbox, now: tuple[int, int, str] | None, cmd: str = "") -> None:
        if now is None:
            return
        ooms, hits, limit = now
        prev = self.limits.get(sb.id)
        if prev is None:
            self.limits[sb.id] = (ooms, hits)
            return
        # the counters only grow; a reading older than the last one reported (the heartbeat poll
        # reads on its thread while a deferred check reports on the loop) must not lower the mark
        self.limits[sb.id] = (max(ooms, prev[0]), max(hits, prev[1]))
        extra = {"cmd": cmd[:200]} if cmd else {}
        if ooms > prev[0]:
            self.audit.emit(AuditEvent(**self._audit_base(sb.id), kind="oom", op="oom_kill",
                                       detail={"kills": str(ooms - prev[0]), "memory_mb": str(sb.spec.memory_mb), **extra}))
        if hits > prev[1]:
            self.audit.emit(AuditEvent(**self._audit_base(sb.id), kind="pids", op="pids_limit",
                                       detail={"hits": str(hits - prev[1]), "limit": limit, **extra}))

    def _defer_limits(self, sb: Sandbox, sub: Substrate, cmd: str) -> None:
        """Check the sandbox's limits LIMITS_DELAY_S after this exec ended, once for every exec
        that ended meanwhile (three cgroup reads per sandbox, not per exec, and not before the
        reply)."""
        due = self.limits_due.get(sb.id)
        if due is None:
            self.limits_due[sb.id] = (sb, sub, [cmd])
        elif len(due[2]) < 8 and cmd not in due[2]:
            due[2].append(cmd)
        if self.limits_timer is None:
            self.limits_timer = asyncio.get_running_loop().call_later(LIMITS_DELAY_S, self._check_due_limits)

    def _check_due_limits(self) -> None:
        self.limits_timer = None
        due, self.limits_due = self.limits_due, {}
        for sid, (sb, sub, cmds) in due.items():
            if sid in self.sandboxes and sid not in self.destroying:
                self._check_limits(sb, sub, "; ".join(cmds))

    def _flush_limits(self, sid: str) -> None:
        """The deferred check of a sandbox about to go (what its last execs ran into is reported)."""
        due = self.limits_due.pop(sid, None)
        if due is not None:
            self._check_limits(due[0], due[1], "; ".join(due[2]))

    def _unwatch_activity(self, sid: str) -> None:
        if self.activity is not None:
            self.activity.remove(sid)

    async def _watch_files(self, sb: Sandbox) -> None:
        """Mark the sandbox's protected paths and canaries (container roots only)."""
        root = sb.rootfs
        if self.files_audit is None or root is None or not (sb.spec.protected_paths or sb.spec.canaries):
            return
        decoys = [(m.path, m.decoy) for m in sb.masks]
        await asyncio.to_thread(self.files_audit.add, sb.id, root, list(sb.spec.protected_paths), list(sb.spec.canaries), decoys)

    async def _check_file_read(self, sb: Sandbox, path: str) -> None:
        """files.read: a protected path (by name or through links) is Forbidden, a canary is reported."""
        if self.files_audit is None:
            return
        hit = await asyncio.to_thread(self.files_audit.check_read, sb.id, path)
        if hit is not None:
            self.audit.emit(AuditEvent(**self._audit_base(sb.id), kind="file", op="read", path=_norm_path(path), denied=True,
                                       detail={"protected": "1", "via": "files.read", "protected_path": hit}))
            raise Forbidden(f"{path} is protected in sandbox {sb.id}")
        canary = self.files_audit.canary_of(sb.id, path)
        if canary is not None:
            self.audit.emit(AuditEvent(**self._audit_base(sb.id), kind="canary", op="read", path=canary,
                                       detail={"canary": "1", "via": "files.read"}))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _reconcile(self) -> None:
        for name, sub in self.substrates.items():
            adopted, report = await sub.reconcile()
            take = sub.take_notify_fd if sub.supports_seccomp_notify else None
            self.adopted += len(adopted)
            for sb in adopted:
                # whatever it did while no agent ran (and what our predecessor held unpublished)
                # is not on the stream: its record has a gap of unknown size
                self.audit.loss(sb.id, RESTART_GAP, 0)
                nfd = take(sb) if take is not None and self.seccomp is not None else None
                if nfd is not None:
                    self.seccomp.register(sb.id, nfd)  # its notified calls answered and audited again
                elif self.seccomp is not None and take is not None:
                    logs.kv(log, logging.WARNING, "adopted sandbox without a seccomp notify fd: its notified calls fail (ENOSYS), unaudited",
                            sandbox=sb.id)
                    self.audit.loss(sb.id, "seccomp notify fd not recovered after restart", 0)
                try:
                    await self._watch_files(sb)
                except Exception as e:
                    logs.kv(log, logging.ERROR, "could not mark protected paths of an adopted sandbox", sandbox=sb.id, error=str(e))
                await self._watch_activity(sb, sub)
                self._check_limits(sb, sub)
                await self._register(sb, sub)
                await self._event(sb, "ready", reason="adopted after node-agent restart")
            for sid in report.cleaned:
                try:
                    await self.placements.delete(sid)
                except Exception as e:
                    logs.kv(log, logging.WARNING, "placement not deleted", sandbox=sid, error=repr(e))
                await self._publish_event(Event(kind="destroyed", ts=time.time(), sandbox_id=sid, node=self.node,
                                                reason="cleaned up after node-agent restart"))
            if report.adopted or report.cleaned:
                await self.nc.publish(subjects.node_event(self.node, "reconciled"), encoder.encode(
                    {"node": self.node, "substrate": name, "adopted": report.adopted, "cleaned": report.cleaned, "notes": report.notes}))
                logs.kv(log, logging.WARNING, "reconciled leftovers", substrate=name,
                        adopted=report.adopted, cleaned=report.cleaned, notes=report.notes)

    # ------------------------------------------------------------------ warm pool

    def _start_pool(self) -> None:
        cfg = self.cfg.warm_pool
        sub = self.substrates.get("container")
        if cfg is None or not (cfg.configured or cfg.learn):
            return
        if not isinstance(sub, ContainerSubstrate) or type(sub) is not ContainerSubstrate:
            logs.kv(log, logging.WARNING, "warm pools need the container substrate; not enabled", node=self.node)
            return
        self.pool = WarmPool(sub, self.node, cfg, self._forget_warm, self._pool_may_grow, self._image_exists)
        self.pool.start()
        logs.kv(log, logging.INFO, "warm pool on", configured=cfg.configured, learn=cfg.learn, max_total=cfg.max_total)

    async def _image_exists(self, image: str) -> bool:
        try:
            await self.catalog.image(image)
            return True
        except NotFound:
            return False

    def _forget_warm(self, wid: str) -> None:
        if self.seccomp is not None:
            self.seccomp.unregister(wid)

    def _pool_may_grow(self) -> bool:
        """Warm sandboxes only while the node has room: accepting, under its sandbox count, and
        observed memory under 80% of what it offers (their memory is real)."""
        return (self.accepting and self._held() + (self.pool.count() if self.pool else 0) < self.capacity.sandboxes
                and self.observed_mem_mb < self.capacity.memory_mb * 0.8)

    async def _claim_warm(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox | None:
        # protected paths are masked and canaries planted while a sandbox is built: a warm one
        # has neither, so such specs are always built cold
        if self.pool is None or spec.substrate != "container" or spec.protected_paths or spec.canaries:
            return None
        sb = await self.pool.claim(info, spec)
        if sb is not None and self.seccomp is not None:
            self.seccomp.rename(sb.warm_id, sb.id)  # the substrate renamed the rest
        return sb

    # ------------------------------------------------------------------ create

    async def _on_ping(self, msg: Msg) -> bytes:
        return ok(node=self.node, sandboxes=len(self.sandboxes))

    def _requested(self, creating: bool = True) -> tuple[float, int]:
        """CPU and memory requested by the node's sandboxes and (with `creating`) the creates it
        has accepted."""
        pending = self.creating.values() if creating else ()
        cpu = sum(sb.spec.cpu for sb in self.sandboxes.values()) + sum(s.cpu for s in pending)
        mem = sum(sb.spec.memory_mb for sb in self.sandboxes.values()) + sum(s.memory_mb for s in pending)
        return cpu, mem

    def _held(self, creating: bool = True) -> int:
        return len(self.sandboxes) + (len(self.creating) if creating else 0)

    async def _on_create(self, msg: Msg) -> bytes | None:
        """`corral.node.<node>.create` (and each item of a node batch). None when the reply was
        published here already (NodeCreate.reply_to: the client's answer goes straight to it)."""
        req = bus.decode(msg.data, NodeCreate)
        spec = req.spec
        if not self.accepting:
            raise Unavailable(f"node {self.node} is shutting down", retry_after_s=1)
        sub = self.substrates.get(spec.substrate)
        if sub is None:
            raise InvalidRequest(f"substrate {spec.substrate!r} is not available on node {self.node}; available: {', '.join(self.substrates)}")
        if req.sandbox_id in self.sandboxes:
            return ok(sandbox=self.sandboxes[req.sandbox_id].info)
        if req.sandbox_id in self.creating:
            raise Unavailable(f"sandbox {req.sandbox_id} is already being created on node {self.node}", retry_after_s=0.5)
        # the check and the booking happen with no await in between: concurrent creates each see
        # the ones accepted before them
        cpu, mem = self._requested()
        n = self._held()
        cpu_cap = self.capacity.cpu * self.capacity.cpu_overcommit_max
        if n >= self.capacity.sandboxes or cpu + spec.cpu > cpu_cap + 1e-9 or mem + spec.memory_mb > self.capacity.memory_mb:
            raise Capacity(f"node {self.node} is full ({len(self.sandboxes)} sandboxes and {len(self.creating)} being created, "
                           f"{cpu:g}/{cpu_cap:g} cpu, {mem}/{self.capacity.memory_mb} MiB requested)", retry_after_s=1)
        self.creating[req.sandbox_id] = spec
        try:
            return await self._create(msg, req, spec, sub)
        finally:
            self.creating.pop(req.sandbox_id, None)

    async def _create(self, msg: Msg, req: NodeCreate, spec: SandboxSpec, sub: Substrate) -> bytes | None:
        now = time.time()
        info = SandboxInfo(id=req.sandbox_id, node=self.node, state="creating", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=spec.labels,
                           cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id)
        t0 = time.perf_counter()
        # a warm sandbox's image was in the catalog when it was built (the pool re-checks)
        sb = await self._claim_warm(info, spec)
        if sb is None and sub.uses_catalog:  # docker resolves its own (local Docker) images
            await self.catalog.image(spec.image)  # NotFound with the list of images, before any work
        try:
            if sb is None:
                sb = await sub.create(info, spec)
        except CorralError:
            await self._publish_event(Event(kind="failed", ts=time.time(), sandbox_id=info.id, node=self.node, job=spec.job, reason="create failed"))
            raise
        sb.info.state = "running"
        claimed = getattr(msg, "claimed", False)  # a batch item: its placement key is claimed already
        if not claimed:
            await self._claim_or_undo(sb, sub)
        if spec.canaries or spec.protected_paths:
            try:
                for cpath, content in spec.canaries.items():
                    await sub.write_file(sb, cpath, content.encode(), 0o644, True)
                await self._watch_files(sb)
            except BaseException as e:
                if self.files_audit is not None:
                    await asyncio.shield(asyncio.to_thread(self.files_audit.remove, sb.id))
                await asyncio.shield(sub.destroy(sb))
                if not claimed:  # our claim names a sandbox that is gone (a batch item's is removed by the batch)
                    try:
                        await self.placements.delete(sb.id)
                    except Exception as e:
                        logs.kv(log, logging.WARNING, "placement not deleted", sandbox=sb.id, error=repr(e))
                await self._publish_event(Event(kind="failed", ts=time.time(), sandbox_id=info.id, node=self.node, job=spec.job,
                                                reason="create failed"))
                if isinstance(e, CorralError):
                    raise
                raise InvalidRequest(f"could not plant canaries or protect paths: {e}") from None
        # on the loop when nothing of this sandbox carries a permission mark (opening its root
        # cannot wait on this loop's answer): a thread hop costs more than the marks
        await self._watch_activity(sb, sub, inline=not (spec.canaries or spec.protected_paths))
        # from here on it counts as a sandbox, in every heartbeat taken at or after counted_at (no
        # await in between): the scheduler drops its reservation for it once such a heartbeat is in
        counted_at = time.time()
        self.creating.pop(sb.id, None)
        await self._register(sb, sub, record=claimed)  # serves corral.v1.sandbox.<id>.> before anyone hears of it
        CREATE_SECONDS.labels(self.node, spec.substrate).observe(time.perf_counter() - t0)
        body = ok(sandbox=sb.info)
        reply = getattr(msg, "reply", "")
        direct = bool(req.reply_to and reply)
        if direct:
            # the client's answer goes straight to it; the scheduler hears first (same flush) that
            # it was given, and only records the placement
            try:
                await self.nc.publish(reply, body[:-1] + b',"replied":true,"counted_at":' + repr(counted_at).encode() + b"}")
                await self.nc.publish(req.reply_to, body)
            except Exception:
                log.warning("could not publish the create reply", extra={"fields": {"sandbox": sb.id}})
            await asyncio.sleep(0)  # the flusher writes both before the bookkeeping below
        try:
            sub.settle(sb)
        except Exception:
            log.exception("create bookkeeping failed", extra={"fields": {"sandbox": sb.id}})
        self._check_limits(sb, sub)
        await self._event(sb, "created", reason="claimed from the warm pool" if sb.warm_id else "")
        await self._event(sb, "ready")
        return None if direct else body[:-1] + b',"counted_at":' + repr(counted_at).encode() + b"}"

    async def _claim_or_undo(self, sb: Sandbox, sub: Substrate) -> None:
        """Claim the new sandbox's placement (claim.py). If another node holds the id (the
        scheduler gave up on this node's late answer and placed it there), destroy what was built
        here and refuse with `conflict` naming the owner: one id never names two live sandboxes."""
        try:
            owner = await claim_placement(self.placements, sb.info)
        except BaseException as e:
            await asyncio.shield(sub.destroy(sb))
            if isinstance(e, Exception):
                raise Unavailable(f"placement of {sb.id} not recorded on node {self.node}: {e}", retry_after_s=0.5) from None
            raise
        if not owner:
            return
        await asyncio.shield(sub.destroy(sb))
        logs.kv(log, logging.WARNING, "create undone: the id is placed on another node", sandbox=sb.id, owner=owner)
        await self._publish_event(Event(kind="failed", ts=time.time(), sandbox_id=sb.id, node=self.node, job=sb.info.job,
                                        reason=f"create undone: sandbox {sb.id} is placed on node {owner}"))
        raise Conflict(f"sandbox {sb.id} is already placed on node {owner}; this node's late create was undone")

    async def _on_run(self, msg: Msg) -> None:
        """`corral.node.<node>.run` (from the scheduler's `corral.v1.sandbox.run`): a fresh sandbox,
        one exec, audited like any other, then gone. The reply goes out as soon as the command has
        ended; the teardown follows, and a `destroyed` event marks its end."""
        req = bus.decode(msg.data, NodeRun)
        spec, ereq = req.spec, req.exec
        if not self.accepting:
            raise Unavailable(f"node {self.node} is shutting down", retry_after_s=1)
        sub = self.substrates.get(spec.substrate)
        if sub is None:
            raise InvalidRequest(f"substrate {spec.substrate!r} is not available on node {self.node}; available: {', '.join(self.substrates)}")
        if isinstance(ereq.cmd, str) and not ereq.cmd.strip():
            raise InvalidRequest("cmd is empty")
        if ereq.stream or ereq.session or ereq.trajectory:
            raise InvalidRequest("a one-shot run answers with one message and keeps nothing: stream, session and "
                                 "trajectory need a sandbox (create one, then exec)")
        cpu, mem = self._requested()
        cpu += sum(s.cpu for s in self.runs.values())
        mem += sum(s.memory_mb for s in self.runs.values())
        n = self._held() + len(self.runs)
        cpu_cap = self.capacity.cpu * getattr(self.capacity, "cpu_overcommit_max", 1.0)
        if n >= self.capacity.sandboxes or cpu + spec.cpu > cpu_cap + 1e-9 or mem + spec.memory_mb > self.capacity.memory_mb:
            raise Capacity(f"node {self.node} is full ({n} sandboxes and calls, {cpu:g}/{cpu_cap:g} cpu, "
                           f"{mem}/{self.capacity.memory_mb} MiB requested)", retry_after_s=0.2)
        # (an unknown image is the substrate's NotFound, raised before it sets anything up)
        now = time.time()
        info = SandboxInfo(id=new_id(), node=self.node, state="running", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=spec.labels,
                           cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id)
        token = object()
        self.runs[token] = spec
        t0 = time.perf_counter()
        try:
            result, finish = await sub.run(info, spec, ereq, None)
        except CorralError:
            await self._publish_event(Event(kind="failed", ts=time.time(), sandbox_id=info.id, node=self.node, job=spec.job,
                                            reason="run failed", info=info))
            raise
        finally:
            self.runs.pop(token, None)
        RUN_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
        EXEC_SECONDS.labels(self.node, sub.name).observe(result.duration_ms / 1000)
        self.audit.emit(AuditEvent(
            id=event_id(), ts=time.time(), node=self.node, sandbox=info.id, kind="exec", job=spec.job, labels=spec.labels,
            cmd=ereq.cmd if isinstance(ereq.cmd, str) else shlex.join(ereq.cmd), cwd=ereq.cwd or spec.workdir,
            exit_code=result.exit_code, duration_ms=round(result.duration_ms, 3), stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr), timed_out=result.timed_out,
            detail={"substrate": sub.name, "one_shot": "1", **({"oom_killed": "1"} if result.oom_killed else {})},
        ))
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, ok(result=result, sandbox_id=info.id, node=self.node))
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
        await self._publish_event(Event(kind="destroyed", ts=time.time(), sandbox_id=info.id, node=self.node, job=spec.job,
                                        reason="one-shot run finished", info=info,
                                        detail={"exit_code": result.exit_code, "duration_ms": round(result.duration_ms, 3)}))
        return None

    async def _register(self, sb: Sandbox, sub: Substrate, record: bool = True) -> None:
        self.sandboxes[sb.id] = sb
        self.substrate_of[sb.id] = sub
        if record:  # (a single create's claim wrote it already)
            self._record_placement(sb)
        await self.responder.serve(subjects.sandbox_all(sb.id), self._sandbox_handler(sb.id), "sandbox", key=sb.id)
        SANDBOXES.labels(self.node, sub.name).set(sum(1 for s in self.substrate_of.values() if s is sub))
        sub.watch_exit(sb, self._on_sandbox_exit)

    def _record_placement(self, sb: Sandbox) -> None:
        """Write the sandbox's placement to KV in the background: a KV put is a JetStream round
        trip, which the create reply need not wait for (the scheduler records the placement from
        the reply). Later writes and the delete wait for it, so they land in order."""
        prev = self.kv_writes.get(sb.id)
        data = encoder.encode(sb.info)

        async def put() -> None:
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            try:
                await self.placements.put(sb.id, data)
            except Exception as e:
                logs.kv(log, logging.WARNING, "placement not recorded", sandbox=sb.id, error=str(e))

        t = asyncio.ensure_future(put())
        self.kv_writes[sb.id] = t
        t.add_done_callback(lambda _: self.kv_writes.get(sb.id) is t and self.kv_writes.pop(sb.id, None))

    async def _placement_written(self, sid: str) -> None:
        t = self.kv_writes.get(sid)
        if t is not None:
            await asyncio.gather(t, return_exceptions=True)

    def _on_sandbox_exit(self, sb: Sandbox) -> None:
        """PID 1 of the sandbox died on its own: report `exited`, then clean up everything."""
        if sb.id in self.destroying or sb.id not in self.sandboxes:
            return

        async def go() -> None:
            await self._event(sb, "exited", reason="sandbox init process exited")
            await self._safe_destroy(sb.id, "sandbox exited")

        self._spawn(go())

    # ------------------------------------------------------------------ per-sandbox ops

    def _sandbox_handler(self, sid: str):
        prefix = f"{subjects.PREFIX}.sandbox.{sid}."

        async def handle(msg: Msg) -> bytes | None:
            op = msg.subject[len(prefix):]
            sb = self.sandboxes.get(sid)
            if sb is None or sid in self.destroying:
                raise NotFound(f"sandbox {sid} is being destroyed or no longer exists")
            sub = self.substrate_of[sid]
            if op == "exec":
                return await self._exec(msg, sb, sub)
            if op == "info":
                bus.decode(msg.data, _Empty)
                u = await sub.usage(sb)
                return ok(sandbox=sb.info, usage=u)
            if op == "files.read":
                r = bus.decode(msg.data, FileReadRequest)
                await self._check_file_read(sb, r.path)
                data, mode = await sub.read_file(sb, r.path, r.max_bytes)
                return ok(file=FileContent(path=r.path, content_b64=base64.b64encode(data).decode(), size=len(data), mode=mode))
            if op == "files.write":
                w = bus.decode(msg.data, FileWriteRequest)
                try:
                    data = base64.b64decode(w.content_b64, validate=True)
                except ValueError:
                    raise InvalidRequest("content_b64 is not valid base64") from None
                await sub.write_file(sb, w.path, data, w.mode, w.make_parents)
                return ok(path=w.path, size=len(data))
            if op == "destroy":
                bus.decode(msg.data, _Empty)
                await self.destroy(sid, "destroyed by request")
                return ok(sandbox_id=sid)
            if op == "pause":
                await sub.pause(sb)
                sb.info.state = "paused"
                await self._placement_written(sid)
                await self.placements.put(sid, encoder.encode(sb.info))
                return ok(sandbox=sb.info)
            if op == "resume":
                await sub.resume(sb)
                sb.info.state = "running"
                await self._placement_written(sid)
                await self.placements.put(sid, encoder.encode(sb.info))
                return ok(sandbox=sb.info)
            if op == "snapshot":
                req = bus.decode(msg.data, SnapshotRequest)
                image, layer, uploaded = await self._take_snapshot(sb, sub, req.name, req.labels)
                return ok(image=image, layer=layer.digest, size=layer.size, uploaded_bytes=uploaded)
            if op == "changes":
                creq = bus.decode(msg.data, ChangesRequest)
                return ok(**msgspec.to_builtins(await sub.changes(sb, creq)))
            if op == "audit":
                bus.decode(msg.data, _Empty)
                return ok(**msgspec.to_builtins(await self._audit_state(sid)))
            if op == "renew":
                r = bus.decode(msg.data, RenewRequest)
                sb.info.expires_at = time.time() + (r.ttl_s or sb.spec.ttl_s)
                await self._placement_written(sid)
                await self.placements.put(sid, encoder.encode(sb.info))
                return ok(sandbox=sb.info)
            if op == "restore":
                return await self._restore(msg, sb, sub)
            raise InvalidRequest(f"unknown sandbox operation {op!r}; known: {', '.join(subjects.SANDBOX_OPS)}")

        return handle

    async def _exec(self, msg: Msg, sb: Sandbox, sub: Substrate) -> bytes:
        req = bus.decode(msg.data, ExecRequest)
        if isinstance(req.cmd, str) and not req.cmd.strip():
            raise InvalidRequest("cmd is empty")
        if bool(req.trajectory) != (req.step is not None):
            raise InvalidRequest("trajectory and step go together: give both or neither")
        if not req.trajectory:
            return ok(result=await self._run_exec(msg, req, sb, sub))

        async def snapshot() -> str:
            name = f"traj-{req.trajectory.lower()}-{req.step}"[:128]
            image, _, _ = await self._take_snapshot(sb, sub, name, {"trajectory": req.trajectory})
            return image.name

        result = await self.traj.run_step(req, sb.id, sb.spec, self.node, lambda: self._run_exec(msg, req, sb, sub), snapshot)
        if result.replayed:
            REPLAYED.labels(self.node).inc()
            if req.stream and msg.reply:
                for i, (name, text) in enumerate((("stdout", result.stdout), ("stderr", result.stderr))):
                    if text:
                        await self.nc.publish(msg.reply, encoder.encode(ExecChunk(stream=name, data=text, seq=i)))  # type: ignore[arg-type]
        return ok(result=result)

    async def _run_exec(self, msg: Msg, req: ExecRequest, sb: Sandbox, sub: Substrate) -> ExecResult:
        """Run one exec for real: output streamed to the caller if asked, audited, limits checked."""
        on_chunk = None
        pump = None
        queue: asyncio.Queue | None = None
        if req.stream and msg.reply:
            queue = asyncio.Queue()
            decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                        "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
            seq = iter(range(1 << 62))

            def on_chunk(stream: str, data: bytes) -> None:
                text = decoders[stream].decode(data)
                if text:
                    queue.put_nowait(ExecChunk(stream=stream, data=text, seq=next(seq)))  # type: ignore[arg-type]

            async def pump_chunks() -> None:
                while (item := await queue.get()) is not None:
                    await self.nc.publish(msg.reply, encoder.encode(item))

            pump = asyncio.create_task(pump_chunks())
        t0 = time.perf_counter()
        token = object()
        running = self.inflight.setdefault(sb.id, {})
        running[token] = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
        try:
            result = await sub.exec(sb, req, on_chunk)
        finally:
            running.pop(token, None)
            if not running:
                self.inflight.pop(sb.id, None)
            if pump is not None and queue is not None:
                queue.put_nowait(None)
                await pump
        EXEC_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
        self.audit.emit(AuditEvent(
            id=event_id(), ts=time.time(), node=self.node, sandbox=sb.id, kind="exec", job=sb.info.job, labels=sb.info.labels,
            cmd=req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd), cwd=req.cwd or sb.spec.workdir, session=req.session,
            exit_code=result.exit_code, duration_ms=round(result.duration_ms, 3), stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr), timed_out=result.timed_out,
            detail={"oom_killed": "1"} if result.oom_killed else {},
        ))
        if self.cfg.audit:  # later, with the other execs that end meanwhile: not the caller's wait
            self._defer_limits(sb, sub, req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd))
        return result

    async def _take_snapshot(self, sb: Sandbox, sub: Substrate, name: str, labels: dict[str, str]):
        """Turn the sandbox's writable layer into an image layer on top of its image's layers.

        The sandbox is frozen while the layer is built so the snapshot is consistent, then thawed;
        the new image can be started on any node (the chunks go to the shared chunk store)."""
        name = name or f"snap-{sb.id}-{int(time.time() * 1000)}"
        check_image_name(name)
        if sub.snapshots_itself:  # substrates that make images their own way (docker: commit, save, import)
            return await sub.snapshot_image(sb, name, labels)
        was_paused = sb.info.state == "paused"
        t0 = time.perf_counter()
        async with sub.snapshot_dir(sb) as (upper, layers):
            if not was_paused:
                await sub.pause(sb)
            try:
                layer, uploaded = await build_layer(upper, ObjectStoreBackend(self.js), source=f"snapshot:{sb.id}",
                                                    work_dir=self.state_dir, exclude=[".corral"])
            finally:
                if not was_paused:
                    await sub.resume(sb)
        sizes = [(await self.catalog.layer(d)).size for d in layers]
        image = ImageManifest(name=name, layers=[*layers, layer.digest], created_at=time.time(), size=sum(sizes) + layer.size,
                              labels={**labels, "snapshot_of": sb.id}, parent=sb.info.image)
        # image first, then its layer: the image-cache's garbage collection (after any image delete)
        # drops layers no image names, and a layer put first would be unnamed for a moment
        await self.catalog.put_image(image)
        await self.catalog.put_layer(layer)
        SNAPSHOT_SECONDS.labels(self.node).observe(time.perf_counter() - t0)
        logs.kv(log, logging.INFO, "snapshot", sandbox=sb.id, image=name, size=layer.size, uploaded=uploaded,
                seconds=round(time.perf_counter() - t0, 3))
        return image, layer, uploaded

    # ------------------------------------------------------------------ trajectories

    async def _on_traj_open(self, msg: Msg) -> bytes:
        r = bus.decode(msg.data, TrajOpenRequest)
        now = time.time()
        meta = await self.traj.create(TrajMeta(id=r.id, sandbox_id=r.sandbox_id, spec=r.spec, created_at=now, updated_at=now,
                                               snapshot_every=r.snapshot_every))
        return ok(trajectory=meta)

    async def _on_traj_get(self, msg: Msg) -> bytes:
        r = bus.decode(msg.data, TrajGetRequest)
        meta = await self.traj.get(r.id)
        first = max(0, meta.last_step - 19) if r.from_step is None else r.from_step
        last = min(meta.last_step, first + r.limit - 1)
        entries, size = [], 0
        for e in await self.traj.entries_from(r.id, first, last):
            size += len(e.result.stdout) + len(e.result.stderr) + 512
            if size > 4 * 1024 * 1024 and entries:
                break  # keep the reply under the bus payload limit; the caller pages on
            entries.append(e)
        return ok(trajectory=meta, recent=entries)

    async def _on_traj_list(self, msg: Msg) -> bytes:
        r = bus.decode(msg.data, TrajListRequest)
        out = []
        for tid in await self.traj.ids():
            if tid.startswith(r.prefix):
                m = await self.traj.maybe(tid)
                if m is not None:
                    out.append(m)
        return ok(trajectories=out)

    async def _on_traj_delete(self, msg: Msg) -> bytes:
        r = bus.decode(msg.data, TrajRef)
        meta = await self.traj.get(r.id)
        await self.traj.delete(r.id)
        for sn in meta.snapshots:
            try:
                await self.catalog.images.delete(sn.image)
            except Exception as e:
                logs.kv(log, logging.WARNING, "trajectory snapshot image not deleted", image=sn.image, error=repr(e))
        return ok(id=r.id, snapshots_removed=len(meta.snapshots))

    async def _restore(self, msg: Msg, sb: Sandbox, sub: Substrate) -> bytes:
        """Bind a trajectory to this (new) sandbox, made from its last snapshot (or its original
        image), re-running for real the logged steps the snapshot does not contain."""
        r = bus.decode(msg.data, RestoreRequest)
        meta = await self.traj.get(r.trajectory)
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
        return ok(trajectory=meta, rerun_steps=len(entries), from_snapshot_step=base_step)

    async def destroy(self, sid: str, reason: str) -> None:
        sb = self.sandboxes.get(sid)
        if sb is None or sid in self.destroying:
            return
        self.destroying.add(sid)
        sub = self.substrate_of[sid]
        t0 = time.perf_counter()
        try:
            await self.responder.unserve(sid)
            if self.seccomp is not None:
                self.seccomp.unregister(sid)
            self._unwatch_activity(sid)
            if self.cfg.audit:
                self._flush_limits(sid)
            self.limits_due.pop(sid, None)
            self.limits.pop(sid, None)
            self.inflight.pop(sid, None)
            if self.files_audit is not None:
                await asyncio.to_thread(self.files_audit.remove, sid)
            await sub.destroy(sb)
        finally:
            self.sandboxes.pop(sid, None)
            self.substrate_of.pop(sid, None)
            self.destroying.discard(sid)
            self.usage.forget(sid)
            self.audit.forget(sid)
        DESTROY_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
        SANDBOXES.labels(self.node, sub.name).set(sum(1 for s in self.substrate_of.values() if s is sub))
        sb.info.state = "destroyed"
        await self._placement_written(sid)
        try:
            await self.placements.delete(sid)
        except Exception as e:
            logs.kv(log, logging.WARNING, "placement not deleted", sandbox=sid, error=repr(e))
        await self._event(sb, "destroyed", reason=reason)

    # ------------------------------------------------------------------ events, heartbeats, expiry

    async def _event(self, sb: Sandbox, kind: str, reason: str = "") -> None:
        await self._publish_event(Event(kind=kind, ts=time.time(), sandbox_id=sb.id, node=self.node, job=sb.info.job,
                                        reason=reason, info=sb.info))

    async def _publish_event(self, ev: Event) -> None:
        EVENTS.labels(self.node, ev.kind).inc()
        try:
            await self.nc.publish(subjects.event(ev.sandbox_id, ev.kind), encoder.encode(ev))
        except Exception:
            log.warning("could not publish event", extra={"fields": {"kind": ev.kind, "sandbox": ev.sandbox_id}})

    async def _collect_usage(self) -> None:
        """Per-sandbox CPU rate and memory, read in a worker thread (cgroup files; thousands of
        sandboxes must not stall the loop). Sandboxes without a cgroup of ours (docker without
        one) are asked through their substrate and only count in the aggregate."""
        groups, others = {}, []
        for sid, sb in list(self.sandboxes.items()):
            cg = sb.cg
            if cg is not None:
                groups[sid] = cg
            elif sid in self.substrate_of:
                others.append(sb)
        if self.pool is not None:
            groups.update(self.pool.cgroups())  # warm sandboxes' memory is the node's too
        obs = await asyncio.get_running_loop().run_in_executor(self.usage_thread, self.usage.collect, groups, set(self.sandboxes))
        mem = obs.memory_bytes
        for sb in others:
            try:
                mem += (await self.substrate_of[sb.id].usage(sb)).memory_bytes
            except Exception:
                continue
        self.observed = obs
        self.observed_cpu = obs.cpu
        self.observed_mem_mb = mem // (1024 * 1024)

    async def _publish_heartbeat(self, stopping: bool = False) -> None:
        # creates in flight are left out: the scheduler that sent them holds a reservation for
        # each until a heartbeat taken after the node's answer covers it (counting both made a
        # node look full with room to spare); the node's own admission check counts them
        stopping = stopping or not self.accepting  # every heartbeat of a stopping node says so
        cpu, mem = self._requested(creating=False)
        hb = Heartbeat(
            node=self.node, ts=time.time(), capacity=self.capacity,
            usage=NodeUsage(cpu=round(self.observed_cpu, 3), memory_mb=self.observed_mem_mb, sandboxes=self._held(creating=False),
                            requested_cpu=cpu, requested_memory_mb=mem,
                            pooled=self.pool.count() if self.pool else 0, per_sandbox=self.observed.per_sandbox, per_sandbox_omitted=self.observed.omitted),
            substrates=list(self.substrates), metrics_url=self.metrics_url, stopping=stopping,
            warm=self.pool.by_image() if self.pool else {},
        )
        # published, not flushed with a PING round trip: nats-py (2.16) cancels a flush's future on
        # its timeout, and the PONG arriving after that raises InvalidStateError in the client's
        # read loop, which then stops for good: the node still sent heartbeats but heard no
        # create, reply or KV ack again. The client's flusher writes the heartbeat out at once.
        try:
            await self.nc.publish(subjects.NODE_HEARTBEAT, encoder.encode(hb))
        except Exception:
            log.warning("heartbeat not sent")

    async def _heartbeat_loop(self) -> None:
        """Heartbeats go out every heartbeat_s whatever else the node is doing: usage is sampled
        by its own task on its own thread, and a heartbeat carries the latest sample. (When the
        sampling waited on the shared thread pool, a node destroying 2,000 sandboxes queued it
        behind their teardowns, stopped heartbeating and was declared lost.)

        After the first heartbeat of an agent that adopted sandboxes, and after a gap in our own
        heartbeats long enough for the scheduler to have declared the node lost (the process was
        stopped or starved; the lost event itself may have been missed over a reconnect), the
        placements of live sandboxes are checked and written back where they are missing."""
        collecting: asyncio.Task | None = None
        first = True
        last = time.monotonic()
        while True:
            if collecting is None or collecting.done():
                collecting = asyncio.ensure_future(self._collect_usage_safe())
            await self._publish_heartbeat()
            now = time.monotonic()
            if (first and self.adopted) or now - last > max(3 * self.cfg.heartbeat_s, 2.0):
                self._spawn(self._write_back())
            first, last = False, now
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def _on_declared_lost(self, msg: Msg) -> None:
        logs.kv(log, logging.WARNING, "the scheduler declared this node lost; writing placements back", node=self.node,
                sandboxes=len(self.sandboxes))
        self._spawn(self._write_back())

    async def _write_back(self) -> None:
        """Write the placements of live sandboxes back to KV where they are missing (a scheduler
        deleted them when it declared the node lost), each announced with a `ready` event. Done
        twice, WRITE_BACK_AGAIN_S apart, in case a delete was still on its way the first time."""
        async with self.write_back_lock:
            for round_ in range(2):
                if round_:
                    await asyncio.sleep(WRITE_BACK_AGAIN_S)
                if not self.accepting:
                    return
                written = []
                for sid, sb in list(self.sandboxes.items()):
                    if sid in self.destroying:
                        continue
                    await self._placement_written(sid)
                    try:
                        e = await self.placements.get(sid)
                        if e is not None and e.value and _info_node(e.value) == self.node:
                            continue
                        if e is not None and e.value:
                            logs.kv(log, logging.WARNING, "placement names another node; not overwritten", sandbox=sid)
                            continue
                    except KeyNotFoundError:
                        pass
                    except Exception as e:
                        logs.kv(log, logging.WARNING, "placement not checked", sandbox=sid, error=str(e))
                        continue
                    if sid not in self.sandboxes or sid in self.destroying:
                        continue  # destroyed meanwhile: its delete must stay the last word
                    self._record_placement(sb)  # ordered with later writes and the destroy's delete
                    written.append(sb)
                for sb in written:
                    await self._placement_written(sb.id)
                    if sb.id in self.sandboxes:
                        await self._event(sb, "ready", reason=WRITTEN_BACK)
                if written:
                    logs.kv(log, logging.WARNING, "placements written back", node=self.node, sandboxes=len(written), round=round_ + 1)

    async def _collect_usage_safe(self) -> None:
        try:
            await self._collect_usage()
        except Exception:
            log.exception("usage collection failed")
        if self.cfg.audit:  # what background processes ran into: OOM kills, pids-limit hits
            # read on the usage thread: ~4 cgroup files per sandbox, which for 2,000 sandboxes
            # held the loop for hundreds of ms per heartbeat (creates at 2,000 alive took 5x longer)
            pairs = [(sb, sub) for sid, sb in list(self.sandboxes.items())
                     if (sub := self.substrate_of.get(sid)) is not None and sid not in self.destroying]
            counters = await asyncio.get_running_loop().run_in_executor(
                self.usage_thread, lambda: [_limit_counters(sb, sub) for sb, sub in pairs])
            for (sb, _), now in zip(pairs, counters):
                if sb.id in self.sandboxes and sb.id not in self.destroying:
                    self._report_limits(sb, now)

    async def _reaper_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for sid, sb in list(self.sandboxes.items()):
                if sb.info.expires_at <= now and sid not in self.destroying:
                    self._spawn(self._safe_destroy(sid, "ttl expired"))

    async def _safe_destroy(self, sid: str, reason: str) -> None:
        try:
            await self.destroy(sid, reason)
        except Exception:
            log.exception("destroy failed", extra={"fields": {"sandbox": sid}})


class _Empty(msgspec.Struct, forbid_unknown_fields=False):
    pass


def _limit_counters(sb: Sandbox, sub: Substrate) -> tuple[int, int, str] | None:
    """(OOM kills, pids-limit hits, pids limit) of the sandbox; None if it has no cgroup (or its
    cgroup is gone: it is being destroyed)."""
    try:
        return sub.limit_counters(sb)
    except Exception:
        return None


class _NodeOf(msgspec.Struct, forbid_unknown_fields=False):
    node: str = ""


_node_of = msgspec.json.Decoder(_NodeOf)


def _info_node(data: bytes) -> str:
    try:
        return _node_of.decode(data).node
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
