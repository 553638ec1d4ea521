"""Pure parts of the node's audit sources: the seccomp profile with a notify listener, syscall
naming (x86_64 table, foreign architectures), and the fanotify path helpers."""
from __future__ import annotations

import errno

from corral_node_agent import audit_fanotify, audit_seccomp, oci


def test_profile_without_listener_keeps_errno():
    p = oci.seccomp_profile()
    assert "listenerPath" not in p
    assert all(r["action"] == "SCMP_ACT_ERRNO" for r in p["syscalls"])


def test_profile_with_listener_notifies_everything_but_clone3():
    p = oci.seccomp_profile("/run/x/seccomp.sock", "sb-1")
    assert p["listenerPath"] == "/run/x/seccomp.sock" and p["listenerMetadata"] == "sb-1"
    for r in p["syscalls"]:
        if r["names"] == ["clone3"]:
            assert r["action"] == "SCMP_ACT_ERRNO" and r["errnoRet"] == oci.ENOSYS
        else:
            assert r["action"] == "SCMP_ACT_NOTIFY" and "errnoRet" not in r
    c = oci.config(hostname="sb-2", init_path="/i", io_dir="/io", cgroups_path="/c", env={}, cpu=1, memory_mb=64,
                   pids_max=64, seccomp_listener="/s.sock")
    assert c["linux"]["seccomp"]["listenerMetadata"] == "sb-2"


def test_every_notified_syscall_has_a_name():
    names = set(audit_seccomp.X86_64_SYSCALLS.values())
    assert set(oci.DENIED_SYSCALLS) <= names and {"ioctl", "clone"} <= names
    assert len(names) == len(audit_seccomp.X86_64_SYSCALLS)  # no number maps to two names


def test_describe():
    x64 = audit_seccomp.AUDIT_ARCH_X86_64
    name, d = audit_seccomp.describe(x64, 16, (3, oci.FS_IOC_FIEMAP, 0, 0, 0, 0))
    assert name == "ioctl" and d["request"] == "FS_IOC_FIEMAP" and d["fd"] == "3"
    name, d = audit_seccomp.describe(x64, 56, (0x40000000 | 0x11, 0, 0, 0, 0, 0))
    assert name == "clone" and d["namespaces"] == "CLONE_NEWNET"
    assert audit_seccomp.describe(x64, 165, (0,) * 6)[0] == "mount"
    name, d = audit_seccomp.describe(x64, 165 | audit_seccomp.X32_SYSCALL_BIT, (0,) * 6)
    assert name == "syscall_165" and d["arch"] == "x32"
    name, d = audit_seccomp.describe(audit_seccomp.AUDIT_ARCH_I386, 21, (0,) * 6)
    assert name == "syscall_21" and d["arch"] == "i386"
    assert audit_seccomp.RESP.pack(1, 0, -errno.EPERM, 0)[16:20] == (-1).to_bytes(4, "little", signed=True)


def test_path_helpers():
    assert audit_fanotify.norm("secret//a/../b") == "/secret/b"
    assert audit_fanotify.under("/hidden/x.py", "/hidden") and not audit_fanotify.under("/hiddenx", "/hidden")
