"""The pieces of "sandbox root is not host root" (services/node-agent .../userns.py), on the real
kernel: uid range claims, the user namespace a sandbox joins, idmapped layers under an overlay
mounted as the sandbox's root, and the OCI config that joins it."""
from __future__ import annotations

import os
import stat

import pytest

from corral_common import linux
from corral_node_agent import oci, userns

BASE = userns.FIRST_BASE + 7 * userns.RANGE


def test_claims_are_unique_released_and_swept(tmp_path):
    owner, other = tmp_path / "mine", tmp_path / "theirs"
    owner.mkdir()
    other.mkdir()
    mine = userns.UidRanges(str(owner), str(tmp_path / "claims"))
    theirs = userns.UidRanges(str(other), str(tmp_path / "claims"))
    bases = [mine.claim(f"sb-{i}") for i in range(50)] + [theirs.claim("x")]
    assert len(set(bases)) == len(bases)
    assert all(userns.FIRST_BASE <= b <= userns.LAST_BASE and b % userns.RANGE == 0 for b in bases)
    assert userns.LAST_BASE + userns.RANGE <= 0x6FFF0000  # systemd's container range ends there
    mine.release(bases[0])
    assert bases[0] not in mine.owned()
    # a restarted agent keeps what its adopted sandboxes hold, releases the rest of its own, and
    # never touches another live agent's
    released = mine.sweep(keep={bases[1]})
    assert set(released) == set(bases[2:50])
    assert set(mine.owned()) == {bases[1], bases[50]}
    # an agent whose state dir is gone: its claims go too
    other.rmdir()
    mine.sweep(keep={bases[1]})
    assert set(mine.owned()) == {bases[1]}


def test_stack_sweep_releases_its_own_claims_and_those_of_gone_dirs(tmp_path, monkeypatch):
    """Stack.stop and the stack guard (stackguard.sweep_uid_ranges): claims naming a dir of the
    stopped stack go, and so do claims whose owner dir no longer exists (a stack removed without
    its sweep); a live owner elsewhere keeps its claim."""
    from corral_common import config
    from corral_sdk import stackguard

    claims = tmp_path / "claims"
    monkeypatch.setattr(config, "UID_RANGES_DIR", str(claims))
    data, gone, live = tmp_path / "stack", tmp_path / "gone", tmp_path / "live"
    for d in (data / "nodes/node-1/sandboxes", gone, live):
        d.mkdir(parents=True)
    ours = userns.UidRanges(str(data / "nodes/node-1/sandboxes"), str(claims)).claim("sb-a")
    stale = userns.UidRanges(str(gone), str(claims)).claim("sb-b")
    kept = userns.UidRanges(str(live), str(claims)).claim("sb-c")
    gone.rmdir()
    stackguard.sweep_uid_ranges(str(data))
    assert sorted(int(n) for n in os.listdir(claims)) == [kept]
    assert ours != stale


def test_claim_for_records_the_base_in_the_state_dir(tmp_path):
    r = userns.UidRanges(str(tmp_path), str(tmp_path / "claims"))
    sdir = tmp_path / "sb"
    sdir.mkdir()
    base = r.claim_for("sb", str(sdir))
    assert userns.read_base(str(sdir)) == base
    assert userns.read_base(str(tmp_path / "nothing")) == 0


def test_user_namespace_maps_the_range_and_is_owned_by_it():
    user_fd, net_fd = userns.make_userns(BASE, netns=True)
    try:
        assert os.readlink(f"/proc/self/fd/{user_fd}").startswith("user:[")
        assert os.readlink(f"/proc/self/fd/{user_fd}") != os.readlink("/proc/self/ns/user")
        assert net_fd is not None and os.readlink(f"/proc/self/fd/{net_fd}") != os.readlink("/proc/self/ns/net")
        # NS_GET_OWNER_UID: the kernel charges what the namespace's processes hold to its owner
        import fcntl
        import struct
        owner = struct.unpack("I", fcntl.ioctl(user_fd, 0xB704, b"\0" * 4))[0]
        assert owner == BASE
    finally:
        os.close(user_fd)
        if net_fd is not None:
            os.close(net_fd)


def test_idmapped_overlay_as_the_sandbox_root(tmp_path):
    """Layers owned by uid 0 on disk show as the range's base through the overlay; what is written
    as the sandbox's root (acting_as) lands as uid 0 in the upper; host root itself cannot write
    there (uid 0 has no mapping in the range)."""
    user_fd, _ = userns.make_userns(BASE)
    lower, rw, root = tmp_path / "lower", tmp_path / "rw", tmp_path / "root"
    for d in (lower, rw, root):
        d.mkdir()
    fds: list[int] = []
    linux.mount("tmpfs", str(lower), "tmpfs", 0, "size=1m")
    linux.mount("tmpfs", str(rw), "tmpfs", 0, "size=1m")
    try:
        (lower / "etc").mkdir()
        (lower / "etc" / "passwd").write_text("root:x:0:0\n")
        (rw / "upper").mkdir()
        (rw / "work").mkdir()
        fds = [userns.idmapped(str(lower), user_fd), userns.idmapped(str(rw), user_fd)]
        opts = (f"lowerdir=/proc/self/fd/{fds[0]},upperdir=/proc/self/fd/{fds[1]}/upper,"
                f"workdir=/proc/self/fd/{fds[1]}/work")
        with userns.acting_as(BASE):
            linux.mount("overlay", str(root), "overlay", 0, opts)
        try:
            assert os.stat(root / "etc" / "passwd").st_uid == BASE
            with pytest.raises(OSError):  # host root: no uid in the range to own the file as
                (root / "etc" / "host-root").write_text("x")
            with userns.acting_as(BASE):
                (root / "etc" / "passwd").write_text("changed\n")
                (root / "etc" / "new").write_text("new\n")
            assert os.stat(root / "etc" / "new").st_uid == BASE
            for p in ("etc/passwd", "etc/new"):
                st = os.stat(rw / "upper" / p)
                assert (st.st_uid, st.st_gid) == (0, 0), p
            assert (lower / "etc" / "passwd").read_text() == "root:x:0:0\n"
        finally:
            linux.umount(str(root))
        # credentials are back to host root's, capabilities included
        (tmp_path / "after").write_text("x")
        assert os.stat(tmp_path / "after").st_uid == 0
        with open("/proc/thread-self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        with open("/proc/self/status") as f:
            assert caps == next(line for line in f if line.startswith("CapEff:"))
    finally:
        for fd in (*fds, user_fd):
            os.close(fd)
        linux.umount(str(rw))
        linux.umount(str(lower))


def test_make_traversable_adds_search_only(tmp_path):
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True)
    os.chmod(tmp_path / "a", 0o700)
    os.chmod(d, 0o750)
    changed = userns.make_traversable(str(d))
    assert str(d) in changed and str(tmp_path / "a") in changed
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o701
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o751
    assert userns.make_traversable(str(d)) == []


def test_probe_passes_on_this_kernel(tmp_path):
    assert userns.probe(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []


def test_oci_config_joins_the_namespace_and_leaves_rlimits_to_init():
    kw = dict(hostname="sb-1", init_path="/x/init", io_dir="/x/io", cgroups_path="/corral/n/sb-1",
              env={"PATH": "/bin"}, cpu=0.5, memory_mb=128, pids_max=64)
    plain = oci.config(**kw)
    assert "user" not in {n["type"] for n in plain["linux"]["namespaces"]}
    assert plain["process"]["rlimits"]
    c = oci.config(**kw, userns=("/proc/1/fd/9", BASE))
    assert c["linux"]["namespaces"][0] == {"type": "user", "path": "/proc/1/fd/9"}
    want = [{"containerID": 0, "hostID": BASE, "size": oci.USERNS_RANGE}]
    assert c["linux"]["uidMappings"] == want and c["linux"]["gidMappings"] == want
    assert "rlimits" not in c["process"]  # runc could not set them (init lowers them itself)


def test_helper_makes_namespaces_and_survives_its_own_death():
    """The node-agent's namespaces come from a small helper process (a fork of the agent costs
    in proportion to its memory): fds passed back, a dead helper replaced, errors explained,
    nothing left after close."""
    import fcntl
    import struct

    from corral_node_agent.userns_helper import Helper

    h = Helper()
    try:
        user_fd, net_fd = h.make(BASE, netns=True)
        try:
            assert struct.unpack("I", fcntl.ioctl(user_fd, 0xB704, b"\0" * 4))[0] == BASE
            assert os.readlink(f"/proc/self/fd/{net_fd}").startswith("net:[")
            assert not os.get_inheritable(user_fd)
        finally:
            os.close(user_fd)
            os.close(net_fd)
        first = h.proc
        assert first is not None
        first.kill()
        first.wait()
        user_fd, none = h.make(BASE)
        os.close(user_fd)
        assert none is None and h.proc is not first
        with pytest.raises(OSError, match="uid base -1 is out of range"):
            h.make(-1)
    finally:
        proc = h.proc
        h.close()
    assert proc is not None and proc.poll() is not None
