"""Isolation of container sandboxes, checked from both sides: inside (what a hostile agent can see
and do) and the host (cgroups, the overlay's lower and upper dirs, host files).

Every check asserts on observable state; nothing here is skipped when a feature is missing."""
from __future__ import annotations

import asyncio
import errno
import glob
import hashlib
import os
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import pytest

from corral_sdk import Conflict, Forbidden, InvalidRequest, NotFound

from .. import hostview
from ..leaks import cgroup_pids

CG = "/sys/fs/cgroup"
NS_TYPES = ("pid", "net", "mnt", "ipc", "uts", "cgroup")


# ----------------------------------------------------------------------------- helpers


def sandbox_dir(stack, sb) -> str:
    return f"{stack.data_dir}/nodes/{sb.info.node}/sandboxes/{sb.id}"


def cg_dir(sb, hierarchy: str) -> str:
    found = glob.glob(f"{CG}/{hierarchy}/corral/{sb.info.node}-*/{sb.id}")
    assert len(found) == 1, found
    return found[0]


def cg_read(sb, hierarchy: str, name: str) -> str:
    with open(f"{cg_dir(sb, hierarchy)}/{name}") as f:
        return f.read().strip()


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def sandbox_host_cmdlines(sb) -> list[str]:
    """Command lines of every process in the sandbox's cgroups, seen from the host."""
    pids = set(cgroup_pids(cg_dir(sb, "pids"))) | set(cgroup_pids(cg_dir(sb, "freezer")))
    return [c for c in (cmdline(p) for p in sorted(pids)) if c]


def tree_fingerprint(root: str) -> dict[str, tuple]:
    """Everything that a write could change in a directory tree (content hashes included)."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ino, digest)
    return out


@pytest.fixture
def host_marker():
    """A host file with a random name and random content under /tmp."""
    tok = secrets.token_hex(8)
    path = f"/tmp/corral-host-marker-{tok}"
    content = f"HOST-SECRET-{secrets.token_hex(16)}\n".encode()
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o644)
    yield path, content
    os.unlink(path)


async def ok(sb, cmd, **kw):
    r = await sb.exec(cmd, **kw)
    assert r.exit_code == 0, (cmd, r)
    return r


# ----------------------------------------------------------------------------- pid namespace


async def test_own_pid1_and_no_host_processes(sandbox):
    r = await ok(sandbox, "ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '; echo; "
                          "tr '\\0' ' ' < /proc/1/cmdline; echo; readlink /proc/1/exe; "
                          "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    lines = r.stdout.split("\n")
    pids = [int(x) for x in lines[0].split()]
    assert pids[0] == 1, r.stdout
    # init, the exec's sh and its few children: nothing else
    assert len(pids) <= 6, f"sandbox sees {len(pids)} processes: {pids}"
    assert lines[1].strip() == "/.corral/init", r.stdout
    assert lines[2].strip() == "/.corral/init", r.stdout
    assert os.getpid() not in pids
    assert max(pids) < 1000, pids
    cmds = "\n".join(lines[3:])
    for host_thing in ("pytest", "python", "nats-server", "corral_node_agent", "runc", "systemd"):
        assert host_thing not in cmds, (host_thing, cmds)

    # ps agrees, and a process the host knows (ourselves) is not reachable by pid
    r = await sandbox.exec(f"ps; kill -0 {os.getpid()}; echo rc=$?")
    assert "rc=0" not in r.stdout, r
    ps_lines = [ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("rc=")]
    assert len(ps_lines) - 1 <= 6, r.stdout
    assert "pytest" not in r.stdout and "nats-server" not in r.stdout


async def test_own_namespaces(sandbox):
    """Every namespace the design lists is private (different inode from the host's)."""
    r = await ok(sandbox, " ; ".join(f"readlink /proc/self/ns/{t}" for t in NS_TYPES))
    inside = r.stdout.split()
    assert len(inside) == len(NS_TYPES), r.stdout
    for t, link in zip(NS_TYPES, inside, strict=True):
        host = os.readlink(f"/proc/self/ns/{t}")
        assert link.startswith(f"{t}:["), link
        assert link != host, f"the sandbox shares the host's {t} namespace ({link})"
    r = await ok(sandbox, "hostname")
    assert r.stdout.strip() == sandbox.id


# ----------------------------------------------------------------------------- network


async def test_no_network_to_host_or_outside(stack, sandbox):
    port = urlparse(stack.url).port
    assert port
    # the NATS server on the host's loopback answers an INFO line to anyone who connects
    r = await sandbox.exec(f"nc -w 2 127.0.0.1 {port} </dev/null; echo rc=$?", timeout_s=15)
    assert "INFO" not in r.stdout, f"the sandbox reached the host's NATS server: {r.stdout!r}"
    assert "rc=0" not in r.stdout, r
    # (the probe is meaningful: from the host the same connection gets the INFO line)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"INFO")
    finally:
        writer.close()
    # nor anything outside (no route at all: fails at once rather than timing out)
    for addr in ("1.1.1.1 53", "8.8.8.8 53", "10.0.0.1 80", "169.254.169.254 80"):
        t0 = time.monotonic()
        r = await sandbox.exec(f"nc -w 2 {addr} </dev/null; echo rc=$?", timeout_s=15)
        assert "rc=0" not in r.stdout, (addr, r)
        assert time.monotonic() - t0 < 5, (addr, r)
    # the host's own addresses are unreachable too
    host_ips = []
    p = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
    host_ips = [ip for ip in p.stdout.split() if ":" not in ip]
    for ip in host_ips:
        r = await sandbox.exec(f"nc -w 2 {ip} {port} </dev/null; echo rc=$?", timeout_s=15)
        assert "INFO" not in r.stdout and "rc=0" not in r.stdout, (ip, r)


async def test_only_loopback_interface_and_it_works(sandbox):
    r = await ok(sandbox, "ip -o link; echo ---; ip -o -4 addr; echo ---; ip route; cat /proc/net/dev")
    links, addrs, rest = r.stdout.split("---\n", 2)
    names = re.findall(r"^\d+:\s+([^:@\s]+)", links, re.M)
    assert names == ["lo"], f"interfaces inside the sandbox: {names}\n{r.stdout}"
    assert "UP" in links, links
    assert "127.0.0.1" in addrs, addrs
    routes = rest.split("Inter-|")[0].strip()
    assert "default" not in routes, routes

    # a server inside, reached over the sandbox's own loopback (httpd binds before it daemonises)
    r = await sandbox.exec(
        "mkdir -p /tmp/www && echo hello-over-loopback > /tmp/www/index.html && "
        "httpd -p 127.0.0.1:8080 -h /tmp/www && "
        "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 5 127.0.0.1 8080; echo rc=$?; "
        "netstat -ltn | grep -c ':8080 '", timeout_s=20)
    assert not r.timed_out, r
    assert "200 OK" in r.stdout and "hello-over-loopback" in r.stdout, r
    assert r.stdout.split()[-2:] == ["rc=0", "1"], r


# ----------------------------------------------------------------------------- host and neighbour files


async def test_host_files_unreachable(stack, sandbox, host_marker):
    path, content = host_marker
    secret = content.decode().strip()
    r = await sandbox.exec(f"cat {path}; echo rc=$?; ls -l {path}; echo rc=$?; ls -d {stack.data_dir}; echo rc=$?; "
                           f"cat /proc/1/root{path}; echo rc=$?; "
                           "find / -path /proc -prune -o -path /sys -prune -o -name 'corral-host-marker-*' -print")
    assert secret not in r.stdout
    assert r.stdout.count("rc=1") == 4, r
    assert "corral-host-marker" not in r.stdout.replace(path, ""), r
    # the host's /etc is not the sandbox's (busybox has no shadow file; the host has one)
    r = await sandbox.exec("cat /etc/shadow; echo rc=$?; ls /var/lib/corral /root/.ssh; echo rc=$?")
    assert "root:" not in r.stdout, r
    assert r.stdout.count("rc=1") == 2, r


async def test_other_sandbox_files_unreachable(stack, client):
    a = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    b = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    try:
        tok = secrets.token_hex(8)
        secret = f"A-SECRET-{secrets.token_hex(16)}"
        await ok(a, f"echo {secret} > /tmp/a-{tok}; sleep 60 >/dev/null 2>&1 &")
        assert (await a.files.read(f"/tmp/a-{tok}")).decode().strip() == secret
        a_dir = sandbox_dir(stack, a)
        a_root, a_rw = hostview.root(a_dir), hostview.rw(a_dir)
        assert open(f"{a_root}/tmp/a-{tok}").read().strip() == secret  # the paths are right
        r = await b.exec(f"cat /tmp/a-{tok}; echo rc=$?; cat {a_dir}/rootfs/tmp/a-{tok}; echo rc=$?; "
                         f"cat {a_dir}/rw/upper/tmp/a-{tok}; echo rc=$?; cat {a_root}/tmp/a-{tok}; echo rc=$?; "
                         f"cat {a_rw}/upper/tmp/a-{tok}; echo rc=$?; ps")
        assert secret not in r.stdout, r
        assert r.stdout.count("rc=1") == 5, r
        assert "sleep 60" not in r.stdout, f"sandbox B sees A's processes: {r.stdout}"
        with pytest.raises(NotFound):
            await b.files.read(f"/tmp/a-{tok}")
        for p in (f"{a_dir}/rootfs/tmp/a-{tok}", f"{a_root}/tmp/a-{tok}"):
            with pytest.raises(NotFound):
                await b.files.read(p)
        # and the other way round: B's write does not show up in A
        await b.files.write(f"/tmp/a-{tok}", "written by B")
        assert (await a.files.read(f"/tmp/a-{tok}")).decode().strip() == secret
    finally:
        for sb in (a, b):
            await sb.destroy()


async def test_writes_stay_in_the_upper(stack, client, sandbox):
    sdir = sandbox_dir(stack, sandbox)
    _, fs_opts = hostview.root_mount(sdir)
    lowers, upper = fs_opts["lowerdir"].split(":"), fs_opts["upperdir"]
    # given by fd at mount time: the options (visible in the sandbox's /proc/mounts) name no
    # path in the state dir, so no sandbox (or warm-pool) id
    assert upper.startswith("/proc/self/fd/"), upper
    upper = f"{hostview.rw(sdir)}/upper"
    # the layers too: idmapped clones of the node's layer mounts (the sandbox's root is not host root)
    assert lowers and all(d.startswith("/proc/self/fd/") for d in lowers), lowers
    lowers = hostview.lowers(sdir)
    assert lowers and all(os.path.isdir(d) for d in lowers), lowers
    before = {d: tree_fingerprint(d) for d in lowers}
    passwd_lower = next(f"{d}/etc/passwd" for d in lowers if os.path.exists(f"{d}/etc/passwd"))
    with open(passwd_lower, "rb") as f:
        passwd_before = f.read()
    await ok(sandbox, "echo x > /etc/newfile && echo 'evil:x:0:0::/root:/bin/sh' >> /etc/passwd && "
                      "echo > /etc/group && rm /etc/hosts && mkdir -p /usr/local/newdir && echo y > /usr/local/newdir/f && "
                      "touch /bin/busybox && chmod 700 /etc/hostname")
    r = await ok(sandbox, "cat /etc/newfile /etc/passwd; ls /etc")
    assert "evil:x:0:0" in r.stdout and "hosts" not in r.stdout.split("\n", 3)[-1].split()
    for d in lowers:
        assert tree_fingerprint(d) == before[d], f"a sandbox write changed the image's lower dir {d}"
    with open(passwd_lower, "rb") as f:
        assert f.read() == passwd_before
    with open(f"{upper}/etc/newfile", "rb") as f:
        assert f.read() == b"x\n"
    with open(f"{upper}/etc/passwd", "rb") as f:
        assert f.read() == passwd_before + b"evil:x:0:0::/root:/bin/sh\n"
    st = os.lstat(f"{upper}/etc/hosts")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, "rm in the sandbox should leave a whiteout in the upper"
    assert os.path.isfile(f"{upper}/usr/local/newdir/f")
    assert os.path.exists(f"{upper}/bin/busybox")
    # a fresh sandbox of the same image sees the pristine image
    other = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    try:
        r = await ok(other, "cat /etc/passwd; ls /etc")
        assert "evil" not in r.stdout and "newfile" not in r.stdout and "hosts" in r.stdout
    finally:
        await other.destroy()


# ----------------------------------------------------------------------------- files.read / files.write confinement


async def test_files_read_traversal_is_confined(sandbox, host_marker):
    path, content = host_marker
    with open("/etc/hostname", "rb") as f:
        host_hostname = f.read()
    mine = f"sandbox-{secrets.token_hex(6)}\n".encode()
    await sandbox.files.write("/etc/hostname", mine)
    assert mine != host_hostname
    for p in ("../../../../etc/hostname", "/../../etc/hostname", "etc/../../../etc/hostname",
              "/etc/./../../../../../etc/hostname", "//etc//hostname", "/tmp/../../etc/hostname"):
        assert await sandbox.files.read(p) == mine, p
    try:
        with open("/etc/shadow", "rb") as f:
            host_shadow = f.read()
    except OSError:
        host_shadow = None
    for p in ("/etc/shadow", "../../../../etc/shadow", "/../../etc/shadow", f"../../../../../..{path}", path,
              f"/proc/1/root{path}", "/proc/self/root/etc/shadow", f"/proc/self/root{path}"):
        try:
            data = await sandbox.files.read(p)
        except (NotFound, Forbidden):
            continue
        assert data != content and (host_shadow is None or data != host_shadow), f"{p} read host bytes"
        assert data == b"" or b"HOST-SECRET" not in data


async def test_files_read_through_planted_symlinks(sandbox, host_marker):
    path, content = host_marker
    secret = content.strip()
    mine = f"sandbox-passwd-{secrets.token_hex(6)}\n".encode()
    await sandbox.files.write("/etc/passwd", mine)
    await ok(sandbox, f"ln -s /etc/shadow /tmp/l-shadow; ln -s {path} /tmp/l-marker; "
                      f"ln -s ../../../../../../../..{path} /tmp/l-marker-rel; ln -s /etc/passwd /tmp/l-passwd; "
                      "ln -s / /tmp/l-root; ln -s ../../../../../.. /tmp/l-up; ln -s /proc/1/root /tmp/l-p1root; "
                      "ln -s /proc/self/root /tmp/l-selfroot; ln -s /proc/self/cwd /tmp/l-selfcwd; "
                      "ln -s /tmp/l-loop2 /tmp/l-loop1; ln -s /tmp/l-loop1 /tmp/l-loop2")
    # absolute and relative symlinks resolve inside the sandbox: its own files, never the host's
    assert await sandbox.files.read("/tmp/l-passwd") == mine
    assert await sandbox.files.read("/tmp/l-root/etc/passwd") == mine
    assert await sandbox.files.read("/tmp/l-up/etc/passwd") == mine
    for p in ("/tmp/l-shadow", "/tmp/l-marker", "/tmp/l-marker-rel", f"/tmp/l-root{path}", f"/tmp/l-up{path}"):
        with pytest.raises(NotFound):
            data = await sandbox.files.read(p)
            assert secret not in data, f"{p} read the host marker"
    # /proc magic links are refused (or at least never reach the host)
    for p in ("/tmp/l-p1root/etc/passwd", "/tmp/l-selfroot/etc/passwd", f"/tmp/l-selfroot{path}",
              "/tmp/l-selfcwd/etc/passwd", f"/tmp/l-p1root{path}"):
        try:
            data = await sandbox.files.read(p)
        except (Forbidden, NotFound):
            continue
        raise AssertionError(f"{p} was followed: {data[:80]!r}")
    with pytest.raises(Forbidden):
        await sandbox.files.read("/tmp/l-loop1")


async def test_files_write_is_confined(stack, sandbox, host_marker):
    path, content = host_marker
    tok = secrets.token_hex(8)
    host_target = f"/tmp/corral-escape-{tok}"
    # `..` stops at the sandbox root
    await sandbox.files.write(f"../../../../../../..{host_target}", "via-dotdot")
    assert not os.path.exists(host_target), "files.write escaped the sandbox with ../"
    assert (await sandbox.files.read(host_target)) == b"via-dotdot"
    sdir = sandbox_dir(stack, sandbox)
    assert os.path.isfile(f"{hostview.rw(sdir)}/upper{host_target}")
    # the node's own state (beside rootfs) is out of reach
    await sandbox.files.write("/../config.json", "{}")
    with open(f"{sdir}/config.json") as f:
        assert f.read() != "{}"
    # symlinks planted in the sandbox resolve inside it, for writes too
    await ok(sandbox, f"ln -s {path} /tmp/w-marker; ln -s {host_target}-2 /tmp/w-new; ln -s / /tmp/w-root; "
                      "ln -s /proc/self/root /tmp/w-selfroot; ln -s /proc/1/cwd /tmp/w-p1cwd")
    await sandbox.files.write("/tmp/w-marker", "overwritten")
    with open(path, "rb") as f:
        assert f.read() == content, "files.write through a symlink overwrote a host file"
    assert await sandbox.files.read(path) == b"overwritten"
    await sandbox.files.write("/tmp/w-new", "dangling")
    assert not os.path.exists(f"{host_target}-2")
    await sandbox.files.write(f"/tmp/w-root{host_target}-3", "via-root-link")
    assert not os.path.exists(f"{host_target}-3")
    await sandbox.files.write(f"/tmp/w-root/../../x{tok}/deep/file", "made-parents")
    assert not os.path.exists(f"/x{tok}") and not os.path.exists(f"{sdir}/x{tok}")
    assert await sandbox.files.read(f"/x{tok}/deep/file") == b"made-parents"
    for p in (f"/tmp/w-selfroot{host_target}-4", f"/tmp/w-p1cwd{host_target}-5", f"/proc/1/root{host_target}-6"):
        try:
            await sandbox.files.write(p, "magic")
        except (Forbidden, NotFound, InvalidRequest):
            pass
        assert not os.path.exists(p.replace("/tmp/w-selfroot", "").replace("/tmp/w-p1cwd", "").replace("/proc/1/root", ""))
    for leftover in (host_target, f"{host_target}-2", f"{host_target}-3"):
        assert not os.path.exists(leftover)
    with pytest.raises(InvalidRequest):
        await sandbox.files.write("/tmp/../..", "x")
    with pytest.raises(InvalidRequest):
        await sandbox.files.read("/tmp/a\0b")


# ----------------------------------------------------------------------------- privileges


def _status_fields(text: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v}


INIT_CAPS = (1 << 6) | (1 << 7) | (1 << 8)  # CAP_SETGID, CAP_SETUID, CAP_SETPCAP: init's, to start harness commands


async def test_no_capabilities_no_new_privs_seccomp(sandbox):
    for label, r in (
        ("exec", await ok(sandbox, "cat /proc/self/status")),
        ("session", await ok(sandbox, "cat /proc/self/status", session="caps")),
        ("harness exec", await ok(sandbox, "cat /proc/self/status", harness=True)),
        ("harness session", await ok(sandbox, "cat /proc/self/status", session="hcaps", harness=True)),
        ("init", await ok(sandbox, "cat /proc/1/status")),
    ):
        f = _status_fields(r.stdout)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            want = INIT_CAPS if label == "init" and cap in ("CapPrm", "CapEff", "CapBnd") else 0
            assert int(f[cap], 16) == want, (label, cap, f[cap])
        uid = "64222" if label.startswith("harness") else "0"
        assert f["Uid"].split() == [uid] * 4 and f["Gid"].split() == [uid] * 4, (label, f["Uid"], f["Gid"])
        assert f["NoNewPrivs"] == "1", (label, f.get("NoNewPrivs"))
        assert f["Seccomp"] == "2", (label, f.get("Seccomp"))
        assert int(f.get("Seccomp_filters", "1")) >= 1


async def test_seccomp_blocks_mount_and_namespaces(stack, sandbox):
    attempts = {
        "mount": "mount -t tmpfs x /mnt",
        "bind mount": "mount --bind /tmp /mnt",
        "unshare userns": "unshare -r true",
        "unshare user only": "unshare -U true",
        "unshare net": "unshare -n true",
        "unshare mount": "unshare -m true",
        "unshare pid": "unshare -p -f true",
        "nsenter mnt": "nsenter -t 1 -m true",
        "nsenter net by path": "nsenter --net=/proc/1/ns/net true",
        "nsenter all": "nsenter -a -t 1 true",
        "pivot_root": "pivot_root /tmp /tmp/x",
        "swapon": "swapon /tmp/nothing",
        "chroot after unshare": "unshare -r chroot / true",
    }
    for what, cmd in attempts.items():
        r = await sandbox.exec(cmd, timeout_s=10)
        assert r.exit_code != 0, f"{what} succeeded inside the sandbox: {r}"
    r = await sandbox.exec("mount -t tmpfs x /mnt")
    assert "Operation not permitted" in r.stderr or "permission denied" in r.stderr.lower(), r
    r = await sandbox.exec("unshare -r true")
    assert "Operation not permitted" in r.stderr, r
    r = await ok(sandbox, "grep -c ' /mnt ' /proc/mounts || true; readlink /proc/self/ns/user")
    assert r.stdout.split()[0] == "0", r
    # the sandbox's own user namespace (made by the agent), never one made inside it
    init = hostview.init_pid(sandbox_dir(stack, sandbox))
    assert r.stdout.split()[1] == os.readlink(f"/proc/{init}/ns/user") != os.readlink("/proc/self/ns/user"), \
        "no new user namespace may exist"


async def test_seccomp_denies_by_default(sandbox):
    """An allowlist, not a denylist: a syscall on no list (get_mempolicy, harmless and allowed to
    any process on the host) fails; io_uring (whose submissions would bypass the filter) is ENOSYS
    so runtimes fall back; vsock sockets and personality flags beyond Docker's are refused; the
    ordinary calls still work."""
    if not shutil.which("gcc"):
        pytest.fail("gcc is needed to build the test program (apt-get install gcc)")
    d = tempfile.mkdtemp(prefix="crl-dd-")
    try:
        subprocess.run(["gcc", "-static", "-O1", "-o", f"{d}/dd", f"{os.path.dirname(__file__)}/data/default_deny.c"],
                       check=True, capture_output=True)
        with open(f"{d}/dd", "rb") as f:
            await sandbox.files.write("/tmp/default_deny", f.read(), mode=0o755)
        # on the host the kernel itself allows get_mempolicy: the refusal inside is the policy's
        host = subprocess.run([f"{d}/dd"], capture_output=True, text=True, check=True).stdout
        assert dict(line.split() for line in host.strip().splitlines())["get_mempolicy"] == "0", host
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r = await sandbox.exec("/tmp/default_deny")
    got = dict(line.split() for line in r.stdout.strip().splitlines())
    assert got == {"get_mempolicy": "1", "io_uring_setup": "38", "socket_vsock": "1", "personality_no_randomize": "1",
                   "personality_query": "0", "socket_unix": "0", "getpid": "0"}, got
    # a syscall through the i386 ABI (int 0x80): only the native ABI is accepted, the process is
    # killed with SIGSYS before the call runs
    assert r.signal == signal.SIGSYS and "i386_getpid" not in r.stdout, r


async def test_rlimits_and_no_swap(sandbox):
    """No core dumps (a crash would write the process's memory into the sandbox), a bounded number
    of open files that cannot be raised, and memory+swap capped at the memory limit."""
    r = await ok(sandbox, "ulimit -c; ulimit -n; ulimit -Hn; (ulimit -n 100000) 2>&1; echo rc=$?; "
                          "(ulimit -c unlimited) 2>&1; echo rc=$?")
    lines = r.stdout.split("\n")
    # 65536, unless the node-agent could not raise its own hard limit that far (a host without
    # CAP_SYS_RESOURCE: then the sandbox gets the agent's own)
    can_raise = subprocess.run([sys.executable, "-c", "import resource as r; r.setrlimit(r.RLIMIT_NOFILE, (65536, 65536))"],
                               capture_output=True).returncode == 0
    nofile = 65536 if can_raise else min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert lines[:3] == ["0", str(nofile), str(nofile)], r
    assert r.stdout.count("rc=0") == 0, f"a sandbox raised its own rlimit: {r}"
    limit = cg_read(sandbox, "memory", "memory.limit_in_bytes")
    assert cg_read(sandbox, "memory", "memory.memsw.limit_in_bytes") == limit


async def test_sandbox_cannot_kill_or_inspect_its_helper(sandbox):
    """PID 1 (corral-init) ignores signals from inside, is not dumpable (its fds, among them the
    host-side control socket, stay out of reach), and a kill-everything leaves exec working."""
    r = await sandbox.exec("readlink /proc/1/fd/3; echo rc=$?; cat /proc/1/environ; echo rc=$?; "
                           "ls -l /proc/1/fd/ 2>&1 | grep -c -e socket -e ctl.sock -e anon_inode")
    assert r.stdout.split()[:-1] == ["rc=1", "rc=1"], r
    assert r.stdout.split()[-1] == "0", r
    await sandbox.exec("kill -9 1; kill -TERM 1; kill -SEGV 1; kill -9 -1", timeout_s=5)
    await asyncio.sleep(0.2)
    r = await ok(sandbox, "echo alive; tr '\\0' ' ' < /proc/1/cmdline")
    assert r.stdout.split("\n")[:2] == ["alive", "/.corral/init "], r


# What an agent process tries against another process of its sandbox found by its command line
# ($1) and, if given, uid ($2): each line starting LEAK is an access it got. Run against an agent process it must get
# them (the check can see a leak); against a harness process none.
REACH = r"""
P=""
for i in $(seq 1 200); do
  for c in /proc/[0-9]*/cmdline; do
    d=${c%/cmdline}
    if [ "$(tr '\0' ' ' < $c 2>/dev/null)" = "$1 " ] && { [ -z "$2" ] || grep -q "^Uid:[[:space:]]*$2[[:space:]]" $d/status; }; then
      P=${d#/proc/}
    fi
  done
  [ -n "$P" ] && break
  sleep 0.05
done
[ -n "$P" ] || { echo "target not found"; exit 3; }
ls /proc/$P/fd >/dev/null 2>&1 && echo "LEAK fd listed"
readlink /proc/$P/fd/1 >/dev/null 2>&1 && echo "LEAK fd resolved"
cat /proc/$P/environ >/dev/null 2>&1 && echo "LEAK environ read"
cat /proc/$P/maps >/dev/null 2>&1 && echo "LEAK maps read"
( exec 5</proc/$P/mem ) 2>/dev/null && echo "LEAK mem opened"
( exec 5>>/proc/$P/fd/1 ) 2>/dev/null && echo "LEAK stdout opened"
( exec 5</proc/$P/fd/0 ) 2>/dev/null && echo "LEAK stdin opened"
ls /proc/$P/cwd/ >/dev/null 2>&1 && echo "LEAK cwd listed"
kill -CONT $P 2>/dev/null && echo "LEAK signalled"
echo checked
"""


async def _reach(sandbox, target: str, uid: str = "") -> set[str]:
    r = await sandbox.exec(["/bin/sh", "-c", REACH, "reach", target, uid], timeout_s=30)
    assert r.stdout.endswith("checked\n"), r
    return {ln for ln in r.stdout.splitlines() if ln.startswith("LEAK")}


ALL_LEAKS = {"LEAK fd listed", "LEAK fd resolved", "LEAK environ read", "LEAK maps read", "LEAK mem opened",
             "LEAK stdout opened", "LEAK stdin opened", "LEAK cwd listed", "LEAK signalled"}


async def test_agent_cannot_read_signal_or_forge_harness_commands(sandbox):
    """A harness command (exec harness=True) runs as another uid: the agent's capability-less root
    can neither read its fds, memory or environment, nor write into its output, nor signal it; the
    same attempts on one of its own processes all succeed (so each check can see a leak)."""
    # stdin and stdout are pipes made inside the sandbox, so the agent's own are its to open: the
    # pipes the node-agent hands an exec belong to host root, out of reach of every sandbox uid
    own = asyncio.ensure_future(sandbox.exec("true | sleep 4.4321 | cat; echo agent-done", timeout_s=30))
    assert await _reach(sandbox, "sleep 4.4321") == ALL_LEAKS
    harness = asyncio.ensure_future(sandbox.exec("true | sleep 4.4322 | cat; echo harness-done", harness=True, timeout_s=30))
    assert await _reach(sandbox, "sleep 4.4322") == set()
    r = await harness
    assert (r.exit_code, r.stdout) == (0, "harness-done\n"), r
    await own


async def test_harness_session_is_out_of_the_agents_reach(sandbox):
    """The session attack: an agent process reads a shell's stdin pipe (the command and its end
    marker) and writes a forged marker into its stdout. A harness session's shell is out of reach;
    its io files (script, stdin) cannot be listed or read; the agent and the harness cannot share a
    session."""
    await ok(sandbox, "true", session="grader", harness=True)
    assert (await ok(sandbox, "id -u", session="grader", harness=True)).stdout == "64222\n"
    running = asyncio.ensure_future(sandbox.exec("cat; sleep 3.3321; echo real", session="grader", harness=True,
                                                 stdin="hidden-expected-answer\n", timeout_s=30))
    assert await _reach(sandbox, "sleep 3.3321") == set()
    assert await _reach(sandbox, "/bin/sh", "64222") == set()  # the harness session's shell
    r = await sandbox.exec("ls /.corral/io; echo rc=$?; cat /.corral/io/* 2>&1; grep -r hidden-expected /.corral/ 2>&1; true")
    assert "rc=1" in r.stdout and "hidden-expected-answer" not in r.stdout, r
    r = await running
    assert (r.exit_code, r.stdout) == (0, "hidden-expected-answer\nreal\n"), r
    with pytest.raises(Conflict):
        await sandbox.exec("true", session="grader")


INOTIFY = ("import ctypes, sys, time; l = ctypes.CDLL(None, use_errno=True); "
           "fds = [l.inotify_init() for _ in range(int(sys.argv[1]))]; "
           "print(sum(f >= 0 for f in fds), ctypes.get_errno(), flush=True); time.sleep(float(sys.argv[2]))")


async def test_inotify_instances_are_capped_per_sandbox_not_taken_from_host_root(client):
    """Sandbox root is host uid 0, and inotify instances count per uid: a sandbox opening 300
    gets INOTIFY_PER_SANDBOX (then EMFILE, reported), the host's limit is raised, and host root
    (and a second sandbox) can still open theirs while the first holds all it got."""
    import ctypes

    from corral_node_agent.audit.budgets import INOTIFY_HOST_LIMIT, INOTIFY_PER_SANDBOX

    a = await client.create(image="debian", cpu=0.5, memory_mb=128, ttl_s=600)
    b = await client.create(image="debian", cpu=0.5, memory_mb=128, ttl_s=600)
    try:
        holding = asyncio.ensure_future(a.exec(["python3", "-c", INOTIFY, "300", "6"], timeout_s=60))
        await asyncio.sleep(3)
        with open("/proc/sys/fs/inotify/max_user_instances") as f:
            assert int(f.read()) >= INOTIFY_HOST_LIMIT
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init()
        assert fd >= 0, os.strerror(ctypes.get_errno())  # host root still gets one
        os.close(fd)
        r = await b.exec(["python3", "-c", INOTIFY, "10", "0"], timeout_s=60)
        assert r.stdout.split() == ["10", "0"], r  # the neighbour gets its own
        r = await holding
        got, err = r.stdout.split()
        assert int(got) == INOTIFY_PER_SANDBOX and int(err) == errno.EMFILE, r
        # once the holder exited, the sandbox gets instances again (its count is taken anew)
        await asyncio.sleep(1.2)
        r = await a.exec(["python3", "-c", INOTIFY, "5", "0"], timeout_s=60)
        assert r.stdout.split()[0] == "5", r
    finally:
        await a.destroy()
        await b.destroy()


async def test_setuid_files_from_a_sandbox_are_inert_on_the_host(stack, sandbox):
    """The sandbox is root inside, so it can make setuid-root files (chmod u+s, or files.write
    with mode 0o4755). Its rootfs is an overlay that the host reaches (through the clone its init
    holds, and briefly while it is created, under the state dir): unless that mount is nosuid,
    a host process that runs such a file gets euid 0 on the host."""
    await ok(sandbox, "cp /bin/busybox /tmp/suid-bb && chmod 4755 /tmp/suid-bb && ls -l /tmp/suid-bb")
    with open("/usr/bin/id", "rb") as f:
        await sandbox.files.write("/tmp/suid-id", f.read(), mode=0o4755)
    sdir = sandbox_dir(stack, sandbox)
    root = hostview.root(sdir)
    assert os.stat(f"{root}/tmp/suid-id").st_mode & stat.S_ISUID
    opts = [",".join(hostview.root_mount(sdir)[0])]
    # run it as `nobody` on the host (through an fd, so only the mount flags matter, not the
    # permissions of this test stack's private data dir)
    fd = os.open(f"{root}/tmp/suid-id", os.O_PATH)
    try:
        p = subprocess.run([f"/proc/self/fd/{fd}"], pass_fds=(fd,), user=65534, group=65534, extra_groups=[],
                           capture_output=True, text=True, timeout=10, check=False)
    finally:
        os.close(fd)
    assert "euid=0" not in p.stdout, (
        f"a setuid file written by the sandbox gives host root to any host user: {p.stdout.strip()} "
        f"(rootfs mount options: {opts[-1]})")
    assert "nosuid" in opts[-1].split(","), opts


async def test_disk_limit(client):
    sb = await client.create(image="busybox", cpu=0.25, memory_mb=128, disk_mb=4)
    try:
        r = await sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=10; echo rc=$?", timeout_s=20)
        assert "rc=0" not in r.stdout and "No space left" in r.stderr, r
        r = await ok(sb, "rm /tmp/big; echo small > /tmp/small; cat /tmp/small")
        assert r.stdout == "small\n"
        with pytest.raises(InvalidRequest):
            await sb.files.write("/tmp/big2", b"x" * (5 * 1024 * 1024))
    finally:
        await sb.destroy()


# ----------------------------------------------------------------------------- resource limits


async def test_fork_bomb_is_contained_by_pids_limit(client):
    sb = await client.create(image="busybox", cpu=1.0, memory_mb=128, pids_max=64)
    try:
        assert cg_read(sb, "pids", "pids.max") == "64"
        peak = 0
        refused = 0
        stop = asyncio.Event()

        def fork_failures() -> int:
            # cgroup v1 counts a refused fork in the forking task's own (per-exec, child) cgroup;
            # v2 in the cgroup whose limit was hit: sum over the whole subtree
            n = 0
            for dirpath, _dirs, _files in os.walk(cg_dir(sb, "pids")):
                try:
                    with open(f"{dirpath}/pids.events") as f:
                        m = re.search(r"max (\d+)", f.read())
                    n += int(m.group(1)) if m else 0
                except OSError:
                    pass
            return n

        async def sample() -> None:
            nonlocal peak, refused
            while not stop.is_set():
                try:
                    peak = max(peak, int(cg_read(sb, "pids", "pids.current")))
                    refused = max(refused, fork_failures())
                except (OSError, ValueError):
                    pass
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        try:
            # the bomb starts in a subshell (the one fork this shell makes, before anything else
            # runs), then the shell itself becomes `sleep` (no fork needed once the bomb has eaten
            # the pids), so the exec ends only by its timeout, which must kill the whole bomb. (Run
            # from this shell directly, the bomb's first children could take the last pid before
            # the shell's own second fork for the pipeline: ash exits 2 on "can't fork", seen once.)
            # 10 s: on a loaded machine a throttled bomb takes seconds to reach the limit
            r = await sb.exec("(bomb() { bomb | bomb & }; bomb); exec sleep 60", timeout_s=10)
        finally:
            stop.set()
            await sampler
        assert r.timed_out, r
        assert time.monotonic() - t0 < 40
        assert 0 < peak <= 64, peak
        # a fork refused by the pids controller is the proof the bomb reached the limit (sampling
        # pids.current every 10 ms can miss the peak, so its value is only checked against the limit)
        assert refused > 0, f"no fork was refused at the limit (peak seen {peak} pids)"
        # the bomb is gone, the sandbox answers, the host can still fork
        deadline = time.monotonic() + 5
        while int(cg_read(sb, "pids", "pids.current")) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert int(cg_read(sb, "pids", "pids.current")) == 1, sandbox_host_cmdlines(sb)
        r = await sb.exec("echo alive; ls /proc | grep -cE '^[0-9]+$'")
        assert r.exit_code == 0 and r.stdout.split()[0] == "alive", r
        assert int(r.stdout.split()[1]) <= 4, r
        assert subprocess.run(["true"], check=False).returncode == 0
    finally:
        await sb.destroy()


async def test_memory_bomb_is_oom_killed_with_a_clear_result(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=64)
    try:
        assert int(cg_read(sb, "memory", "memory.limit_in_bytes")) == 64 * 1024 * 1024
        r = await sb.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=30)
        assert not r.timed_out, r
        assert r.oom_killed is True, r
        assert r.exit_code == 137 and r.signal == 9, r
        assert "memory" in r.stderr and "memory_mb=64" in r.stderr, r
        assert "200000000" not in r.stdout
        # argv form, the allocation in the top process itself
        r = await sb.exec(["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"], timeout_s=30)
        assert r.oom_killed is True and r.exit_code == 137, r
        # the sandbox is still usable, and a small allocation is fine
        r = await sb.exec("echo alive; x=$(head -c 1000000 /dev/zero | tr '\\0' a); echo ${#x}")
        assert r.exit_code == 0 and r.stdout.split() == ["alive", "1000000"], r
        assert r.oom_killed is False
    finally:
        await sb.destroy()


async def test_memory_bomb_in_session(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=64)
    try:
        await ok(sb, "cd /tmp; export KEEP=1", session="s")
        r = await sb.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", session="s", timeout_s=30)
        assert r.oom_killed is True, r
        assert "memory" in r.stderr, r
        r = await sb.exec("echo alive", session="s")
        assert r.exit_code == 0 and r.stdout == "alive\n", r
    finally:
        await sb.destroy()


async def test_output_floods_are_bounded_in_sessions_and_streams(sandbox):
    """300 MB printed in a session is read as it comes, kept up to max_output_bytes and the rest
    discarded (the call ends with the command, not at its timeout); a stream carries no more
    than the reply would; the session is usable after."""
    r = await sandbox.exec("yes aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa | head -c 300000000; echo done >&2", session="flood",
                           timeout_s=120)
    assert not r.timed_out and r.exit_code == 0, (r.exit_code, r.timed_out, r.stderr[-200:])
    assert r.truncated and len(r.stdout) == 1024 * 1024 and r.stderr == "done\n"
    for session in ("", "flood"):
        got = {"stdout": 0, "stderr": 0}
        async for item in sandbox.exec_stream("head -c 100000 /dev/zero; head -c 5000 /dev/zero >&2",
                                              session=session, max_output_bytes=1000, timeout_s=60):
            if hasattr(item, "stream"):
                got[item.stream] += len(item.data)
            else:
                result = item
        assert got == {"stdout": 1000, "stderr": 1000}, (session, got)
        assert result.truncated and len(result.stdout) == 1000 and result.exit_code == 0, result
    r = await sandbox.exec("pwd; echo ok", session="flood")
    assert r.stdout.endswith("ok\n") and not r.truncated, r
    # more than the bus carries (NUL bytes are six in JSON): cut to fit and flagged, never lost
    for session in ("", "flood"):
        r = await sandbox.exec("head -c 3000000 /dev/zero", session=session, max_output_bytes=30_000_000, timeout_s=60)
        assert r.exit_code == 0 and r.truncated and 0 < len(r.stdout) < 3_000_000, (session, len(r.stdout))


async def test_sessions_and_concurrent_execs_are_capped_per_sandbox(client):
    """One sandbox's callers cannot take all of a node's shells, pipes and tasks: past 16 live
    sessions a new one is `capacity` (ended ones make room), past 64 execs in flight likewise."""
    from corral_sdk import Capacity

    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, pids_max=512)
    try:
        for i in range(16):
            await ok(sb, "true", session=f"s{i}")
        with pytest.raises(Capacity, match="16 sessions"):
            await sb.exec("true", session="one-too-many")
        assert (await sb.exec("echo again", session="s3")).stdout == "again\n"  # existing ones still serve
        r = await sb.exec("exit 0", session="s0")
        assert r.exit_code == 0, r
        await ok(sb, "true", session="one-more")  # the ended shell made room
        got = await asyncio.gather(*(sb.exec("sleep 2", timeout_s=30) for _ in range(70)), return_exceptions=True)
        refused = [g for g in got if isinstance(g, Capacity)]
        done = [g for g in got if not isinstance(g, BaseException)]
        assert len(refused) == 6 and len(done) == 64 and all(r.exit_code == 0 for r in done), got
        assert "execs running" in str(refused[0])
        await ok(sb, "true")  # and they free their places when they end
    finally:
        await sb.destroy()


# ----------------------------------------------------------------------------- exec lifetime


async def test_exec_timeout_kills_every_process_it_started(sandbox):
    t0 = time.monotonic()
    r = await sandbox.exec("sleep 300 & sleep 301 & setsid sleep 302 & "
                           "(trap '' TERM HUP INT; sleep 303) & (sh -c 'sleep 304 &') ; "
                           "nohup sleep 305 >/dev/null 2>&1 & wait", timeout_s=1)
    assert r.timed_out is True, r
    assert r.exit_code != 0
    assert "timed out" in r.stderr, r
    assert time.monotonic() - t0 < 10, r
    left = [c for c in sandbox_host_cmdlines(sandbox) if re.search(r"sleep 30[0-5]", c)]
    assert left == [], f"processes of a timed-out exec survive on the host: {left}"
    r = await ok(sandbox, "ps")
    assert not re.search(r"sleep 30[0-5]", r.stdout), r.stdout


async def test_session_timeout_kills_the_session_tree(sandbox):
    await ok(sandbox, "sleep 310 >/dev/null 2>&1 &", session="t")
    r = await sandbox.exec("sleep 311 & sleep 312", session="t", timeout_s=1)
    assert r.timed_out is True, r
    left = [c for c in sandbox_host_cmdlines(sandbox) if re.search(r"sleep 31[0-2]", c)]
    assert left == [], left
    r = await ok(sandbox, "echo $$; ps", session="t")
    assert not re.search(r"sleep 31[0-2]", r.stdout), r.stdout


async def test_background_process_without_timeout_survives(sandbox):
    t0 = time.monotonic()
    r = await ok(sandbox, "sleep 313 >/dev/null 2>&1 &")
    assert time.monotonic() - t0 < 3, r
    # one that keeps the exec's stdout open must not hold the exec either
    t0 = time.monotonic()
    r = await ok(sandbox, "echo started; sleep 314 &")
    assert r.stdout == "started\n"
    assert time.monotonic() - t0 < 3, r
    await asyncio.sleep(0.2)
    r = await ok(sandbox, "ps")
    assert "sleep 313" in r.stdout and "sleep 314" in r.stdout, r.stdout
    assert any("sleep 313" in c for c in sandbox_host_cmdlines(sandbox))


# ----------------------------------------------------------------------------- other stacks on the same host


async def test_another_stack_on_the_same_host_leaves_our_sandboxes_alone(stack, sandbox):
    """Two stacks on one machine (a test run and a benchmark, or two `corral up`) each have a
    `node-1`. Starting the second one's node-agent must not touch the first one's sandboxes."""
    import shutil

    from ..conftest import make_stack

    await ok(sandbox, "sleep 320 >/dev/null 2>&1 &")
    init_pid = int(open(f"{sandbox_dir(stack, sandbox)}/init.pid").read())
    other = make_stack(nodes=1)
    try:
        await other.start()
    finally:
        await other.stop()
        shutil.rmtree(other.data_dir, ignore_errors=True)
    assert os.path.exists(f"/proc/{init_pid}") and cmdline(init_pid) == "/.corral/init", \
        "starting another stack's node-agent killed this stack's sandbox"
    assert os.path.isdir(cg_dir(sandbox, "pids")), "another stack's node-agent removed this sandbox's cgroup"
    r = await ok(sandbox, "ps")
    assert "sleep 320" in r.stdout, r.stdout
