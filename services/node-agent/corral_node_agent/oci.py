"""The OCI runtime spec (config.json) of a container sandbox, and its seccomp policy.

Everything a sandbox may do is decided here: namespaces, no capabilities, no_new_privs, a
read-only view of /sys and /proc's dangerous corners, cgroup limits, and a default-deny seccomp
filter: an allowlist (ALLOWED_SYSCALLS), the syscalls used to escape, snoop or read files
sideways (by handle, by block map) denied and reported, and everything else (new syscalls
included) refused with EPERM. The same policy serves every substrate (container, function, docker)."""
from __future__ import annotations

import functools
import platform
import resource
from typing import Any

from corral_common.contract.messages import HARNESS_UID

EPERM = 1
ENOSYS = 38

# Denied outright: escapes (mount, namespaces, kernel modules), snooping (ptrace, process_vm_*,
# perf, bpf), sideways file access (by handle), kernel keyrings and userfaultfd (exploit helpers).
DENIED_SYSCALLS = [
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fspick", "fsconfig",
    "mount_setattr", "setns", "unshare", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
    "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "quotactl", "lookup_dcookie", "syslog", "vhangup", "nfsservctl", "fanotify_init",
    "pidfd_getfd", "kcmp", "uselib",
]

# ioctls that map a file's blocks (reading protected data from the raw device by block address)
FS_IOC_FIEMAP = 0xC020660B
FS_IOC_GETFSMAP = 0xC0C0583B
DENIED_IOCTLS = {"FS_IOC_FIEMAP": FS_IOC_FIEMAP, "FS_IOC_GETFSMAP": FS_IOC_GETFSMAP}

# Observed, not denied (with a listener only): the agent reads the call's arguments and lets it
# continue (SECCOMP_USER_NOTIF_FLAG_CONTINUE): network attempts and signals (audit/seccomp.py).
# sendto only with a destination address (a send on a connected socket carries none); signal 0
# (an existence probe) is not a signal.
WATCHED_SYSCALLS: list[dict[str, Any]] = [
    {"names": ["connect"]},
    {"names": ["sendto"], "args": [{"index": 4, "value": 0, "op": "SCMP_CMP_NE"}]},
    {"names": ["kill", "tkill", "pidfd_send_signal"], "args": [{"index": 1, "value": 0, "op": "SCMP_CMP_NE"}]},
    {"names": ["tgkill"], "args": [{"index": 2, "value": 0, "op": "SCMP_CMP_NE"}]},
    # inotify instances count per uid: the agent caps each sandbox's (audit/seccomp.py
    # INOTIFY_PER_SANDBOX), also where a sandbox has no user namespace (CORRAL_USERNS=off) and
    # its root's budget would be host root's
    {"names": ["inotify_init", "inotify_init1"]},
]

# What a process without capabilities may call: the unconditional allowlist of Docker's default
# profile (moby profiles/seccomp/default.json, the rules that need no capability), minus
# io_uring (its submissions bypass this filter and the audit; refused with ENOSYS below, so
# runtimes fall back to plain syscalls) and minus what DENIED_SYSCALLS reports instead. Names a
# given architecture lacks (the *32 and *_time64 forms on x86_64) are skipped by runc.
ALLOWED_SYSCALLS = sorted({
    "accept", "accept4", "access", "alarm", "bind", "brk", "capget", "capset", "chdir", "chmod", "chown",
    "chown32", "clock_adjtime64", "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range", "connect", "copy_file_range", "creat",
    "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
    "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "execve", "execveat", "exit",
    "exit_group", "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate", "fanotify_mark",
    "fchdir", "fchmod", "fchmodat", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync",
    "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64",
    "fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex", "futex_time64", "futex_waitv",
    "futimesat", "getcpu", "getcwd", "getdents", "getdents64", "getegid", "getegid32", "geteuid",
    "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32", "getitimer", "getpeername", "getpgid",
    "getpgrp", "getpid", "getppid", "getpriority", "getrandom", "getresgid", "getresgid32", "getresuid",
    "getresuid32", "getrlimit", "get_robust_list", "getrusage", "getsid", "getsockname", "getsockopt",
    "get_thread_area", "gettid", "gettimeofday", "getuid", "getuid32", "getxattr", "inotify_add_watch",
    "inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl", "io_destroy", "io_getevents",
    "io_pgetevents", "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup", "io_submit", "ipc",
    "kill", "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown", "lchown32",
    "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr", "_llseek", "lremovexattr", "lseek",
    "lsetxattr", "lstat", "lstat64", "madvise", "membarrier", "memfd_create", "memfd_secret", "mincore",
    "mkdir", "mkdirat", "mknod", "mknodat", "mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect",
    "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64", "mq_timedsend",
    "mq_timedsend_time64", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv", "msgsnd", "msync", "munlock",
    "munlockall", "munmap", "nanosleep", "newfstatat", "_newselect", "open", "openat", "openat2", "pause",
    "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll",
    "ppoll", "ppoll_time64", "prctl", "pread64", "preadv", "preadv2", "prlimit64", "process_mrelease",
    "pselect6", "pselect6_time64", "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink",
    "readlinkat", "readv", "recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages",
    "removexattr", "rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction",
    "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler", "sched_rr_get_interval",
    "sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr", "sched_setparam",
    "sched_setscheduler", "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop",
    "semtimedop_time64", "send", "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto", "setfsgid",
    "setfsgid32", "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setitimer",
    "setpgid", "setpriority", "setregid", "setregid32", "setresgid", "setresgid32", "setresuid",
    "setresuid32", "setreuid", "setreuid32", "setrlimit", "set_robust_list", "setsid", "setsockopt",
    "set_thread_area", "set_tid_address", "setuid", "setuid32", "setxattr", "shmat", "shmctl", "shmdt",
    "shmget", "shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn", "socketcall",
    "socketpair", "splice", "stat", "stat64", "statfs", "statfs64", "statx", "symlink", "symlinkat", "sync",
    "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time", "timer_create", "timer_delete",
    "timer_getoverrun", "timer_gettime", "timer_gettime64", "timer_settime", "timer_settime64",
    "timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "times",
    "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname", "unlink", "unlinkat", "utime",
    "utimensat", "utimensat_time64", "utimes", "vfork", "vmsplice", "wait4", "waitid", "waitpid", "write",
    "writev",
    # x86 only (Docker's per-architecture rules)
    "arch_prctl", "modify_ldt",
} - set(DENIED_SYSCALLS))
# personality(2) only with the values Docker allows: PER_LINUX, PER_LINUX32, UNAME26 forms, and
# 0xffffffff (the query)
ALLOWED_PERSONALITIES = [0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF]
AF_VSOCK = 40  # socket(2) in any family but vsock (the host's hypervisor sockets)
IO_URING = ["io_uring_setup", "io_uring_enter", "io_uring_register"]
LOW32 = 0xFFFFFFFF  # ioctl's request is an int: the kernel ignores the upper half, so must the filter

# The filter accepts the host's native ABI only: syscalls through another (i386's int 0x80,
# x32) fail as a bad architecture, so no rule has to be right twice (i386 passes connect and
# sendto through socketcall, which the watch cannot read) and libseccomp compiles one filter,
# not five: runc run takes ~27 ms with it against ~49 ms with x86_64+x86+x32+aarch64+arm
# (measured on this machine; the allow-by-default profile before it: ~24 ms).
ARCHITECTURES = {"x86_64": ["SCMP_ARCH_X86_64"], "aarch64": ["SCMP_ARCH_AARCH64"]}.get(platform.machine(), ["SCMP_ARCH_X86_64"])

CLONE_NS_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


def allow_ioctls(denied: list[int]) -> list[tuple[int, int]]:
    """Every 32-bit ioctl request but `denied`, as (mask, value) pairs for SCMP_CMP_MASKED_EQ
    (request & mask == value): the prefixes, from the top bit down, that no denied request
    shares. Only the low 32 bits are compared, as the kernel does; 31 pairs per denied request."""
    out: list[tuple[int, int]] = []

    def walk(bit: int, prefix: int, mask: int, within: list[int]) -> None:
        if not within:
            out.append((mask, prefix))
            return
        if bit < 0:
            return  # a denied request itself
        for b in (0, 1):
            p = prefix | (b << bit)
            walk(bit - 1, p, mask | (1 << bit), [v for v in within if (v >> bit) & 1 == b])

    walk(31, 0, 0, sorted({v & LOW32 for v in denied}))
    return out


def seccomp_profile(listener_path: str | None = None, metadata: str = "") -> dict[str, Any]:
    """The seccomp policy. With `listener_path` (the node-agent's seccomp-notify socket) the
    denied calls are SCMP_ACT_NOTIFY: runc hands the notify fd to that socket, the agent answers
    EPERM and records each attempt (audit/seccomp.py); `metadata` (the sandbox id) comes back with
    the fd. Without it (docker, tests) they are plain SCMP_ACT_ERRNO(EPERM). Calls on no list
    fail with EPERM, unreported (as under Docker's profile). A new dict each call; its rules are
    shared between calls and must not be changed."""
    profile: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": ARCHITECTURES,
        "syscalls": _seccomp_rules(bool(listener_path)),
    }
    if listener_path:
        profile["listenerPath"] = listener_path
        profile["listenerMetadata"] = metadata
    return profile


@functools.cache
def _seccomp_rules(notify: bool) -> list[dict[str, Any]]:
    """The profile's rules, made once per kind (building them walks every denied ioctl: ~1 ms,
    on each function call's path)."""
    deny: dict[str, Any] = ({"action": "SCMP_ACT_NOTIFY"} if notify
                            else {"action": "SCMP_ACT_ERRNO", "errnoRet": EPERM})
    ns_mask = 0
    for flag in CLONE_NS_FLAGS.values():
        ns_mask |= flag
    # A syscall's rules must not overlap: runc's libseccomp lets an unconditional allow win over
    # a conditional deny or notify. So ioctl is allowed for every request but the denied ones
    # (allow_ioctls), and a watched call is allowed exactly where its watch does not apply.
    watched = {n for r in WATCHED_SYSCALLS for n in r["names"]} if notify else set()
    rules: list[dict[str, Any]] = [
        {"names": [n for n in ALLOWED_SYSCALLS if n not in watched and n != "ioctl"], "action": "SCMP_ACT_ALLOW"},
        *({"names": ["ioctl"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 1, "value": mask, "valueTwo": value,
                                                                     "op": "SCMP_CMP_MASKED_EQ"}]}
          for mask, value in allow_ioctls(list(DENIED_IOCTLS.values()))),
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"}]},
        *({"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]}
          for v in ALLOWED_PERSONALITIES),
        # clone without a namespace flag runs; with one it is denied and reported
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": ns_mask, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": DENIED_SYSCALLS, **deny},
        # clone3 takes its flags in a struct seccomp cannot read: answer ENOSYS so libc falls back
        # to clone(2), whose flags we can check; io_uring likewise falls back to plain syscalls
        {"names": ["clone3", *IO_URING], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    for value in DENIED_IOCTLS.values():
        rules.append({
            "names": ["ioctl"], **deny,
            "args": [{"index": 1, "value": LOW32, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    for flag in CLONE_NS_FLAGS.values():
        rules.append({
            "names": ["clone"], **deny,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    if notify:
        for r in WATCHED_SYSCALLS:
            rules.append({**r, "action": "SCMP_ACT_NOTIFY"})
            if "args" in r:  # allowed where the watch's one condition is false
                (cond,) = r["args"]
                assert cond["op"] == "SCMP_CMP_NE"
                rules.append({"names": r["names"], "action": "SCMP_ACT_ALLOW", "args": [{**cond, "op": "SCMP_CMP_EQ"}]})
    return rules


# Per-process limits every sandbox process starts with (and cannot raise: no CAP_SYS_RESOURCE):
# no core dumps (a crashing process would write its memory, secrets included, into the upper),
# a bounded number of open files (init/corral-init.c lowers the same two itself). RLIMIT_NPROC
# is not set: pids.max bounds a sandbox's processes, whichever uid runs them.
NOFILE = 65536


def rlimits() -> list[dict[str, Any]]:
    """The sandbox's rlimits; NOFILE no higher than the agent's own hard limit (runc sets them
    after dropping capabilities, so it cannot raise one; the agent raises its own at start)."""
    nofile = min(NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    return [{"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]


def raise_own_nofile() -> int:
    """Lift this process's open-file limit to NOFILE at least (it holds two fds per sandbox, and
    sandboxes inherit theirs from it); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(hard, NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):  # not privileged: keep what we have, the soft raised to it
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]

MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
    "/proc/kallsyms", "/proc/sysrq-trigger",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]


# Harness commands (ExecRequest.harness) run as this uid and gid (init/corral-init.c HARNESS_ID):
# not root, so the agent's capability-less root cannot read, signal or forge them. corral-init
# keeps INIT_CAPS to switch to it and drops every capability in each child before exec.
HARNESS_ID = HARNESS_UID
#: uids (and gids) 0..USERNS_RANGE-1 of a sandbox with a user namespace (userns.py RANGE)
USERNS_RANGE = 65536
INIT_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"]


def config(
    *,
    hostname: str,
    init_path: str,
    io_dir: str,
    cgroups_path: str,
    env: dict[str, str],
    cpu: float,
    memory_mb: int,
    pids_max: int,
    cpu_period_us: int = 100_000,
    seccomp_listener: str | None = None,
    init_caps: bool = False,
    userns: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """`init_caps`: the process is corral-init, which keeps INIT_CAPS (only) for its children to drop.
    `userns`: (path, host uid base) of the user namespace to join (userns.py); without it the
    sandbox's root is host root."""
    caps = INIT_CAPS if init_caps else []
    mem = memory_mb * 1024 * 1024
    namespaces: list[dict[str, Any]] = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")]
    mappings: dict[str, Any] = {}
    if userns is not None:
        path, base = userns
        mapping = [{"containerID": 0, "hostID": base, "size": USERNS_RANGE}]
        namespaces.insert(0, {"type": "user", "path": path})
        mappings = {"uidMappings": mapping, "gidMappings": mapping}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/.corral/init"],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "inheritable": [], "permitted": caps, "ambient": []},
            "noNewPrivileges": True,
            # runc's prlimit on a process in a user namespace it did not make needs
            # CAP_SYS_RESOURCE over it: there corral-init lowers them itself (and one-shot runs
            # inherit the agent's, core dumps off: ContainerSubstrate.start)
            **({} if userns else {"rlimits": rlimits()}),
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/.corral/init", "type": "bind", "source": init_path, "options": ["bind", "ro", "nosuid", "nodev"]},
            {"destination": "/.corral/io", "type": "bind", "source": io_dir, "options": ["bind", "ro", "nosuid", "nodev", "noexec"]},
        ],
        "linux": {
            "namespaces": namespaces,
            **mappings,
            "cgroupsPath": cgroups_path,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                # swap = limit: memory+swap may not exceed the limit, so a sandbox never swaps
                "memory": {"limit": mem, "reservation": mem // 4, "swap": mem},
                "cpu": {"quota": max(1000, int(cpu * cpu_period_us)), "period": cpu_period_us},
                "pids": {"limit": pids_max},
            },
            "seccomp": seccomp_profile(seccomp_listener, hostname),
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "rootfsPropagation": "private",
        },
    }
