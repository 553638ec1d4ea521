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
    ioctl_values = {a["value"] for r in c["linux"]["seccomp"]["syscalls"] if r["names"] == ["ioctl"] for a in r["args"]}
    assert ioctl_values == {oci.FS_IOC_FIEMAP, oci.FS_IOC_GETFSMAP}
    mounts = {m["destination"]: m for m in c["mounts"]}
    assert "ro" in mounts["/.corral/init"]["options"] and "ro" in mounts["/sys"]["options"]
