"""The OCI runtime spec (config.json) of a container sandbox, and its seccomp policy.

Everything a sandbox may do is decided here: namespaces, no capabilities, no_new_privs, a
read-only view of /sys and /proc's dangerous corners, cgroup limits, and a seccomp filter that
denies the syscalls used to escape, snoop or read files sideways (by handle, by block map)."""
from __future__ import annotations

from typing import Any

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
]

CLONE_NS_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


def seccomp_profile(listener_path: str | None = None, metadata: str = "") -> dict[str, Any]:
    """The seccomp policy. With `listener_path` (the node-agent's seccomp-notify socket) the
    denied calls are SCMP_ACT_NOTIFY: runc hands the notify fd to that socket, the agent answers
    EPERM and records each attempt (audit/seccomp.py); `metadata` (the sandbox id) comes back with
    the fd. Without it (docker, tests) they are plain SCMP_ACT_ERRNO(EPERM)."""
    deny: dict[str, Any] = ({"action": "SCMP_ACT_NOTIFY"} if listener_path
                            else {"action": "SCMP_ACT_ERRNO", "errnoRet": EPERM})
    rules: list[dict[str, Any]] = [
        {"names": DENIED_SYSCALLS, **deny},
        # clone3 takes its flags in a struct seccomp cannot read: answer ENOSYS so libc falls back
        # to clone(2), whose flags we can check
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    for value in DENIED_IOCTLS.values():
        rules.append({
            "names": ["ioctl"], **deny,
            "args": [{"index": 1, "value": value, "op": "SCMP_CMP_EQ"}],
        })
    for flag in CLONE_NS_FLAGS.values():
        rules.append({
            "names": ["clone"], **deny,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    profile: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        "syscalls": rules,
    }
    if listener_path:
        rules.extend({**r, "action": "SCMP_ACT_NOTIFY"} for r in WATCHED_SYSCALLS)
        profile["listenerPath"] = listener_path
        profile["listenerMetadata"] = metadata
    return profile


MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
    "/proc/kallsyms", "/proc/sysrq-trigger",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]


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
) -> dict[str, Any]:
    mem = memory_mb * 1024 * 1024
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/.corral/init"],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "noNewPrivileges": True,
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
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "cgroupsPath": cgroups_path,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": mem, "reservation": mem // 4},
                "cpu": {"quota": max(1000, int(cpu * cpu_period_us)), "period": cpu_period_us},
                "pids": {"limit": pids_max},
            },
            "seccomp": seccomp_profile(seccomp_listener, hostname),
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "rootfsPropagation": "private",
        },
    }
