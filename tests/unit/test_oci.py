import random

import pytest

from corral_node_agent import oci


def test_config_has_no_capabilities_and_seccomp():
    c = oci.config(hostname="sb-1", init_path="/x/init", io_dir="/x/io", cgroups_path="/corral/n/sb-1",
                   env={"PATH": "/bin"}, cpu=0.5, memory_mb=128, pids_max=64)
    caps = c["process"]["capabilities"]
    assert all(v == [] for v in caps.values())
    assert c["process"]["noNewPrivileges"] is True
    ns = {n["type"] for n in c["linux"]["namespaces"]}
    assert {"pid", "network", "ipc", "uts", "mount"} <= ns
    res = c["linux"]["resources"]
    assert res["memory"]["limit"] == 128 * 1024 * 1024 and res["pids"]["limit"] == 64
    assert res["cpu"]["quota"] == 50_000 and res["cpu"]["period"] == 100_000
    names = {n for r in c["linux"]["seccomp"]["syscalls"] for n in r["names"]}
    for s in ("mount", "ptrace", "bpf", "open_by_handle_at", "process_vm_readv", "keyctl", "perf_event_open", "userfaultfd", "unshare", "setns"):
        assert s in names
    ioctl_denied = {a["valueTwo"] for r in c["linux"]["seccomp"]["syscalls"]
                    if r["names"] == ["ioctl"] and r["action"] != "SCMP_ACT_ALLOW" for a in r["args"]}
    assert ioctl_denied == {oci.FS_IOC_FIEMAP, oci.FS_IOC_GETFSMAP}
    mounts = {m["destination"]: m for m in c["mounts"]}
    assert "ro" in mounts["/.corral/init"]["options"] and "ro" in mounts["/sys"]["options"]


def _rules_by_name(profile):
    out = {}
    for r in profile["syscalls"]:
        for n in r["names"]:
            out.setdefault(n, []).append(r)
    return out


@pytest.mark.parametrize("listener", [None, "/run/corral/seccomp.sock"])
def test_seccomp_is_default_deny_and_rules_never_overlap(listener):
    """runc's libseccomp lets an unconditional allow beat a conditional deny on the same syscall:
    a syscall with an unconditional rule must have no other rule."""
    p = oci.seccomp_profile(listener, "sb-1")
    assert p["defaultAction"] == "SCMP_ACT_ERRNO" and p["defaultErrnoRet"] == oci.EPERM
    by_name = _rules_by_name(p)
    for name, rules in by_name.items():
        if any("args" not in r for r in rules):
            assert len(rules) == 1, (name, rules)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "clone3"):
        assert [r["errnoRet"] for r in by_name[name]] == [oci.ENOSYS]
    for name in ("get_mempolicy", "chroot", "setdomainname", "quotactl_fd", "process_madvise"):
        assert name not in by_name  # on no list: the default refuses it
    for name in oci.DENIED_SYSCALLS:
        assert [r["action"] for r in by_name[name]] == ["SCMP_ACT_NOTIFY" if listener else "SCMP_ACT_ERRNO"]
    # a watched call is notified where its condition holds and allowed exactly where it does not
    kill = {r["action"]: r["args"] for r in by_name["kill"]} if listener else {}
    if listener:
        assert kill["SCMP_ACT_NOTIFY"][0]["op"] == "SCMP_CMP_NE" and kill["SCMP_ACT_ALLOW"][0]["op"] == "SCMP_CMP_EQ"
        assert [r["action"] for r in by_name["connect"]] == ["SCMP_ACT_NOTIFY"]
    else:
        assert [r["action"] for r in by_name["connect"]] == ["SCMP_ACT_ALLOW"]


def test_ioctl_allow_rules_cover_every_request_but_the_denied_on_the_low_32_bits():
    rng = random.Random(7)
    pairs = oci.allow_ioctls(list(oci.DENIED_IOCTLS.values()))

    def allowed(x: int) -> bool:
        return any(x & mask == value for mask, value in pairs)

    for d in oci.DENIED_IOCTLS.values():
        for high in (0, 0xFFFFFFFF, 0x1):
            assert not allowed(d | (high << 32))
        assert allowed(d ^ 1) and allowed(d ^ (1 << 31))
    for _ in range(20000):
        x = rng.getrandbits(64)
        assert allowed(x) == ((x & 0xFFFFFFFF) not in oci.DENIED_IOCTLS.values())
    # the cubes are disjoint: each request is allowed by exactly one rule
    for x in (0x5401, 0x5413, 0x541B, 0x8912):
        assert sum(1 for mask, value in pairs if x & mask == value) == 1
