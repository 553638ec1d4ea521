"""Sandbox root is not host root: every container sandbox (and function call) runs in a user
namespace of its own, over a host uid range no other sandbox holds, while its files stay owned
by uid 0 on disk (idmapped layers), so the image's layers, snapshots and the files API work as
before."""
from __future__ import annotations

import asyncio
import os
import subprocess

from .. import hostview
from ..leaks import UID_CLAIMS, uid_ranges_of

FIRST_BASE = 0x00080000  # services/node-agent .../userns.py
RANGE = 65536


def sdir_of(stack, sb) -> str:
    return f"{stack.data_dir}/nodes/{sb.info.node}/sandboxes/{sb.id}"


def uid_map(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in line.split()) for line in text.strip().splitlines()]  # type: ignore[misc]


def host_ids(pid: int) -> tuple[list[int], list[int]]:
    """(real, effective, saved, fs) uids and gids of a host process, as the host sees them."""
    with open(f"/proc/{pid}/status") as f:
        lines = dict(line.split(":", 1) for line in f if ":" in line)
    return [int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()]


async def test_each_sandbox_root_is_its_own_unprivileged_host_uid(stack, client):
    a = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    b = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    try:
        bases = []
        for sb in (a, b):
            r = await sb.exec("id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map")
            assert r.exit_code == 0, r
            lines = r.stdout.splitlines()
            assert lines[:2] == ["0", "0"], r  # root inside
            maps = uid_map("\n".join(lines[2:]))
            base = hostview.uid_base(sdir_of(stack, sb))
            assert maps == [(0, base, RANGE), (0, base, RANGE)], r
            assert base >= FIRST_BASE and base % RANGE == 0
            # as the host sees it: init (the sandbox's PID 1) is that uid, not host root
            uids, gids = host_ids(hostview.init_pid(sdir_of(stack, sb)))
            assert uids == [base] * 4 and gids == [base] * 4, (uids, gids)
            bases.append(base)
        assert bases[0] != bases[1], "two sandboxes share a host uid range"
        # the namespace's own per-uid limits (userns.USERNS_LIMITS): no nested user namespace
        r = await a.exec("cat /proc/sys/user/max_user_namespaces /proc/sys/user/max_inotify_instances "
                         "/proc/sys/user/max_inotify_watches")
        assert r.stdout.split() == ["0", "64", "65536"], r
        # the harness uid is inside the range too
        r = await a.exec("cat /proc/self/status | grep ^Uid; id -u", harness=True)
        assert r.stdout.splitlines()[-1] == "64222", r
        claims = uid_ranges_of(f"{stack.data_dir}/nodes/{a.info.node}/sandboxes")
        assert set(bases) <= set(claims), (bases, claims)
    finally:
        for sb in (a, b):
            await sb.destroy()
    left = set(uid_ranges_of(f"{stack.data_dir}/nodes/{a.info.node}/sandboxes"))
    assert not left & set(bases), f"destroyed sandboxes still claim their uid ranges: {left & set(bases)}"
    assert not any(os.path.exists(f"{UID_CLAIMS}/{b}") for b in bases)


async def test_files_belong_to_the_sandbox_root_inside_and_to_uid_0_on_disk(stack, client, sandbox):
    sdir = sdir_of(stack, sandbox)
    base = hostview.uid_base(sdir)
    await sandbox.files.write("/root/by-api", "api\n")
    await sandbox.files.write("/srv/deep/new/dir/f", "deep\n")  # (parents made as needed)
    r = await sandbox.exec("echo own > /root/by-exec; stat -c '%u:%g %n' /root/by-api /root/by-exec "
                           "/srv/deep/new/dir/f /srv/deep /etc/passwd /bin/busybox")
    assert r.exit_code == 0, r
    assert all(line.startswith("0:0 ") for line in r.stdout.splitlines()), r
    # the sandbox's own root can still change what the files API wrote (it is its owner)
    r = await sandbox.exec("echo more >> /root/by-api && chmod 600 /root/by-api && cat /root/by-api")
    assert r.exit_code == 0 and r.stdout == "api\nmore\n", r
    # through the host's view of the overlay: the sandbox's range, never host root
    for p in ("root/by-api", "root/by-exec", "srv/deep/new/dir/f", "etc/passwd"):
        st = os.lstat(f"{hostview.root(sdir)}/{p}")
        assert (st.st_uid, st.st_gid) == (base, base), (p, st.st_uid)
    # on disk (the upper, what snapshots and change lists read): uid 0, as in the image's layers
    for p in ("root/by-api", "root/by-exec", "srv/deep/new/dir/f"):
        st = os.lstat(f"{hostview.rw(sdir)}/upper/{p}")
        assert (st.st_uid, st.st_gid) == (0, 0), (p, st.st_uid)


async def test_snapshot_of_a_sandbox_with_its_own_range_starts_with_another(stack, client):
    src = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    try:
        r = await src.exec("mkdir -p /data && echo kept > /data/f && chmod 640 /data/f")
        assert r.exit_code == 0, r
        await src.files.write("/data/h", "h\n", mode=0o600)
        image = await src.snapshot("userns-snap")
    finally:
        await src.destroy()
    dst = await client.create(image=image, cpu=0.25, memory_mb=64)
    try:
        assert hostview.uid_base(sdir_of(stack, dst)) != 0
        r = await dst.exec("cat /data/f /data/h; stat -c '%u:%g %a %n' /data/f /data/h; echo x >> /data/f && echo w")
        assert r.exit_code == 0, r
        out = r.stdout.splitlines()
        assert out[:2] == ["kept", "h"], r
        assert out[2] == "0:0 640 /data/f" and out[3] == "0:0 600 /data/h", r
        assert out[-1] == "w", r
    finally:
        await dst.destroy()


async def test_an_escaped_sandbox_root_is_an_unprivileged_host_user(stack, sandbox):
    """What a process that got out of every namespace with the sandbox's credentials would be: host
    uid `base`, no capability. It cannot read the node's state (records, layer mounts: other
    tenants' snapshots), signal the node-agent or read what only host root may."""
    sdir = sdir_of(stack, sandbox)
    base = hostview.uid_base(sdir)
    node_dir = os.path.dirname(os.path.dirname(sdir))
    agent = stack.proc(sandbox.info.node).popen.pid

    def as_escaped(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={base}", f"--regid={base}", "--clear-groups", "--inh-caps=-all",
                               "--bounding-set=-all", "sh", "-c", cmd], capture_output=True, text=True, timeout=30)

    assert as_escaped("id -u").stdout.strip() == str(base)  # the control: the command runs
    attempts = {  # what: (command, a path it needs, which exists: the refusal is a permission's)
        "read its own record": (f"cat {sdir}/sandbox.json", f"{sdir}/sandbox.json"),
        "list the node's sandboxes": (f"ls {node_dir}/sandboxes", f"{node_dir}/sandboxes"),
        "list the node's layer mounts": (f"ls {node_dir}/layers", f"{node_dir}/layers"),
        "list runc's state": (f"ls {node_dir}/runc", f"{node_dir}/runc"),
        "list the loader's cached layers": (f"ls {node_dir}/cache/layers", f"{node_dir}/cache/layers"),
        "list the batch claim notes": (f"ls {node_dir}/claims", f"{node_dir}/claims"),
        "list the stack's logs": (f"ls {stack.data_dir}/logs", f"{stack.data_dir}/logs"),
        "read the host's shadow file": ("cat /etc/shadow", "/etc/shadow"),
        "signal the node-agent": (f"kill -0 {agent}", f"/proc/{agent}"),
        "write into the state dir": (f"touch {node_dir}/escaped", node_dir),
    }
    for what, (cmd, needed) in attempts.items():
        assert os.path.exists(needed), needed
        r = as_escaped(cmd)
        assert r.returncode != 0 and ("ermission denied" in r.stderr or "not permitted" in r.stderr), \
            f"an escaped sandbox root could {what}: {r}"
    assert not os.path.exists(f"{node_dir}/escaped")


async def test_a_sandbox_spending_a_per_uid_budget_spends_only_its_own(client, sandbox):
    """The attack the issue measured, on a per-uid budget: inotify watches count per uid, in the
    sandbox's user namespace (its own limit) and up to the namespace's owner (the range) against
    the host's fs.inotify.max_user_watches. A sandbox watching until the kernel refuses (ENOSPC)
    leaves host root and a neighbour sandbox their own budgets; before, every sandbox and host root
    shared uid 0's."""
    import ctypes

    from .test_audit_sources import static_binary

    # the sandbox's own per-uid limit (userns.USERNS_LIMITS), below the host's
    budget = int((await sandbox.exec("cat /proc/sys/user/max_inotify_watches")).stdout)
    with open("/proc/sys/fs/inotify/max_user_watches") as f:
        assert budget <= int(f.read())
    instances = 60  # under the per-sandbox cap on inotify instances (64)
    files = budget // instances + 100
    assert files <= 200_000, f"max_inotify_watches={budget} is too large to spend in a test"
    await sandbox.files.write("/tmp/iw", static_binary("inotify_watches.c"), mode=0o755)
    await sandbox.exec(f"/tmp/iw /tmp/w {files} {instances} hold > /tmp/iw.out 2>&1 &", timeout_s=60)
    out = ""
    for _ in range(600):
        out = (await sandbox.exec("cat /tmp/iw.out")).stdout
        if "watches=" in out:
            break
        await asyncio.sleep(0.1)
    assert "enospc=1" in out, f"the sandbox did not spend its uid's inotify watch budget: {out!r}"
    spent = int(out.split("watches=")[1].split()[0])
    assert spent > budget // 2, out
    # host root still adds a watch (its budget is not the sandbox's)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        wd = libc.inotify_add_watch(fd, b"/tmp", 0x2)
        assert wd >= 0, f"host root cannot add an inotify watch: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    # and so does a neighbour sandbox
    other = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    try:
        await other.files.write("/tmp/iw", static_binary("inotify_watches.c"), mode=0o755)
        r = await other.exec("/tmp/iw /tmp/w 50 2")
        assert r.stdout.strip() == "watches=100 enospc=0", r
    finally:
        await other.destroy()


async def test_package_managers_work_as_the_sandbox_root(client):
    """dpkg and apt install into the image's root as the sandbox's root (files root-owned inside,
    uid 0 on disk). apt must not switch to its `_apt` download user (the sandbox's processes have
    no capabilities, with or without a user namespace): APT::Sandbox::User=root."""
    sb = await client.create(image="debian", memory_mb=512, disk_mb=1024)
    try:
        r = await sb.exec(["bash", "-c", r"""set -e
mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/usr/local/bin
printf 'Package: corralprobe\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.com>\nDescription: probe\n' \
  > /tmp/pkg/DEBIAN/control
printf '#!/bin/sh\necho probe-ok\n' > /tmp/pkg/usr/local/bin/corralprobe
chmod 755 /tmp/pkg/usr/local/bin/corralprobe
dpkg-deb --build /tmp/pkg /tmp/corralprobe.deb >/dev/null
dpkg -i /tmp/corralprobe.deb >/dev/null
corralprobe; stat -c '%u:%g' /usr/local/bin/corralprobe
apt-get -o APT::Sandbox::User=root remove -y -q corralprobe >/dev/null
test ! -e /usr/local/bin/corralprobe && echo removed
apt-get -o APT::Sandbox::User=root install -y -q /tmp/corralprobe.deb >/dev/null 2>&1
corralprobe
"""], timeout_s=120)
        assert r.exit_code == 0 and r.stdout.split() == ["probe-ok", "0:0", "removed", "probe-ok"], r
    finally:
        await sb.destroy()
