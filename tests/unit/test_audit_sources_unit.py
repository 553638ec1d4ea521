"""Pure parts of the node's audit sources: the seccomp profile with a notify listener, syscall
naming (x86_64 table, foreign architectures), and the fanotify path helpers."""
from __future__ import annotations

import errno

from corral_node_agent import oci
from corral_node_agent.audit import fanotify as audit_fanotify
from corral_node_agent.audit import netcalls
from corral_node_agent.audit import seccomp as audit_seccomp


def test_profile_without_listener_keeps_errno():
    p = oci.seccomp_profile()
    assert "listenerPath" not in p
    # every rule either allows or refuses with an errno; nothing waits on a listener
    assert all(r["action"] in ("SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO") for r in p["syscalls"])
    denied = {n for r in p["syscalls"] if r["action"] == "SCMP_ACT_ERRNO" for n in r["names"]}
    assert set(oci.DENIED_SYSCALLS) <= denied


def test_profile_with_listener_notifies_every_denial_but_clone3_and_io_uring():
    p = oci.seccomp_profile("/run/x/seccomp.sock", "sb-1")
    assert p["listenerPath"] == "/run/x/seccomp.sock" and p["listenerMetadata"] == "sb-1"
    for r in p["syscalls"]:
        if r["action"] == "SCMP_ACT_ALLOW":
            continue
        if set(r["names"]) <= {"clone3", *oci.IO_URING}:
            assert r["action"] == "SCMP_ACT_ERRNO" and r["errnoRet"] == oci.ENOSYS
        else:
            assert r["action"] == "SCMP_ACT_NOTIFY" and "errnoRet" not in r, r
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


def test_watched_calls_are_notified_only_with_a_listener_and_named():
    assert not any("connect" in r["names"] for r in oci.seccomp_profile()["syscalls"] if r["action"] != "SCMP_ACT_ALLOW")
    p = oci.seccomp_profile("/s.sock", "sb-1")
    notify = [r for r in p["syscalls"] if r["action"] == "SCMP_ACT_NOTIFY"]
    watched = {n for r in notify for n in r["names"] if n in audit_seccomp.WATCHED}
    assert watched == audit_seccomp.WATCHED
    sendto = next(r for r in notify if r["names"] == ["sendto"])
    assert sendto["args"] == [{"index": 4, "value": 0, "op": "SCMP_CMP_NE"}]  # only with a destination
    assert audit_seccomp.WATCHED <= set(audit_seccomp.X86_64_SYSCALLS.values())
    # the same calls through the i386 / x32 ABIs continue uninspected; denied ones do not
    assert audit_seccomp._foreign_watched(audit_seccomp.AUDIT_ARCH_I386, 37)  # kill
    assert audit_seccomp._foreign_watched(audit_seccomp.AUDIT_ARCH_X86_64, 42 | audit_seccomp.X32_SYSCALL_BIT)  # connect
    assert not audit_seccomp._foreign_watched(audit_seccomp.AUDIT_ARCH_X86_64, 101 | audit_seccomp.X32_SYSCALL_BIT)  # ptrace
    assert not audit_seccomp._foreign_watched(audit_seccomp.AUDIT_ARCH_X86_64, 62)  # native: inspected instead


def test_sockaddr_parsing_and_loopback():
    import socket
    import struct

    v4 = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 80) + socket.inet_aton("1.2.3.4") + b"\0" * 8
    assert netcalls.sockaddr(v4) == (socket.AF_INET, "1.2.3.4", 80)
    v6 = struct.pack("=H", socket.AF_INET6) + struct.pack("!H", 53) + b"\0" * 4 + socket.inet_pton(socket.AF_INET6, "2001:db8::1") + b"\0" * 4
    assert netcalls.sockaddr(v6) == (socket.AF_INET6, "2001:db8::1", 53)
    assert netcalls.sockaddr(struct.pack("=H", socket.AF_UNIX) + b"/run/x\0")[1] == ""
    assert netcalls.sockaddr(b"\x02") == (0, "", 0)
    for host in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "0.0.0.0", "::"):
        assert netcalls.is_loopback(host), host
    for host in ("1.2.3.4", "2001:db8::1", "10.0.0.1", "not-an-ip"):
        assert not netcalls.is_loopback(host), host
