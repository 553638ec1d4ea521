"""Denied syscalls, observed: the node-agent is the seccomp-notify supervisor of its sandboxes.

The container substrate writes the denied calls (oci.DENIED_SYSCALLS, the FIEMAP/GETFSMAP ioctls,
clone with namespace flags) as SCMP_ACT_NOTIFY with `listenerPath` = this listener's unix socket
and `listenerMetadata` = the sandbox id. runc connects at container start and sends the notify fd
(SCM_RIGHTS) with the OCI state JSON. For each notification we answer EPERM (the call never runs)
and report (sandbox id, host pid, syscall name, detail) to a callback, which the agent turns into
an AuditEvent of kind "syscall".

Failure modes: runc sends a sandbox's notify fd once, at start; the container substrate hands a
copy to the sandbox's init to hold (fd 6, unreachable from inside: init is non-dumpable). While the
agent is down, notified calls of its sandboxes wait (nothing answers them, nothing runs them); an
agent that restarts and adopts a sandbox takes the fd back from its init (pidfd_getfd) and answers,
audits and continues them as before. A sandbox whose init holds none (its notify fd never reached
the listener) fails every notified call with ENOSYS, unaudited, until it is recreated. Fails
closed, never open.

Watched calls (oci.WATCHED_SYSCALLS) are observed, not denied: connect/sendto (the destination is
read from the caller's memory through /proc/<pid>/mem while it waits) and kill/tkill/tgkill/
pidfd_send_signal (the target is looked up in the sandbox's own /proc). The call then continues
(SECCOMP_USER_NOTIF_FLAG_CONTINUE). Reported: connects/sends to a non-loopback address (kind "net":
they fail with ENETUNREACH, the sandbox has only `lo`, but the attempt is the evidence) and signals
to processes outside the caller's exec (another exec's cgroup, or pid 1 = corral-init; kind
"signal"). Signals to init are denied (EPERM). The argument is read before the kernel re-reads it,
so a racing thread could change it in between: the record is best effort, the isolation (no
network, init protected by the pid namespace) does not depend on it. The
filter accepts only the native ABI (oci.ARCHITECTURES): a call through i386 or x32 kills the
caller (SIGSYS) before it runs, so none reaches the listener uninspected; sendmsg/sendmmsg are
not watched and io_uring is refused.

Floods are throttled at the sandbox: each sandbox's notifications are answered at most
NOTIFY_RATE per second (bursts of NOTIFY_BURST); past that its notify fd is not read for
THROTTLE_PAUSE_S, so its notified calls wait in the kernel (the flooder slows down, the node-agent
and the other sandboxes do not), and a "throttled" report says so (at most once a second per
sandbox). Every call is still answered and reported: throttling loses no audit."""
from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable

from corral_common import metrics

from .. import oci
from .budgets import (
    INOTIFY_PER_SANDBOX,
    INOTIFY_RECOUNT_S,
    NOTIFY_RATE,
    THROTTLE_PAUSE_S,
    THROTTLE_REPORT_S,
    Bucket,
    count_inotify,
    raise_inotify_limit,
)
from .netcalls import network_call

log = logging.getLogger("corral.node.seccomp")

SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102
NOTIF = struct.Struct("=QIIiIQ6Q")  # seccomp_notif: id, pid, flags, seccomp_data{nr, arch, ip, args[6]} (80 bytes)
RESP = struct.Struct("=QqiI")  # seccomp_notif_resp: id, val, error, flags (24 bytes)
assert NOTIF.size == 80 and RESP.size == 24

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000

# x86_64 numbers of every syscall the policy notifies on (checked against <sys/syscall.h>)
X86_64_SYSCALLS: dict[int, str] = {
    165: "mount", 166: "umount2", 155: "pivot_root", 429: "move_mount", 428: "open_tree", 430: "fsopen",
    432: "fsmount", 433: "fspick", 431: "fsconfig", 442: "mount_setattr", 308: "setns", 272: "unshare",
    101: "ptrace", 310: "process_vm_readv", 311: "process_vm_writev", 321: "bpf", 298: "perf_event_open",
    250: "keyctl", 248: "add_key", 249: "request_key", 323: "userfaultfd", 304: "open_by_handle_at",
    303: "name_to_handle_at", 246: "kexec_load", 320: "kexec_file_load", 175: "init_module", 313: "finit_module",
    176: "delete_module", 167: "swapon", 168: "swapoff", 169: "reboot", 163: "acct", 164: "settimeofday",
    227: "clock_settime", 305: "clock_adjtime", 159: "adjtimex", 172: "iopl", 173: "ioperm", 179: "quotactl",
    212: "lookup_dcookie", 103: "syslog", 153: "vhangup", 180: "nfsservctl", 300: "fanotify_init",
    438: "pidfd_getfd", 312: "kcmp", 134: "uselib", 16: "ioctl", 56: "clone", 435: "clone3",
    42: "connect", 44: "sendto", 62: "kill", 200: "tkill", 234: "tgkill", 424: "pidfd_send_signal",
    253: "inotify_init", 294: "inotify_init1",
}
WATCHED = {"connect", "sendto", "kill", "tkill", "tgkill", "pidfd_send_signal", "inotify_init", "inotify_init1"}
# their i386 numbers (socketcall carries connect/sendto on old i386 libcs), and x32 = x86_64 | bit 30
I386_WATCHED = {102, 362, 369, 37, 238, 270, 424}
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
IOCTL_NAMES = {v: k for k, v in oci.DENIED_IOCTLS.items()}

WATCHED_CALLS = metrics.counter("corral_seccomp_watched_total", "Watched syscalls (connect, sendto, kill, ...) inspected and continued",
                                ("node", "syscall"))
THROTTLED = metrics.counter("corral_seccomp_throttled_total",
                            "Times a sandbox's denied-syscall notifications outran NOTIFY_RATE and its notify fd was paused",
                            ("node",))
NOTIFIED = metrics.counter("corral_seccomp_notifications_total", "Denied syscalls seen by the seccomp-notify listener", ("node",))

# (sandbox id, host pid, comm, syscall name, detail)
Callback = Callable[[str, int, str, str, dict[str, str]], None]
# (sandbox id, host pid, comm, kind "net"/"signal", op (the syscall), target, denied, detail)
WatchCallback = Callable[[str, int, str, str, str, str, bool, dict[str, str]], None]


def syscall_name(arch: int, nr: int) -> str:
    if arch == AUDIT_ARCH_X86_64 and not nr & X32_SYSCALL_BIT:
        return X86_64_SYSCALLS.get(nr, f"syscall_{nr}")
    return f"syscall_{nr & ~X32_SYSCALL_BIT}"


def describe(arch: int, nr: int, args: tuple[int, ...]) -> tuple[str, dict[str, str]]:
    name = syscall_name(arch, nr)
    detail: dict[str, str] = {}
    if arch != AUDIT_ARCH_X86_64 or nr & X32_SYSCALL_BIT:
        detail["arch"] = "x32" if arch == AUDIT_ARCH_X86_64 else ("i386" if arch == AUDIT_ARCH_I386 else hex(arch))
    if name == "ioctl":
        req = args[1] & 0xFFFFFFFF
        detail["fd"] = str(args[0] & 0xFFFFFFFF)
        detail["request"] = IOCTL_NAMES.get(req, hex(req))
        detail["ioctl"] = detail["request"]
    elif name in ("clone", "unshare"):
        flags = args[0] & 0xFFFFFFFF
        detail["flags"] = hex(flags)
        names = [n for n, v in oci.CLONE_NS_FLAGS.items() if flags & v]
        if names:
            detail["namespaces"] = ",".join(names)
    elif name in ("ptrace",):
        detail["request"] = str(args[0])
        detail["target_pid"] = str(args[1] & 0xFFFFFFFF)
    elif name in ("process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "setns"):
        detail["arg0"] = str(args[0] & 0xFFFFFFFF)
    else:
        for i in range(3):
            detail[f"arg{i}"] = hex(args[i])
    return name, detail


def _comm(pid: int) -> str:
    """The process's name now ("" once it is gone). Plain fd calls: a file event's comm is read
    for each of the ~100 opens of a function call's Python, and `open()`'s layers of buffered
    text objects cost three times the system calls."""
    try:
        fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 64).decode(errors="replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


ThrottleCallback = Callable[[str, str, dict[str, str]], None]  # sandbox, last call, detail


class SeccompListener:
    """One unix socket per node; one notify fd per container, read on the event loop."""

    def __init__(self, path: str, on_denied: Callback, node: str = "", on_watched: WatchCallback | None = None,
                 on_throttled: ThrottleCallback | None = None):
        self.path = path
        self.on_denied = on_denied
        self.on_watched = on_watched
        self.on_throttled = on_throttled
        self.buckets: dict[str, Bucket] = {}
        self.inotify: dict[str, tuple[int, float]] = {}  # sandbox -> (instances held, when last counted)
        self.node = node
        self.sock: socket.socket | None = None
        self.fds: dict[str, int] = {}  # sandbox id -> notify fd
        self.aliases: dict[str, str] = {}  # warm-pool id -> claimed id, for handshakes not yet in
        self.task: asyncio.Task | None = None
        self.handshakes: set[asyncio.Task] = set()

    async def start(self) -> None:
        raise_inotify_limit()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.bind(self.path)
        os.chmod(self.path, 0o600)
        s.listen(256)
        s.setblocking(False)
        self.sock = s
        self.task = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            t = asyncio.create_task(self._handshake(conn))
            self.handshakes.add(t)
            t.add_done_callback(self.handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        """Read runc's message: the OCI container process state (JSON) and the notify fd."""
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        data = b""
        try:
            conn.setblocking(False)
            deadline = loop.time() + 10
            while True:
                fut = loop.create_future()
                loop.add_reader(conn.fileno(), lambda: fut.done() or fut.set_result(None))
                try:
                    await asyncio.wait_for(fut, max(0.01, deadline - loop.time()))
                finally:
                    loop.remove_reader(conn.fileno())
                try:
                    chunk, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
                except BlockingIOError:
                    continue
                fds.extend(got)
                if not chunk:
                    break
                data += chunk
                if fds and _complete_json(data):
                    break
            state = json.loads(data) if data else {}
            sid = str(state.get("metadata") or "")
            fd_names = state.get("fds") or []
            idx = fd_names.index("seccompFd") if "seccompFd" in fd_names else 0
            if not sid or len(fds) <= idx:
                raise ValueError(f"bad seccomp handshake (metadata {sid!r}, {len(fds)} fd(s))")
            nfd = fds.pop(idx)
            self.register(sid, nfd)
        except Exception as e:
            log.warning("seccomp listener handshake failed", extra={"fields": {"error": repr(e)}})
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    def rename(self, old: str, new: str) -> None:
        """A claimed warm-pool sandbox's denied syscalls are reported under its claimed id (runc
        sent the fd with the internal id as metadata); a handshake still in flight is re-keyed
        when it lands."""
        nfd = self.fds.pop(old, None)
        if nfd is None:
            self.aliases[old] = new
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(nfd)
        self.fds[new] = nfd
        if old in self.buckets:
            self.buckets[new] = self.buckets.pop(old)
        if old in self.inotify:
            self.inotify[new] = self.inotify.pop(old)
        loop.add_reader(nfd, self._on_ready, new, nfd)

    def register(self, sid: str, nfd: int) -> None:
        sid = self.aliases.pop(sid, sid)
        old = self.fds.pop(sid, None)
        if old is not None:
            self._close(old)
        os.set_inheritable(nfd, False)
        self.fds[sid] = nfd
        asyncio.get_running_loop().add_reader(nfd, self._on_ready, sid, nfd)

    def _throttled(self, sid: str, nfd: int) -> bool:
        """Spend one of the sandbox's tokens; with none left, stop reading its fd for a while."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        b = self.buckets.get(sid)
        if b is None:
            b = self.buckets[sid] = Bucket(now)
        if b.take(now):
            return False
        loop.remove_reader(nfd)
        loop.call_later(THROTTLE_PAUSE_S, self._resume, sid, nfd)
        b.pauses += 1
        THROTTLED.labels(self.node).inc()
        if self.on_throttled is not None and now - b.reported >= THROTTLE_REPORT_S:
            detail = {"rate_per_s": f"{NOTIFY_RATE:g}", "pause_ms": f"{THROTTLE_PAUSE_S * 1000:g}", "pauses": str(b.pauses)}
            b.reported, b.pauses = now, 0
            try:
                self.on_throttled(sid, b.last, detail)
            except Exception:
                log.exception("seccomp audit callback failed")
        return True

    def _resume(self, sid: str, nfd: int) -> None:
        if self.fds.get(sid) == nfd:  # still this sandbox's (not dropped, renamed or replaced)
            asyncio.get_running_loop().add_reader(nfd, self._on_ready, sid, nfd)

    def _on_ready(self, sid: str, nfd: int) -> None:
        if not self._throttled(sid, nfd):
            self._serve(sid, nfd)

    def _serve(self, sid: str, nfd: int) -> None:
        """Answer and report one waiting notification, if there is one."""
        p = select.poll()
        p.register(nfd, select.POLLIN)
        ready = p.poll(0)
        revents = ready[0][1] if ready else 0
        if not revents & select.POLLIN:
            if revents & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                # every process of the sandbox is gone: the filter has no users left
                self._drop(sid, nfd)
            return
        buf = bytearray(NOTIF.size)
        try:
            fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                return  # the caller died between poll and recv
            # the filter is gone (every process of the sandbox exited): POLLHUP, stop watching
            self._drop(sid, nfd)
            return
        nid, pid, _flags, nr, arch, _ip, *args = NOTIF.unpack(bytes(buf))
        if arch == AUDIT_ARCH_X86_64 and X86_64_SYSCALLS.get(nr) in WATCHED:
            self._watched(sid, nfd, nid, pid, X86_64_SYSCALLS[nr], tuple(args))
            return
        if _foreign_watched(arch, nr):
            # the same calls from a 32-bit or x32 binary: let them run, not inspected
            try:
                fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE))
            except OSError:
                pass
            return
        comm = _comm(pid)  # while the caller still waits for us
        try:
            fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, RESP.pack(nid, 0, -errno.EPERM, 0))
        except OSError:
            pass  # the caller was killed meanwhile
        name, detail = describe(arch, nr, tuple(args))
        NOTIFIED.labels(self.node).inc()
        if (b := self.buckets.get(sid)) is not None:
            b.last = name
        try:
            self.on_denied(sid, pid, comm, name, detail)
        except Exception:
            log.exception("seccomp audit callback failed")

    def _inotify(self, sid: str, nfd: int, nid: int, pid: int, name: str) -> None:
        """A new inotify instance: granted while the sandbox holds fewer than INOTIFY_PER_SANDBOX,
        else EMFILE (what the kernel answers at its own limit), reported. Instances granted are
        counted; the sandbox's real holdings (closes included) are recounted from its /proc at
        most once a second, and only once the count reaches the cap."""
        now = time.monotonic()
        held, counted_at = self.inotify.get(sid, (0, 0.0))
        if held >= INOTIFY_PER_SANDBOX and now - counted_at >= INOTIFY_RECOUNT_S:
            held, counted_at = count_inotify(pid), now
        refused = held >= INOTIFY_PER_SANDBOX
        self.inotify[sid] = (held if refused else held + 1, counted_at)
        try:
            fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, RESP.pack(nid, 0, -errno.EMFILE, 0) if refused
                        else RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE))
        except OSError:
            pass
        WATCHED_CALLS.labels(self.node, name).inc()
        if refused and self.on_watched is not None:
            try:
                self.on_watched(sid, pid, _comm(pid), "syscall", name, "", True,
                                {"limit": str(INOTIFY_PER_SANDBOX), "reason": "inotify instances per sandbox"})
            except Exception:
                log.exception("seccomp audit callback failed")

    def _watched(self, sid: str, nfd: int, nid: int, pid: int, name: str, args: tuple[int, ...]) -> None:
        """Look at a watched call while its caller waits, let it continue (or deny a signal to init),
        then report it if it is a network attempt or a signal to a foreign process."""
        if name in ("inotify_init", "inotify_init1"):
            self._inotify(sid, nfd, nid, pid, name)
            return
        report: tuple[str, str, bool, dict[str, str]] | None = None
        try:
            if name in ("connect", "sendto"):
                report = network_call(pid, name, args)
            else:
                report = _signal(pid, name, args)
        except Exception:
            log.exception("could not inspect a watched syscall")
        denied = report is not None and report[2]
        comm = _comm(pid) if report is not None else ""
        valid = _id_valid(nfd, nid)  # the memory we read was the waiting caller's
        try:
            if denied:
                fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, RESP.pack(nid, 0, -errno.EPERM, 0))
            else:
                fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE))
        except OSError:
            pass  # the caller was killed meanwhile
        WATCHED_CALLS.labels(self.node, name).inc()
        if report is None or not valid or self.on_watched is None:
            return
        kind, target, denied, detail = report
        try:
            self.on_watched(sid, pid, comm, kind, name, target, denied, detail)
        except Exception:
            log.exception("seccomp audit callback failed")

    def drain(self, sid: str) -> None:
        """Answer (and report) every notification this sandbox has waiting now: the grader's
        consistent point (agent `audit` op) must not race the loop's next turn."""
        for _ in range(1000):
            nfd = self.fds.get(sid)
            if nfd is None:
                return
            p = select.poll()
            p.register(nfd, select.POLLIN)
            ready = p.poll(0)
            if not ready or not ready[0][1] & select.POLLIN:
                return
            self._serve(sid, nfd)  # not throttled: the grader waits on this

    def _drop(self, sid: str, nfd: int) -> None:
        if self.fds.get(sid) == nfd:
            del self.fds[sid]
            self.buckets.pop(sid, None)
            self.inotify.pop(sid, None)
        self._close(nfd)

    def _close(self, nfd: int) -> None:
        try:
            asyncio.get_running_loop().remove_reader(nfd)
        except (RuntimeError, ValueError):
            pass
        try:
            os.close(nfd)
        except OSError:
            pass

    def unregister(self, sid: str) -> None:
        self.aliases.pop(sid, None)
        self.buckets.pop(sid, None)
        self.inotify.pop(sid, None)
        nfd = self.fds.pop(sid, None)
        if nfd is not None:
            self._close(nfd)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for sid in list(self.fds):
            self.unregister(sid)
        if self.sock is not None:
            self.sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def comm_of(pid: int) -> str:
    return _comm(pid)


def _complete_json(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def _id_valid(nfd: int, nid: int) -> bool:
    try:
        fcntl.ioctl(nfd, SECCOMP_IOCTL_NOTIF_ID_VALID, struct.pack("=Q", nid))
        return True
    except OSError:
        return False


def _signame(sig: int) -> str:
    import signal as _s

    try:
        return _s.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


def _inner(pid: int, rel: str) -> str:
    """A file of the sandbox's own /proc (pids as the sandbox sees them), via the caller's root."""
    with open(f"/proc/{pid}/root/proc/{rel}") as f:
        return f.read()


def _nspid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def _signal(pid: int, name: str, args: tuple[int, ...]) -> tuple[str, str, bool, dict[str, str]] | None:
    """A signal to a process outside the caller's exec (its exec cgroup), or to init."""
    to_i32 = lambda v: struct.unpack("=i", struct.pack("=I", v & 0xFFFFFFFF))[0]  # noqa: E731
    if name == "pidfd_send_signal":
        sig = to_i32(args[1])
        with open(f"/proc/{pid}/fdinfo/{args[0] & 0xFFFFFFFF}") as f:
            host_target = next((int(x.split()[1]) for x in f if x.startswith("Pid:")), 0)
        if host_target <= 0:
            return None
        with open(f"/proc/{host_target}/status") as f:
            target = next((int(x.split()[-1]) for x in f if x.startswith("NSpid:")), 0)
    elif name == "tgkill":
        target, sig = to_i32(args[1]), to_i32(args[2])
    else:
        target, sig = to_i32(args[0]), to_i32(args[1])
    detail = {"signal": _signame(sig), "syscall": name}
    if name == "kill" and target == -1:
        return "signal", "-1", False, {**detail, "scope": "every process"}
    if name == "kill" and target < -1:
        detail["process_group"] = str(-target)
        target = -target
    if target <= 0:
        return None  # 0: the caller's own process group
    if target == 1:
        return "signal", "1", True, {**detail, "target_comm": "corral-init", "init": "1"}
    me = _nspid(pid)
    if target == me:
        return None
    try:
        mine, theirs = _inner(pid, f"{me}/cgroup"), _inner(pid, f"{target}/cgroup")
    except OSError:
        return None  # no such process: nothing was signalled
    if mine == theirs:
        return None  # started by the same exec
    try:
        detail["target_comm"] = _inner(pid, f"{target}/comm").strip()
        detail["target_cmdline"] = _inner(pid, f"{target}/cmdline").replace("\0", " ").strip()[:200]
    except OSError:
        pass
    return "signal", str(target), False, detail


def _foreign_watched(arch: int, nr: int) -> bool:
    """A watched call (connect, kill, ...) through the i386 or x32 ABI: continued uninspected."""
    if arch == AUDIT_ARCH_I386:
        return nr in I386_WATCHED
    if arch == AUDIT_ARCH_X86_64 and nr & X32_SYSCALL_BIT:
        return X86_64_SYSCALLS.get(nr & ~X32_SYSCALL_BIT) in WATCHED
    return False
