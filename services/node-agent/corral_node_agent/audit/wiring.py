"""The node's audit sources, wired to its sandboxes and to the audit stream.

Started before any sandbox exists (created or adopted): the seccomp-notify listener, the
fanotify permission group (protected paths, canaries) and the file-activity groups, all three
fanotify groups read by one loop (reader.py). Their callbacks become AuditEvents tagged with the
sandbox's job and labels; a sandbox's create, exec and destroy start and stop what watches it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from nats.js import JetStreamContext

from corral_common import logs, metrics
from corral_common.contract.audit import AuditEvent, event_id
from corral_common.contract.errors import CorralError, Forbidden
from corral_common.contract.messages import AuditState, SandboxInfo

from .. import confine
from ..substrates import Substrate
from ..substrates.base import GuardedOpen, Sandbox
from ..table import SandboxTable
from .fanotify import FileAudit
from .fanotify import norm as _norm_path
from .fanotify import under as _under
from .files import FileActivity
from .limits import Limits
from .log import AuditLog
from .reader import FanotifyReader
from .seccomp import SeccompListener, comm_of

log = logging.getLogger("corral.node")

FILE_ACTIVITY_MODE = metrics.counter("corral_file_activity_watches_total", "Sandbox roots watched for file activity, by fanotify mode",
                                     ("node", "mode"))
# file-activity drop reasons (files.py) as the `loss` reasons a grader reads
LOSS_REASONS = {"rate_limit": "file events rate-limited", "queue_overflow": "fanotify queue overflow"}
RESTART_GAP = "node-agent restarted"


def _cmdline(pid: int) -> str:
    """A process's argv, NUL-separated (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return "\x00".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)[:1000]
    except OSError:
        return ""


class AuditWiring:
    def __init__(self, node: str, state_dir: str, table: SandboxTable, enabled: bool = True,
                 file_events_rate: float = 2000.0, file_events_burst: float = 10000.0):
        self.node = node
        self.state_dir = state_dir
        self.table = table
        self.enabled = enabled  # False (`--no-audit`): no events; protected paths still enforced
        self.file_events_rate, self.file_events_burst = file_events_rate, file_events_burst
        self.reader = FanotifyReader()
        self.seccomp: SeccompListener | None = None
        self.files_audit: FileAudit | None = None
        self.activity: FileActivity | None = None
        self.tasks: set[asyncio.Task] = set()
        self.annotating: dict[str, set[asyncio.Task]] = {}  # sandbox -> git-ref events being annotated (audit waits)
        # (sandbox, host, port) -> allowed by its egress allowlist, or None without one (egress.py)
        self.egress_allows: Callable[[str, str, int], bool | None] | None = None
        self.inflight: dict[str, dict[object, str]] = {}  # sandbox -> commands being executed (file-event context)
        self.run_infos: dict[str, SandboxInfo] = {}  # one-shot runs whose command is running (job, labels of their events)
        self.guarded: set[str] = set()  # guests whose guard runs (guard_paths)

    async def start(self, js: JetStreamContext) -> None:
        """The audit log, then the sources (before any sandbox exists, created or adopted).
        Denied syscalls of adopted sandboxes are seen again only if their notify fd comes back
        (`adopt`)."""
        self.log = AuditLog(js, self.node)
        self.log.enabled = self.enabled
        self.log.context = self.context
        self.log.start()
        self.limits = Limits(self.log, self.base, self.table.is_live)
        path = f"{self.state_dir}/seccomp.sock"
        if not self.enabled:
            logs.kv(log, logging.WARNING, "auditing is off (--no-audit): no exec log, file activity or denied-syscall events")
        elif len(path.encode()) < 100:
            self.seccomp = SeccompListener(path, self._on_denied_syscall, self.node, self._on_watched_syscall,
                                           self._on_syscall_flood)
            await self.seccomp.start()
        else:
            logs.kv(log, logging.WARNING, "state dir too long for the seccomp socket; denied syscalls are not audited", path=path)
        try:
            self.files_audit = FileAudit(self.node, self._on_file_event, self._on_permission_overflow, reader=self.reader)
            self.files_audit.start()
        except OSError as e:
            self.files_audit = None
            logs.kv(log, logging.WARNING, "fanotify unavailable: protected paths and canaries are not enforced", error=str(e))
        if self.enabled:
            try:
                self.activity = FileActivity(self.node, self._on_file_activity, rate=self.file_events_rate,
                                             burst=self.file_events_burst, reader=self.reader)
                self.activity.start()
            except OSError as e:
                self.activity = None
                logs.kv(log, logging.WARNING, "fanotify unavailable: file activity is not audited", error=str(e))

    def configure(self, sub: Substrate) -> None:
        """Point a substrate that answers denied syscalls through us at the listener."""
        if sub.supports_seccomp_notify and self.seccomp is not None:
            sub.seccomp_listener = self.seccomp.path
            sub.seccomp_fds = self.seccomp.fds

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.seccomp is not None:
            await self.seccomp.close()
        if self.files_audit is not None:
            self.files_audit.close()
        if self.activity is not None:
            self.activity.close()
        self.limits.close()
        await self.log.close()

    # ------------------------------------------------------------------ event fields

    def _info(self, sid: str) -> SandboxInfo | None:
        sb = self.table.sandboxes.get(sid)
        return sb.info if sb is not None else self.run_infos.get(sid)

    def context(self, sid: str) -> dict:
        info = self._info(sid)
        return {"job": info.job, "labels": info.labels} if info else {}

    def base(self, sid: str) -> dict:
        info = self._info(sid)
        return {"id": event_id(), "ts": time.time(), "node": self.node, "sandbox": sid,
                "job": info.job if info else "", "labels": info.labels if info else {}}

    def emit(self, ev: AuditEvent) -> None:
        self.log.emit(ev)

    # ------------------------------------------------------------------ a sandbox's life

    async def adopt(self, sb: Sandbox, sub: Substrate) -> None:
        """A sandbox adopted from a predecessor: its gap told, its notify fd and marks back."""
        # whatever it did while no agent ran (and what our predecessor held unpublished) is not
        # on the stream: its record has a gap of unknown size
        self.log.loss(sb.id, RESTART_GAP, 0)
        take = sub.take_notify_fd if sub.supports_seccomp_notify else None
        nfd = take(sb) if take is not None and self.seccomp is not None else None
        if nfd is not None:
            self.seccomp.register(sb.id, nfd)  # its notified calls answered and audited again
        elif self.seccomp is not None and take is not None:
            logs.kv(log, logging.WARNING, "adopted sandbox without a seccomp notify fd: its notified calls fail (ENOSYS), unaudited",
                    sandbox=sb.id)
            self.log.loss(sb.id, "seccomp notify fd not recovered after restart", 0)
        try:
            await self.watch_files(sb, sub)
        except Exception as e:
            logs.kv(log, logging.ERROR, "could not mark protected paths of an adopted sandbox", sandbox=sb.id, error=str(e))
        await self.watch_activity(sb, sub)
        self.limits.check(sb, sub)

    def claimed_warm(self, sb: Sandbox) -> None:
        """A warm sandbox became `sb`: its notifications carry the new id (the substrate renamed the rest)."""
        if self.seccomp is not None:
            self.seccomp.rename(sb.warm_id, sb.id)

    def forget_warm(self, wid: str) -> None:
        if self.seccomp is not None:
            self.seccomp.unregister(wid)

    async def release(self, sid: str) -> None:
        """Before a sandbox's teardown: stop watching it, report what its last execs ran into."""
        if self.seccomp is not None:
            self.seccomp.unregister(sid)
        self.unwatch_activity(sid)
        self.guarded.discard(sid)
        if self.enabled:
            self.limits.flush(sid)
        self.limits.forget(sid)
        self.inflight.pop(sid, None)
        if self.files_audit is not None:
            await asyncio.to_thread(self.files_audit.remove, sid)

    async def unmark(self, sid: str) -> None:
        """Drop a sandbox's protected-path marks (a create undone before it was registered)."""
        if self.files_audit is not None:
            await asyncio.shield(asyncio.to_thread(self.files_audit.remove, sid))

    def forget(self, sid: str) -> None:
        self.log.forget(sid)

    @contextlib.contextmanager
    def executing(self, sid: str, cmd: str) -> Iterator[None]:
        """A command running in the sandbox: the context of the file events it causes."""
        token = object()
        running = self.inflight.setdefault(sid, {})
        running[token] = cmd
        try:
            yield
        finally:
            running.pop(token, None)
            if not running:
                self.inflight.pop(sid, None)

    def exec_done(self, sb: Sandbox, sub: Substrate, cmd: str) -> None:
        if self.enabled:  # later, with the other execs that end meanwhile: not the caller's wait
            self.limits.defer(sb, sub, cmd)

    async def state(self, sid: str) -> AuditState:
        """`corral.v1.sandbox.<id>.audit`: read what the audit sources hold for the sandbox now
        (fanotify queues, waiting seccomp notifications, file-event drops not yet reported), then
        publish all of its events so far and wait for JetStream's acks."""
        if self.files_audit is not None:
            self.files_audit.drain()
        if self.activity is not None:
            self.activity.drain(sid)
        if self.seccomp is not None:
            self.seccomp.drain(sid)
        if self.enabled:
            self.limits.flush(sid)
        pending = [t for t in self.annotating.get(sid, ()) if not t.done()]
        if pending:  # git-ref events being annotated: part of the record up to now
            await asyncio.wait(pending, timeout=10)
        return await self.log.sync(sid)

    # ------------------------------------------------------------------ watches

    async def watch_activity(self, sb: Sandbox, sub: Substrate, inline: bool = False) -> None:
        """Start reporting the sandbox's file activity (its root filesystem's superblock)."""
        if sub.guards_paths:  # the guest's guard reports it (started here unless its paths started it)
            if self.enabled and sb.id not in self.guarded:
                try:
                    await self._guard(sb, sub)
                except CorralError as e:
                    logs.kv(log, logging.WARNING, "file activity of this sandbox is not audited", sandbox=sb.id, error=e.message)
            return
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

    async def watch_run(self, info: SandboxInfo, root: str) -> Callable[[], None]:
        """Substrate.run_watcher: a one-shot run's file activity, tagged like a sandbox's."""
        self.run_infos[info.id] = info
        sid = info.id
        await self._add_activity(sid, root)

        def stop() -> None:
            self.unwatch_activity(sid)
            self.run_infos.pop(sid, None)
        return stop

    def unwatch_activity(self, sid: str) -> None:
        if self.activity is not None:
            self.activity.remove(sid)

    async def watch_files(self, sb: Sandbox, sub: Substrate) -> None:
        """Mark the sandbox's protected paths and canaries: on a root the host sees, in the node's
        fanotify group; in a guest, by the guest's own guard (`Substrate.guard_paths`)."""
        if not (sb.spec.protected_paths or sb.spec.canaries):
            return
        if sub.guards_paths:
            await self._guard(sb, sub)
            return
        root = sb.rootfs
        if self.files_audit is None or root is None:
            return
        decoys = [(m.path, m.decoy) for m in sb.masks]
        await asyncio.to_thread(self.files_audit.add, sb.id, root, list(sb.spec.protected_paths), list(sb.spec.canaries), decoys)

    async def _guard(self, sb: Sandbox, sub: Substrate) -> None:
        """A guest's guard: its protected paths and canaries, and (auditing) its file activity."""
        sid = sb.id
        activity = (self.file_events_rate, self.file_events_burst) if self.enabled else None
        await sub.guard_paths(sb, lambda o: self._on_guarded_open(sid, o), activity)
        self.guarded.add(sid)

    async def check_file_read(self, sb: Sandbox, path: str) -> None:
        """files.read: a protected path (by name or through links) is Forbidden, a canary is reported.
        A guest's guard sees what files.read opens there (links followed in the guest): here only
        a protected path named as such is refused, before the guest is asked."""
        if sb.rootfs is None:
            p = _norm_path(path)
            hit = next((_norm_path(t) for t in sb.spec.protected_paths if _under(p, _norm_path(t))), None)
        elif self.files_audit is None:
            return
        else:
            hit = await asyncio.to_thread(self.files_audit.check_read, sb.id, path)
        if hit is not None:
            self.emit(AuditEvent(**self.base(sb.id), kind="file", op="read", path=_norm_path(path), denied=True,
                                 detail={"protected": "1", "via": "files.read", "protected_path": hit}))
            raise Forbidden(f"{path} is protected in sandbox {sb.id}")
        canary = self.files_audit.canary_of(sb.id, path) if self.files_audit is not None and sb.rootfs is not None else None
        if canary is not None:
            self.emit(AuditEvent(**self.base(sb.id), kind="canary", op="read", path=canary,
                                 detail={"canary": "1", "via": "files.read"}))

    # ------------------------------------------------------------------ source callbacks

    def _on_denied_syscall(self, sid: str, pid: int, comm: str, name: str, detail: dict[str, str]) -> None:
        self.emit(AuditEvent(**self.base(sid), kind="syscall", syscall=name, pid=pid, comm=comm,
                             denied=True, op=detail.get("request", "") if name == "ioctl" else "", detail=detail))

    def _on_syscall_flood(self, sid: str, last: str, detail: dict[str, str]) -> None:
        """The sandbox's denied/watched calls outran the listener's rate: it is being slowed down."""
        self.emit(AuditEvent(**self.base(sid), kind="syscall", syscall=last, op="throttled", denied=True, detail=detail))

    def _on_watched_syscall(self, sid: str, pid: int, comm: str, kind: str, op: str, target: str, denied: bool,
                            detail: dict[str, str]) -> None:
        """A connect/sendto to a non-loopback address (kind "net"), or a signal to a process
        outside the caller's exec (kind "signal"). For a sandbox with an egress allowlist, a
        destination it allows is marked `allowed` and one it does not `denied` (the packet
        filter drops it)."""
        if kind == "net" and self.egress_allows is not None:
            try:
                verdict = self.egress_allows(sid, detail.get("host", ""), int(detail.get("port", "0")))
            except ValueError:
                verdict = False
            if verdict is not None:
                denied = not verdict
                if verdict:
                    detail = {**detail, "allowed": "1"}
        self.emit(AuditEvent(**self.base(sid), kind=kind, op=op, target=target, pid=pid, comm=comm,  # type: ignore[arg-type]
                             syscall=op, denied=denied, detail=detail))

    def _on_file_event(self, sid: str, pid: int, kind: str, path: str, denied: bool) -> None:
        detail = {"protected": "1"} if kind == "file" else {"canary": "1"}
        self.emit(AuditEvent(**self.base(sid), kind=kind, op="open", path=path, pid=pid,  # type: ignore[arg-type]
                             comm=comm_of(pid), denied=denied, detail=detail))

    def _on_guarded_open(self, sid: str, o: GuardedOpen) -> None:
        """A guest guard's report: as the node's fanotify groups report a container's opens of
        guarded paths (`_on_file_event`; for the node's own files.read there, as
        `check_file_read` does) and its file activity (`_on_file_activity`)."""
        if o.kind in ("open", "write", "exec"):
            self._on_file_activity(sid, o.kind, o.path, o.pid, {}, comm=o.comm)
            return
        if o.kind in ("dropped", "overflow"):
            n = int(o.path) if o.path.isdigit() else 0
            reason = "rate_limit" if o.kind == "dropped" else "queue_overflow"
            self._on_file_activity(sid, "dropped", "", 0, {"dropped": str(n), "reason": reason})
            return
        kind = "file" if o.kind == "p" else "canary"
        detail = {"protected": "1"} if o.kind == "p" else {"canary": "1"}
        if o.who == "read":
            if o.kind == "p":
                detail["protected_path"] = o.path
            self.emit(AuditEvent(**self.base(sid), kind=kind, op="read", path=o.path, denied=o.denied,  # type: ignore[arg-type]
                                 detail={**detail, "via": "files.read"}))
            return
        self.emit(AuditEvent(**self.base(sid), kind=kind, op="open", path=o.path, pid=o.pid,  # type: ignore[arg-type]
                             comm=o.comm, denied=o.denied, detail=detail))

    def _on_permission_overflow(self, sids: list[str]) -> None:
        """The protected-path group's queue overflowed: whose events were lost is unknown, so every
        sandbox it watches has a gap."""
        for sid in sids:
            self.log.loss(sid, "fanotify queue overflow (protected paths)", 0)

    def _on_file_activity(self, sid: str, op: str, path: str, pid: int, detail: dict[str, str], comm: str | None = None) -> None:
        """`comm` given: the process is a guest's (its pid is not the host's to look up)."""
        if op == "dropped":  # rate-limited or a kernel queue overflow: this sandbox's record has a hole
            reason = LOSS_REASONS.get(detail.get("reason", ""), f"file events dropped ({detail.get('reason', '')})")
            try:
                n = int(detail.get("dropped", "0"))
            except ValueError:
                n = 0
            self.log.loss(sid, reason, n)
        if op == "open" and "/.git/refs/heads/" in path and comm is None:
            self._annotate_git_ref(sid, op, path, pid, detail)
            return
        self.emit(AuditEvent(**self.base(sid), kind="file", op=op, path=path, pid=pid,
                             comm=comm if comm is not None else comm_of(pid) if pid else "", detail=detail))

    def _annotate_git_ref(self, sid: str, op: str, path: str, pid: int, detail: dict[str, str]) -> None:
        """A git ref read, reported with the branch HEAD is on, read in a thread: .git/HEAD may
        carry a protected-path mark whose permission event this very loop must answer."""
        # the git process's argv, and the commands in flight (in case it has exited already)
        ctx = {"cmdline": _cmdline(pid), "exec_cmd": "\n".join(self.inflight.get(sid, {}).values())[:2000]}
        comm = comm_of(pid)

        async def annotate() -> None:
            extra = await asyncio.to_thread(self._git_ref_detail, sid, path)
            self.emit(AuditEvent(**self.base(sid), kind="file", op=op, path=path, pid=pid, comm=comm,
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

    def _git_ref_detail(self, sid: str, path: str) -> dict[str, str]:
        """A git process read a branch's ref file: which branch, which one HEAD is on, and the git
        command line, so the monitor can tell `git log other-branch` from ordinary work on HEAD's
        branch (git_history rule). Read from the sandbox's root (confined) while it is fresh."""
        repo, ref = path.split("/.git/refs/heads/", 1)
        out = {"git_ref": f"refs/heads/{ref}"}
        sb, sub = self.table.sandboxes.get(sid), self.table.substrate_of.get(sid)
        root = sub.audit_root(sb) if sb is not None and sub is not None else None
        if root and sub is not None and sub.name != "docker":
            try:
                head, _ = confine.read(root, f"{repo}/.git/HEAD", 4096)
                out["git_head"] = head.decode(errors="replace").strip().removeprefix("ref:").strip()
            except Exception:  # no git repository (or no readable HEAD): the info has no git_head
                pass
        return out
