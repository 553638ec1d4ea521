"""One behavioural suite over every substrate this machine has: `container` (runc), `docker`
(Docker Engine through aiodocker) and `function` (one-shot calls, for the subset that makes sense
for them: exec result, env, stdin, limits, isolation, timeouts, leaks, bad input, audit events).

The `docker` cases run against their own stack whose node-agents enable
`--substrate container --substrate docker`; the fixture starts dockerd when `docker info` fails
and imports the busybox rootfs with `docker import` (no registry is reachable). If Docker truly
cannot run here the docker cases FAIL with the reason: they are never skipped."""
from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import nats
import pytest
import pytest_asyncio

from corral_common.contract import subjects
from corral_common.contract.images import ImageDeleteReply, NameRequest
from corral_common.contract.labels import DOCKER_JOB, DOCKER_NODE, DOCKER_SANDBOX, DOCKER_STATE
from corral_common.contract.messages import Empty, ExecResult, SnapshotRequest
from corral_common.contract.replies import InfoReply, SnapshotReply
from corral_sdk import AsyncClient, Conflict, Forbidden, InvalidRequest, NotFound, RemoteError, Timeout

from .. import leaks
from ..conftest import IMAGE_DIR, make_stack, running_stack
from ..dockerd import docker_ok, start_dockerd, stop_dockerd

# "function-slots": the function substrate with its warm tier off (every call starts runc in a
# prepared slot), so both of its paths are covered
# "microvm", "vm": QEMU guests (TCG here), slower, not different
GUESTS = ["microvm", "vm"]
SUBSTRATES = ["container", "docker", "gvisor", "function", "function-slots", *GUESTS]
STAYING = ["container", "docker", "gvisor", *GUESTS]  # sandboxes that stay: sessions, files, pause, snapshots
CG = "/sys/fs/cgroup"
BUSYBOX_ROOTFS = f"{IMAGE_DIR}/busybox/rootfs"


# ============================================================================ Docker, started here if needed


@dataclass
class DockerEnv:
    image: str
    started: subprocess.Popen | None = None
    error: str = ""


@pytest.fixture(scope="session")
def docker_env():
    started = None
    if not docker_ok():
        started, err = start_dockerd("/tmp/corral-test-dockerd.log")
        if started is None:
            yield DockerEnv(image="", error=err)
            return
    ref = f"corral-suite-busybox:{secrets.token_hex(4)}"
    p = subprocess.run(f"tar -C {BUSYBOX_ROOTFS} -c . | docker import - {ref}", shell=True, capture_output=True, text=True)
    if p.returncode != 0:
        yield DockerEnv(image="", started=started, error=f"docker import of the busybox rootfs failed: {p.stderr.strip()}")
    else:
        yield DockerEnv(image=ref, started=started)
        subprocess.run(["docker", "rmi", "-f", ref], capture_output=True)
    if started is not None:
        stop_dockerd(started)


@pytest_asyncio.fixture(scope="session")
async def docker_stack(docker_env):
    if docker_env.error:
        pytest.fail(f"Docker cannot run on this machine, so the docker substrate cannot be tested: {docker_env.error}")
    async with running_stack(node_args=["--substrate", "container", "--substrate", "docker"]) as s:
        yield s
    left = _docker_containers(s)
    assert left == [], f"docker containers left after the stack stopped: {left}"


def _docker_containers(stack, sid: str | None = None) -> list[str]:
    filt = [f"label={DOCKER_SANDBOX}={sid}"] if sid else []
    tag = _state_tag(stack)
    p = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={DOCKER_STATE}={tag}", *sum((["--filter", f] for f in filt), [])],
                       capture_output=True, text=True)
    return p.stdout.split()


def _docker_layer(cid: str) -> str:
    """The overlay2 layer dir of a container (the parent of its UpperDir)."""
    p = subprocess.run(["docker", "inspect", "--format", "{{.GraphDriver.Data.UpperDir}}", cid], capture_output=True, text=True)
    return os.path.dirname(p.stdout.strip())


def _state_tag(stack) -> str:
    import hashlib

    return hashlib.sha256(os.path.abspath(f"{stack.data_dir}/nodes/node-1").encode()).hexdigest()[:8]


# ============================================================================ one API over the substrates


@dataclass
class Target:
    """A place to run commands on one substrate: a sandbox that stays (container, docker), or
    fresh one-shot sandboxes (function). `last` is the sandbox id of the last call."""

    substrate: str
    stack: object
    client: AsyncClient
    nc: object
    image: str
    spec: dict = field(default_factory=dict)
    sandbox: object = None
    last: str = ""
    node: str = ""

    def __post_init__(self) -> None:
        self.substrate = self.substrate.split("-")[0]  # function-slots -> function

    async def start(self) -> Target:
        if self.substrate != "function":
            self.sandbox = await self.client.create(image=self.image, substrate=self.substrate, **self.spec)
            self.last, self.node = self.sandbox.id, self.sandbox.info.node
        return self

    async def exec(self, cmd, **kw) -> ExecResult:
        if self.sandbox is not None:
            return await self.sandbox.exec(cmd, **kw)
        body = {"spec": {"image": self.image, "substrate": "function", **self.spec}, "exec": {"cmd": cmd, **kw}}
        r = json.loads((await self.nc.request(subjects.SANDBOX_RUN, json.dumps(body).encode(), timeout=kw.get("timeout_s", 60) + 60)).data)
        if not r["ok"]:
            from corral_common.contract.errors import from_code

            raise from_code(r["error"]["code"], r["error"]["message"])
        self.last, self.node = r["sandbox_id"], r["node"]
        return ExecResult(**r["result"])

    async def close(self) -> None:
        if self.sandbox is not None:
            with contextlib.suppress(NotFound):
                await self.sandbox.destroy()


@pytest_asyncio.fixture(scope="session")
async def docker_client(docker_stack):
    c = await AsyncClient.connect(docker_stack.url)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="session")
async def docker_nc(docker_stack):
    conn = await nats.connect(docker_stack.url)
    yield conn
    await conn.close()


@pytest.fixture
def env(request, substrate):
    """(stack, client, nc, image) of the stack that offers `substrate` (set up before the test runs:
    async session fixtures cannot be started from inside a running test)."""
    if substrate == "docker":
        return (request.getfixturevalue("docker_stack"), request.getfixturevalue("docker_client"),
                request.getfixturevalue("docker_nc"), request.getfixturevalue("docker_env").image)
    if substrate == "function-slots":
        st, c, conn = request.getfixturevalue("slots_stack")
        return st, c, conn, "busybox"
    if substrate == "gvisor":
        st, c, conn = request.getfixturevalue("gvisor_stack")
        return st, c, conn, "busybox"
    if substrate in GUESTS:
        st, c, conn = request.getfixturevalue("guest_stack")
        return st, c, conn, "busybox"
    return request.getfixturevalue("stack"), request.getfixturevalue("client"), request.getfixturevalue("nc"), "busybox"


@pytest_asyncio.fixture(scope="session")
async def slots_stack():
    old = os.environ.get("CORRAL_FUNCTION_WARM")
    os.environ["CORRAL_FUNCTION_WARM"] = "0"
    s = make_stack(monitor=False)
    try:
        await s.start()
    finally:
        if old is None:
            del os.environ["CORRAL_FUNCTION_WARM"]
        else:
            os.environ["CORRAL_FUNCTION_WARM"] = old
    c = await AsyncClient.connect(s.url)
    conn = await nats.connect(s.url)
    yield s, c, conn
    await conn.close()
    await c.close()
    await s.stop()
    leaks.assert_clean(s.data_dir, "node-1")
    shutil.rmtree(s.data_dir, ignore_errors=True)


@pytest_asyncio.fixture(scope="session")
async def gvisor_stack():
    """A stack whose node also runs the gvisor substrate (runsc, installed by the setup script)."""
    async with running_stack(monitor=False, node_args=["--substrate", "container", "--substrate", "gvisor"]) as s:
        c = await AsyncClient.connect(s.url)
        conn = await nats.connect(s.url)
        yield s, c, conn
        await conn.close()
        await c.close()


@pytest_asyncio.fixture(scope="session")
async def guest_stack():
    """A stack whose node runs the microvm and vm substrates (QEMU, set up by the setup script)."""
    async with running_stack(monitor=False, microvm=True, vm=True) as s:
        c = await AsyncClient.connect(s.url)
        conn = await nats.connect(s.url)
        yield s, c, conn
        await conn.close()
        await c.close()


@contextlib.asynccontextmanager
async def target(where, substrate: str, **spec):
    st, client, nc, image = where
    spec = {"cpu": 0.5, "memory_mb": 128, **spec}
    t = await Target(substrate, st, client, nc, image, spec).start()
    try:
        yield t
    finally:
        await t.close()


async def ok(t: Target, cmd, **kw) -> ExecResult:
    r = await t.exec(cmd, **kw)
    assert r.exit_code == 0, (t.substrate, cmd, r)
    return r


# ============================================================================ exec


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_exec_result_env_stdin_cwd(env, substrate):
    async with target(env, substrate, env={"SPEC_VAR": "from-spec"}) as t:
        r = await t.exec("echo $((6*7)); echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "42\n", "err\n", False, False), r
        assert r.duration_ms > 0
        r = await ok(t, ["echo", "a b", "$HOME"])
        assert r.stdout == "a b $HOME\n"
        r = await ok(t, "cat; echo $FOO $SPEC_VAR; pwd", stdin="in\n", env={"FOO": "bar"}, cwd="/tmp")
        assert r.stdout == "in\nbar from-spec\n/tmp\n", r
        big = "x" * 300_000
        r = await ok(t, "wc -c", stdin=big)
        assert r.stdout.strip() == "300000"
        r = await t.exec("head -c 100000 /dev/zero | tr '\\0' y", max_output_bytes=1000)
        assert r.truncated is True and r.stdout == "y" * 1000, (r.truncated, len(r.stdout))
        r = await t.exec(["no-such-binary-x"])
        assert r.exit_code == 127 and "no-such-binary-x" in r.stderr, r
        r = await t.exec("pwd", cwd="/no/such/dir")
        assert r.exit_code == 126 and "/no/such/dir" in r.stderr, r
        r = await ok(t, "hostname")
        assert r.stdout.strip() == t.last, (r.stdout, t.last)


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_harness_exec_runs_as_its_own_uid(env, substrate):
    """exec harness=True runs as uid/gid 64222 without a capability on every substrate (agent
    commands as root); in sandboxes that stay, a harness session too, and the agent cannot list
    the io dir its scripts live in."""
    async with target(env, substrate) as t:
        status = "grep -E '^(Uid|Gid|CapEff|CapPrm|CapBnd):' /proc/self/status | tr -s '\\t' ' '"
        r = await ok(t, status, harness=True)
        assert r.stdout.splitlines() == ["Uid: 64222 64222 64222 64222", "Gid: 64222 64222 64222 64222",
                                         "CapPrm: 0000000000000000", "CapEff: 0000000000000000",
                                         "CapBnd: 0000000000000000"], r
        assert (await ok(t, "id -u")).stdout == "0\n"
        if substrate in STAYING:
            assert (await ok(t, "id -u; id -G", session="h", harness=True)).stdout == "64222\n64222\n"
            r = await t.exec("ls /.corral/io")
            assert r.exit_code != 0 and "Permission denied" in r.stderr, r


@pytest.mark.parametrize("substrate", STAYING)
async def test_exec_stream_chunks(env, substrate):
    async with target(env, substrate) as t:
        items = [i async for i in t.sandbox.exec_stream("echo one; sleep 0.3; echo two >&2; echo three")]
        chunks = [i for i in items[:-1]]
        assert "".join(c.data for c in chunks if c.stream == "stdout") == "one\nthree\n"
        assert "".join(c.data for c in chunks if c.stream == "stderr") == "two\n"
        assert isinstance(items[-1], ExecResult) and items[-1].stdout == "one\nthree\n"


@pytest.mark.parametrize("substrate", STAYING)
async def test_background_process_does_not_hold_the_exec(env, substrate):
    async with target(env, substrate) as t:
        t0 = time.monotonic()
        r = await ok(t, "echo started; sleep 30 &")
        assert r.stdout == "started\n" and time.monotonic() - t0 < 5, r
        r = await ok(t, "ps")
        assert "sleep 30" in r.stdout


# ============================================================================ sessions, files, pause


@pytest.mark.parametrize("substrate", STAYING)
async def test_sessions(env, substrate):
    async with target(env, substrate) as t:
        await ok(t, "mkdir -p /w && cd /w && export K=v1", session="a")
        assert (await ok(t, "pwd; echo $K", session="a")).stdout == "/w\nv1\n"
        assert (await ok(t, "pwd; echo ${K:-unset}", session="b")).stdout == "/\nunset\n"
        assert (await ok(t, "pwd; echo ${K:-unset}")).stdout == "/\nunset\n"
        r = await t.exec("read x; echo got $x; false", session="a", stdin="hello\n")
        assert r.stdout == "got hello\n" and r.exit_code == 1, r
        tok = secrets.randbelow(90000) + 10000
        r = await t.exec(f"sleep {tok} & sleep {tok + 1}", session="a", timeout_s=1)
        assert r.timed_out, r
        assert not await _procs(t, f"sleep {tok}"), "a timed-out session's processes survive"
        r = await ok(t, "pwd; echo ${K:-fresh}", session="a")
        assert r.stdout == "/\nfresh\n", r  # the killed session started afresh


@pytest.mark.parametrize("substrate", STAYING)
async def test_files(env, substrate):
    async with target(env, substrate) as t:
        sb = t.sandbox
        payload = bytes(range(256)) * 20
        await sb.files.write("/data/sub/x.bin", payload, mode=0o600)
        assert await sb.files.read("/data/sub/x.bin") == payload
        r = await ok(t, "wc -c < /data/sub/x.bin; stat -c %a /data/sub/x.bin; stat -c %a /tmp")
        assert r.stdout.split() == ["5120", "600", "1777"], r  # writing did not chmod the parents
        await sb.files.write("/data/sub/x.bin", "shorter")
        assert await sb.files.read("/data/sub/x.bin") == b"shorter"
        mine = f"sandbox-{secrets.token_hex(4)}\n".encode()
        await sb.files.write("/etc/sandbox-id", mine)  # (Docker bind-mounts its own /etc/hostname)
        for p in ("../../../../etc/sandbox-id", "/../../etc/sandbox-id", "//etc//sandbox-id", "/tmp/../../etc/sandbox-id"):
            assert await sb.files.read(p) == mine, p
        marker = f"/tmp/corral-sub-marker-{secrets.token_hex(6)}"
        with open(marker, "w") as f:
            f.write("HOST-SECRET")
        try:
            await ok(t, f"ln -s {marker} /tmp/l-marker; ln -s /etc/sandbox-id /tmp/l-host; ln -s /tmp/l-loop2 /tmp/l-loop1; "
                        "ln -s /tmp/l-loop1 /tmp/l-loop2")
            assert await sb.files.read("/tmp/l-host") == mine  # absolute symlinks resolve inside
            for p in (marker, "/tmp/l-marker", f"/proc/1/root{marker}"):
                with pytest.raises((NotFound, Forbidden)):
                    await sb.files.read(p)
            with pytest.raises((Forbidden, InvalidRequest, NotFound)):
                await sb.files.read("/tmp/l-loop1")
            await sb.files.write("/tmp/l-marker", "written through a link")
            with open(marker) as f:
                assert f.read() == "HOST-SECRET", "a write through a sandbox symlink reached the host"
        finally:
            os.unlink(marker)
        with pytest.raises(NotFound):
            await sb.files.read("/no/such/file")
        with pytest.raises(InvalidRequest):
            await sb.files.read("/etc")
        with pytest.raises(InvalidRequest):
            await sb.files.read("/data/sub/x.bin", max_bytes=3)
        with pytest.raises(InvalidRequest):
            await sb.files.write("/etc", b"x")


@pytest.mark.parametrize("substrate", STAYING)
async def test_pause_resume(env, substrate):
    async with target(env, substrate) as t:
        await t.sandbox.pause()
        with pytest.raises(Conflict):
            await t.exec("true")
        await t.sandbox.resume()
        await ok(t, "true")


# ============================================================================ limits


# gvisor's limits are the host cgroup's on the whole Sentry (substrates/gvisor.py): see
# test_gvisor_limits_bound_the_whole_sandbox for what they do there. A guest's RAM is larger
# (disk_mb on top: its writable layer lives there), but memory_mb binds its sandbox's processes.
@pytest.mark.parametrize("substrate", [s for s in SUBSTRATES if s != "gvisor"])
async def test_memory_limit(env, substrate):
    async with target(env, substrate, memory_mb=64) as t:
        r = await t.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=60)
        assert not r.timed_out, r
        assert r.oom_killed is True and r.exit_code == 137, r
        assert "memory_mb=64" in r.stderr and "200000000" not in r.stdout
        r = await ok(t, "x=$(head -c 1000000 /dev/zero | tr '\\0' a); echo ${#x}")
        assert r.stdout.strip() == "1000000" and r.oom_killed is False


@pytest.mark.parametrize("substrate", [s for s in SUBSTRATES if s != "gvisor"])
async def test_pids_limit(env, substrate):
    async with target(env, substrate, pids_max=32) as t:
        tok = secrets.randbelow(90000) + 10000
        # counted with shell builtins only: once the limit is reached nothing can fork
        # (ash gives up at the first refused fork: the loop runs in a subshell of its own)
        r = await t.exec(f"(for i in $(seq 1 80); do sleep {tok} >/dev/null 2>&1 & done) 2>/dev/null; "
                         "set -- /proc/[0-9]*; echo $#", timeout_s=30)
        procs = int(r.stdout.split()[-1])
        assert procs <= 32, f"{procs} processes in a sandbox with pids_max=32"
        assert procs >= 16, r
        assert len(_host_procs(f"sleep {tok}")) <= 32
        if t.substrate != "function":
            await t.exec(f"pkill -f 'sleep {tok}'; true")
        assert subprocess.run(["true"]).returncode == 0


async def test_gvisor_init_channel_is_out_of_the_sandboxes_reach(gvisor_stack):
    """Under gVisor init's control socket is a host socket in a directory the sandbox sees: by the
    first exec it has been moved out and the token file is gone, and nothing inside can connect to
    a host socket at all (one listening in the sandbox's own io dir, made here, refuses it)."""
    from .test_audit_sources import static_binary

    st, client, _nc = gvisor_stack
    sb = await client.create(image="busybox", substrate="gvisor", cpu=0.5, memory_mb=128)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        r = await sb.exec("ls -a /.corral/ctl")
        assert r.exit_code == 0 and r.stdout.split() == [".", ".."], r
        await sb.files.write("/tmp/uc", static_binary("unix_connect.c"), mode=0o755)
        io = f"{st.data_dir}/nodes/node-1/gvisor/{sb.id}/io"
        probe.bind(f"{io}/probe.sock")
        os.chmod(f"{io}/probe.sock", 0o777)
        probe.listen(1)
        r = await sb.exec("/tmp/uc /.corral/ctl/init.sock /.corral/io/probe.sock")
        assert r.stdout.splitlines() == ["/.corral/ctl/init.sock ENOENT", "/.corral/io/probe.sock EPERM"], r
    finally:
        probe.close()
        await sb.destroy()


async def test_gvisor_limits_bound_the_whole_sandbox(gvisor_stack):
    """On gvisor, memory_mb and pids_max are the host cgroup's limits on the whole Sentry (with its
    own share on top): a sandbox past its memory is OOM-killed as a whole (the exec says so, the
    sandbox ends), pids_max becomes a cap on host tasks; a neighbour on the same node is untouched,
    and nothing is left behind. (A fork storm against that cap can wedge the Sentry: not tested
    here, see substrates/gvisor.py.)"""
    st, client, _nc = gvisor_stack
    neighbour = await client.create(image="busybox", substrate="gvisor", cpu=0.5, memory_mb=128)
    try:
        hog = await client.create(image="busybox", substrate="gvisor", cpu=1.0, memory_mb=64)
        r = await hog.exec("dd if=/dev/zero of=/dev/null bs=300M count=1; echo survived", timeout_s=60)
        assert r.oom_killed is True and r.exit_code == 137 and "survived" not in r.stdout, r
        assert "memory_mb=64" in r.stderr, r
        state = "running"
        for _ in range(100):  # it ends: exited, then destroyed (gone from every node)
            try:
                state = (await hog.refresh()).state
            except NotFound:
                state = "destroyed"
            if state != "running":
                break
            await asyncio.sleep(0.1)
        assert state in ("exited", "failed", "destroyed"), state
        with contextlib.suppress(NotFound):
            await hog.destroy()

        storm = await client.create(image="busybox", substrate="gvisor", cpu=1.0, memory_mb=128, pids_max=32)
        parent = open(f"{st.data_dir}/nodes/node-1/cgroup-parent-gvisor").read().strip()
        assert int(open(f"{CG}/pids{parent}/{storm.id}/pids.max").read()) == 64 + 4 * 32  # SENTRY_TASKS + 4 per process
        await storm.destroy()

        r = await neighbour.exec("echo fine")
        assert r.exit_code == 0 and r.stdout == "fine\n", r
    finally:
        await neighbour.destroy()


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_disk_limit(env, substrate):
    """disk_mb caps the writable layer: a write past it fails with ENOSPC inside the sandbox (on
    docker too, through the tmpfs under its overlay2 layer), and the space is usable again after."""
    async with target(env, substrate, disk_mb=8) as t:
        r = await t.exec("dd if=/dev/zero of=/big bs=1M count=20; echo rc=$?; ls -l /big", timeout_s=30)
        assert "rc=0" not in r.stdout and "No space left" in r.stderr, r
        assert int(r.stdout.split("\n")[-2].split()[4]) <= 8 << 20, r  # ls -l: the size that got written
        if t.sandbox is None:
            return
        r = await ok(t, "rm /big; dd if=/dev/zero of=/tmp/mid bs=1M count=4 2>/dev/null; echo small > /small; cat /small")
        assert r.stdout == "small\n", r
        with pytest.raises(InvalidRequest, match="space"):
            await t.sandbox.files.write("/tmp/big2", b"x" * (5 << 20))  # 4 MiB used + 5 > 8
        r = await ok(t, "rm -f /tmp/mid /tmp/big2; dd if=/dev/zero of=/tmp/again bs=1M count=6 2>&1; echo rc=$?")
        assert r.stdout.strip().endswith("rc=0"), r


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_timeout_kills_every_process_of_the_exec(env, substrate):
    async with target(env, substrate) as t:
        tok = secrets.randbelow(90000) + 10000
        t0 = time.monotonic()
        r = await t.exec(f"sleep {tok} & setsid sleep {tok} & (trap '' TERM HUP INT; sleep {tok}) & "
                         f"nohup sleep {tok} >/dev/null 2>&1 & wait", timeout_s=1)
        assert r.timed_out is True and r.exit_code != 0 and "timed out" in r.stderr, r
        assert time.monotonic() - t0 < 20
        await asyncio.sleep(0.3)
        assert not await _procs(t, f"sleep {tok}"), f"processes of a timed-out {substrate} exec survive"
        r = await ok(t, "echo alive")
        assert r.stdout == "alive\n"


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_unread_stdin_does_not_hold_the_timeout(env, substrate):
    """A command that never reads a large stdin still ends at its timeout (the stdin must not be
    written to completion before the timeout starts to count), and the sandbox keeps working."""
    async with target(env, substrate) as t:
        r = await t.exec("sleep 30", stdin="x" * (4 << 20), timeout_s=2)
        assert r.timed_out is True, r  # a stdin written first held the exec until sleep ended: 0, not timed out
        r = await ok(t, "head -c 5; echo", stdin="hello and more")
        assert r.stdout == "hello\n", r


# ============================================================================ isolation


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_isolation_network_files_caps(env, substrate):
    async with target(env, substrate) as t:
        port = urlparse(t.stack.url).port
        r = await t.exec(f"nc -w 2 127.0.0.1 {port} </dev/null; echo rc=$?", timeout_s=20)
        assert "INFO" not in r.stdout and "rc=0" not in r.stdout, r
        host_ips = [ip for ip in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split() if ":" not in ip]
        for ip in host_ips[:3] + ["1.1.1.1", "172.17.0.1"]:
            r = await t.exec(f"nc -w 2 {ip} {port} </dev/null; echo rc=$?", timeout_s=20)
            assert "INFO" not in r.stdout and "rc=0" not in r.stdout, (ip, r)
        r = await ok(t, "ip -o link | cut -d: -f2")
        assert r.stdout.split() == ["lo"], r
        marker = f"/tmp/corral-iso-marker-{secrets.token_hex(6)}"
        with open(marker, "w") as f:
            f.write("HOST-SECRET-X")
        try:
            r = await t.exec(f"cat {marker}; echo rc=$?; cat /proc/1/root{marker}; echo rc=$?; cat /etc/shadow; echo rc=$?; "
                             f"ls {t.stack.data_dir}; echo rc=$?")
            assert "HOST-SECRET" not in r.stdout and "root:" not in r.stdout, r
            assert r.stdout.count("rc=0") == 0, r
        finally:
            os.unlink(marker)
        r = await ok(t, "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status")
        fields = dict(line.split(":\t") for line in r.stdout.strip().splitlines())
        if substrate != "gvisor":  # the Sentry's /proc/<pid>/status has no CapAmb or NoNewPrivs line
            assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2", fields
        for cap in fields:
            if cap.startswith("Cap"):
                assert int(fields[cap], 16) == 0, (cap, fields)
        r = await t.exec("mount -t tmpfs none /mnt; echo rc=$?; unshare -n true; echo rc=$?")
        assert r.stdout.count("rc=0") == 0, r
        r = await ok(t, "ls /proc | grep -cE '^[0-9]+$'")
        assert int(r.stdout.split()[0]) <= 8, r  # own pid namespace: its init, the exec, its children
        r = await t.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        for host_thing in ("nats-server", "pytest", "corral_node_agent", "dockerd"):
            assert host_thing not in r.stdout, (host_thing, r.stdout)


@pytest.mark.parametrize("substrate", ["container", "function", "function-slots"])
async def test_sandbox_root_is_not_host_root(env, substrate):
    """Container sandboxes and function calls (warm and in slots) run in a user namespace over a
    host uid range of their own (docker: whatever the daemon does, userns-remap is its setting);
    the files they make are their root's, what the harness runs is 64222 inside that range."""
    async with target(env, substrate) as t:
        r = await ok(t, "id -u; cat /proc/self/uid_map; echo x > /tmp/f && stat -c %u /tmp/f")
        uid, line, owner = r.stdout.splitlines()
        inside, base, count = (int(x) for x in line.split())
        assert (uid, inside, count, owner) == ("0", 0, 65536, "0"), r
        assert base >= 0x80000, f"sandbox root is host uid {base}"
        r = await ok(t, "id -u; cat /proc/self/uid_map", harness=True)
        assert r.stdout.splitlines()[0] == "64222", r
        # the same range for the sandbox that stays; a function call's next run is another sandbox
        again = int(r.stdout.split()[2])
        assert again == base if t.sandbox is not None else again >= 0x80000, r


@pytest.mark.parametrize("substrate", ["docker", "function", "function-slots"])
async def test_writes_do_not_reach_the_image(env, substrate):
    async with target(env, substrate) as t:
        await ok(t, "echo evil >> /etc/passwd; rm /bin/vi; echo x > /etc/newfile")
    async with target(env, substrate) as t2:
        r = await ok(t2, "cat /etc/passwd; ls /bin/vi /etc/newfile 2>&1; true")
        assert "evil" not in r.stdout and "/bin/vi" in r.stdout and "No such file" in r.stdout, r


# ============================================================================ leaks


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_nothing_left_after_destroy(env, substrate):
    st, client, nc, image = env
    node_dir = f"{st.data_dir}/nodes/node-1"
    parent = leaks.cgroup_parent(st.data_dir, "node-1")
    for i in range(2 if substrate in GUESTS else 5):  # (a guest boots in seconds under TCG)
        tok = secrets.randbelow(90000) + 10000
        t = await Target(substrate, st, client, nc, image, {"cpu": 0.25, "memory_mb": 64}).start()
        destroyed = await nc.subscribe(subjects.event("*", "destroyed"))
        try:
            await t.exec(f"sleep {tok} >/dev/null 2>&1 & echo x > /tmp/f")
            if t.substrate != "function":
                await t.exec("echo s", session="s")
                cid = _docker_containers(st, t.last) if substrate == "docker" else []
                layers = [_docker_layer(c) for c in cid]
                await t.sandbox.destroy()
                t.sandbox = None
            sid = t.last
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                m = await destroyed.next_msg(timeout=15)
                if json.loads(m.data)["sandbox_id"] == sid:
                    break
        finally:
            await destroyed.unsubscribe()
            await t.close()
        await asyncio.sleep(0.2)
        assert not _host_procs(f"sleep {tok}"), f"{substrate}: processes outlive the sandbox"
        cgs = [c for c in leaks.cgroups_under(parent) if sid in c]
        assert cgs == [], cgs
        assert [m for m in leaks.mounts_under(node_dir + "/") if sid in m] == []
        for d in ("sandboxes", "functions", "docker", "runc", "runc-fn"):
            assert not os.path.exists(f"{node_dir}/{d}/{sid}"), (d, sid)
        if substrate == "docker":
            assert _docker_containers(st, sid) == []
            for c in cid:
                assert not glob.glob(f"{CG}/*/docker/{c}*"), c
            for layer in layers:  # the tmpfs that capped its writable layer (disk_mb) is gone too
                assert layer and not leaks.mounts_under(layer) and not os.path.exists(layer), layer
        if substrate == "container":
            assert sid not in leaks.runc_containers(f"{node_dir}/runc")
        if substrate in GUESTS:  # its QEMU, its dir, its layers' leases
            left = leaks.node_leftovers(st.data_dir, "node-1")
            assert not [d for d in left["sandbox_dirs"] if d == sid] and not [g for g in left["guests"] if sid in g], left


# ============================================================================ bad input


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_bad_exec_input(env, substrate):
    async with target(env, substrate) as t:
        bad = [({"cmd": ""}, "invalid_request"), ({"cmd": []}, "invalid_request"), ({"cmd": 42}, "invalid_request"),
               ({"cmd": "true", "timeout_s": -5}, "invalid_request"), ({"cmd": "true", "env": {"A=B": "c"}}, "invalid_request"),
               ({"cmd": "true", "bogus": 1}, "invalid_request")]
        for body, code in bad:
            if t.substrate == "function":
                r = await _raw(t.nc, subjects.SANDBOX_RUN, {"spec": {"image": "busybox"}, "exec": body})
            else:
                r = await _raw(t.nc, subjects.sandbox_op(t.last, "exec"), body)
            assert r["ok"] is False and r["error"]["code"] == code, (body, r)
        await ok(t, "echo still fine")


async def test_run_bad_input(nc):
    cases = [
        (b"{not json", "invalid_request", "malformed"),
        ({"spec": {"image": "busybox"}}, "invalid_request", "exec"),
        ({"spec": {"imag": "busybox"}, "exec": {"cmd": "true"}}, "invalid_request", "imag"),
        ({"spec": {"image": "no-such-image"}, "exec": {"cmd": "true"}}, "not_found", "no-such-image"),
        ({"spec": {"image": "../etc"}, "exec": {"cmd": "true"}}, "invalid_request", "image"),
        ({"spec": {"substrate": "microvm"}, "exec": {"cmd": "true"}}, "invalid_request", "microvm"),
        ({"spec": {"substrate": "vm"}, "exec": {"cmd": "true"}}, "invalid_request", "vm"),
        ({"spec": {"substrate": "teleport"}, "exec": {"cmd": "true"}}, "invalid_request", "substrate"),
        ({"spec": {"substrate": "docker"}, "exec": {"cmd": "true"}}, "invalid_request", "available"),
        ({"exec": {"cmd": "true", "session": "s"}}, "invalid_request", "session"),
        ({"exec": {"cmd": "true", "stream": True}}, "invalid_request", "stream"),
        ({"spec": {"memory_mb": 1_000_000}, "exec": {"cmd": "true"}}, "capacity", "memory_mb"),
    ]
    for body, code, word in cases:
        r = await _raw(nc, subjects.SANDBOX_RUN, body)
        assert r["ok"] is False and r["error"]["code"] == code, (body, r)
        assert word in r["error"]["message"], (word, r)
    r = await _raw(nc, subjects.SANDBOX_RUN, {"exec": {"cmd": "echo fine"}})
    assert r["ok"] is True and r["result"]["stdout"] == "fine\n" and r["sandbox_id"].startswith("fn-") and r["node"], r


async def test_run_is_idempotent_by_request_id(nc, client):
    """A run retried with its request_id is answered from the first attempt (same sandbox, same
    output, `replayed`), concurrent duplicates run once, and a reused id with another command is
    a conflict."""
    job = f"idem-{secrets.token_hex(4)}"
    destroyed = await nc.subscribe(subjects.event("*", "destroyed"))
    try:
        rid = f"rid-{secrets.token_hex(6)}"
        body = {"spec": {"request_id": rid, "job": job}, "exec": {"cmd": "cat /proc/sys/kernel/random/uuid"}}
        first = await _raw(nc, subjects.SANDBOX_RUN, body)
        again = await _raw(nc, subjects.SANDBOX_RUN, body)
        assert first["ok"] and again["ok"], (first, again)
        assert again["sandbox_id"] == first["sandbox_id"] and again["result"]["stdout"] == first["result"]["stdout"], (first, again)
        assert first["result"]["replayed"] is False and again["result"]["replayed"] is True
        # the same through the SDK (request_id is a spec field)
        r = await client.run("cat /proc/sys/kernel/random/uuid", request_id=rid, job=job)
        assert r.stdout == first["result"]["stdout"] and r.replayed is True

        rid2 = f"rid-{secrets.token_hex(6)}"
        body2 = {"spec": {"request_id": rid2, "job": job}, "exec": {"cmd": "sleep 1; cat /proc/sys/kernel/random/uuid"}}
        replies = await asyncio.gather(*(_raw(nc, subjects.SANDBOX_RUN, body2) for _ in range(6)))
        assert all(r["ok"] for r in replies), replies
        assert len({(r["sandbox_id"], r["result"]["stdout"]) for r in replies}) == 1, replies
        assert [r["result"]["replayed"] for r in replies].count(False) == 1, replies

        r = await _raw(nc, subjects.SANDBOX_RUN, {"spec": {"request_id": rid, "job": job}, "exec": {"cmd": "echo other"}})
        assert r["ok"] is False and r["error"]["code"] == "conflict" and rid in r["error"]["message"], r
        # an error before anything ran keeps nothing: the retry is refused for the same reason again
        bad = {"spec": {"request_id": f"rid-{secrets.token_hex(6)}", "image": "no-such-image-x"}, "exec": {"cmd": "true"}}
        for _ in range(2):
            r = await _raw(nc, subjects.SANDBOX_RUN, bad)
            assert r["ok"] is False and r["error"]["code"] == "not_found", r
        # without a request_id every call runs
        plain = [await _raw(nc, subjects.SANDBOX_RUN, {"spec": {"job": job}, "exec": {"cmd": "true"}}) for _ in range(2)]
        assert plain[0]["sandbox_id"] != plain[1]["sandbox_id"] and not plain[1]["result"]["replayed"], plain

        # exactly one sandbox ran per request_id (every one-shot sandbox ends with a destroyed event)
        # a second sandbox for one request_id would have run beside the first, before the plain
        # runs that came after: once the last plain run's end is heard, a grace second covers it
        ran: dict[str, set[str]] = {rid: set(), rid2: set()}
        ended: set[str] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                m = await destroyed.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                break
            ev = json.loads(m.data)
            info = ev.get("info") or {}
            ended.add(ev["sandbox_id"])
            if info.get("job") == job and info.get("request_id") in ran:
                ran[info["request_id"]].add(ev["sandbox_id"])
            if plain[1]["sandbox_id"] in ended:
                deadline = min(deadline, time.monotonic() + 1.0)
        assert ran == {rid: {first["sandbox_id"]}, rid2: {replies[0]["sandbox_id"]}}, ran
    finally:
        await destroyed.unsubscribe()


async def test_create_rejects_one_shot_and_unoffered_substrates(nc):
    for sub, word in (("function", "one-shot"), ("microvm", "microvm"), ("vm", "vm"), ("docker", "available")):
        r = await _raw(nc, subjects.SANDBOX_CREATE, {"image": "busybox", "substrate": sub})
        assert r["ok"] is False and r["error"]["code"] == "invalid_request", (sub, r)
        assert word in r["error"]["message"], r
        r = await _raw(nc, subjects.SANDBOX_CREATE_BATCH, {"spec": {"image": "busybox", "substrate": sub}, "count": 2})
        assert r["ok"] is False and r["error"]["code"] == "invalid_request", (sub, r)


async def test_docker_bad_input(docker_client, docker_nc):
    with pytest.raises(NotFound) as e:
        await docker_client.create(image="no-such-docker-image:v9", substrate="docker")
    assert "no-such-docker-image" in str(e.value)
    with pytest.raises(InvalidRequest):
        await docker_client.create(image="Bad Image!!", substrate="docker")
    r = await _raw(docker_nc, subjects.SANDBOX_RUN, {"spec": {"substrate": "function"}, "exec": {"cmd": "true"}})
    assert r["ok"] is False and r["error"]["code"] == "invalid_request" and "docker" in r["error"]["message"], r
    # promises a substrate cannot keep are refused, never silently dropped
    with pytest.raises(InvalidRequest, match="protected_paths are not enforced on the 'docker' substrate"):
        await docker_client.create(image="busybox", substrate="docker", protected_paths=["/etc/shadow"])
    with pytest.raises(InvalidRequest, match="canaries are not enforced on the 'docker' substrate"):
        await docker_client.create(image="busybox", substrate="docker", canaries={"/srv/answer": "42"})


@pytest.mark.parametrize("substrate", ["function", "container"])
async def test_one_shot_runs_refuse_protected_paths_and_canaries(client, substrate):
    """A one-shot run has no moment to plant or mask anything: asking for it is an error."""
    with pytest.raises(InvalidRequest, match="not enforced on a one-shot run"):
        await client.run("cat /srv/answer", substrate=substrate, canaries={"/srv/answer": "42"})
    with pytest.raises(InvalidRequest, match="not enforced on a one-shot run"):
        await client.run("cat /etc/hostname", substrate=substrate, protected_paths=["/etc/hostname"])


# ============================================================================ audit


@pytest.mark.parametrize("substrate", SUBSTRATES)
async def test_execs_are_audited(env, substrate):
    async with target(env, substrate, job="audit-job", labels={"suite": "substrates"}) as t:
        tok = secrets.token_hex(6)
        await t.exec(f"echo audit-{tok}; exit 4")
        events = await _audit_events(t.nc, t.node, t.last, lambda e: tok in e.get("cmd", ""))
        ev = events[0]
        assert ev["kind"] == "exec" and ev["sandbox"] == t.last and ev["node"] == t.node, ev
        assert ev["exit_code"] == 4 and ev["stdout_bytes"] == len(f"audit-{tok}\n") and ev["job"] == "audit-job", ev
        assert ev["labels"] == {"suite": "substrates"}, ev
        if t.substrate == "function":
            assert ev["detail"]["substrate"] == "function" and ev["detail"]["one_shot"] == "1", ev


@pytest.mark.parametrize("substrate", STAYING)
async def test_file_activity_is_audited(env, substrate):
    """fanotify on the sandbox's root superblock: container overlays in FID mode (creates, renames,
    unlinks too), Docker's overlay2 merged dir in fd mode (opens, writes, execs), and a guest's
    root in the guest's own kernel (its guard, fd mode)."""
    async with target(env, substrate, job="audit-files") as t:
        tok = secrets.token_hex(4)
        await ok(t, f"echo hi > /tmp/f-{tok} && cat /etc/passwd >/dev/null && mkdir /tmp/d-{tok} && cp /bin/busybox /tmp/d-{tok}/true && /tmp/d-{tok}/true")
        want = {("write", f"/tmp/f-{tok}"), ("open", "/etc/passwd"), ("exec", f"/tmp/d-{tok}/true")}
        if substrate in ("container", "gvisor"):
            want |= {("create", f"/tmp/f-{tok}")}
        if substrate == "gvisor":  # the gofer opens files for the Sentry, which loads an executable itself
            want ^= {("exec", f"/tmp/d-{tok}/true"), ("open", f"/tmp/d-{tok}/true")}
        seen: set[tuple[str, str]] = set()
        js = t.nc.jetstream()
        sub = await js.subscribe(subjects.audit(t.node, t.last), ordered_consumer=True)
        deadline = time.monotonic() + 15
        try:
            while not want <= seen and time.monotonic() < deadline:
                try:
                    m = await sub.next_msg(timeout=1)
                except Exception:
                    continue
                for e in json.loads(m.data)["events"]:
                    if e["kind"] == "file":
                        seen.add((e.get("op", ""), e.get("path", "")))
                        assert e.get("pid", 0) > 0 and e["job"] == "audit-files", e
        finally:
            await sub.unsubscribe()
        assert want <= seen, (substrate, want - seen, sorted(seen)[:40])


# ============================================================================ function: Python calls


def square_plus(x, y=1):
    import os

    print("a print goes to stderr")
    return {"value": x * x + y, "in_sandbox": not os.path.exists("/var/lib/corral")}


def raises_value_error(msg):
    raise ValueError(f"bad: {msg}")


async def _async_fn(a, b):
    import asyncio

    await asyncio.sleep(0.01)
    return [a, b]


def _decorator(f):
    return f


@_decorator
def decorated(n):
    return list(range(n))


async def test_client_call(client):
    assert await client.call(square_plus, 7, y=2) == {"value": 51, "in_sandbox": True}
    assert await client.call(_async_fn, "a", {"k": [1]}) == ["a", {"k": [1]}]
    assert await client.call(decorated, 3) == [0, 1, 2]
    with pytest.raises(RemoteError) as e:
        await client.call(raises_value_error, "xyz")
    assert e.value.type_name == "ValueError" and "bad: xyz" in str(e.value)
    assert "raises_value_error" in e.value.remote_traceback and "Traceback" in e.value.remote_traceback
    k = 5
    with pytest.raises(TypeError, match="enclosing"):
        def closure():
            return k
        await client.call(closure)
    with pytest.raises(TypeError, match="plain function"):
        await client.call(lambda: 1)
    with pytest.raises(TypeError, match="JSON"):
        await client.call(square_plus, {1, 2})
    with pytest.raises(RemoteError, match="python3"):
        await client.call(square_plus, 1, image="busybox")
    with pytest.raises(Timeout):
        await client.call(_sleeper, 30, timeout_s=1)


def _sleeper(s):
    import time

    time.sleep(s)


async def test_sandbox_call_and_run_on_container(client):
    r = await client.run("echo hi from a container run; hostname", substrate="container")
    assert r.stdout.startswith("hi from a container run\nsb-"), r
    async with await client.create(image="debian", cpu=0.5, memory_mb=256) as sb:
        assert await sb.call(square_plus, 3) == {"value": 10, "in_sandbox": True}
        with pytest.raises(RemoteError, match="bad: q"):
            await sb.call(raises_value_error, "q")


def test_sync_client_run_and_call(stack):
    from corral_sdk import Client

    with Client(stack.url) as c:
        assert c.run("echo sync").stdout == "sync\n"
        assert c.call(square_plus, 2)["value"] == 5


# ============================================================================ docker specifics


async def test_docker_limits_and_labels(docker_client, docker_stack, docker_env):
    sb = await docker_client.create(image=docker_env.image, substrate="docker", cpu=0.5, memory_mb=96, pids_max=50,
                                    job="dj", labels={"a": "b"})
    try:
        ids = _docker_containers(docker_stack, sb.id)
        assert len(ids) == 1
        info = json.loads(subprocess.run(["docker", "inspect", ids[0]], capture_output=True, text=True).stdout)[0]
        hc = info["HostConfig"]
        assert hc["NanoCpus"] == 500_000_000 and hc["Memory"] == 96 << 20 and hc["PidsLimit"] == 50, hc
        assert hc["NetworkMode"] == "none" and hc["CapDrop"] == ["ALL"] and "no-new-privileges" in hc["SecurityOpt"], hc
        assert hc["ReadonlyRootfs"] is False and hc["Privileged"] is False
        assert hc["MemorySwap"] == 96 << 20  # memory+swap = memory: no swap
        limits = {u["Name"]: (u["Soft"], u["Hard"]) for u in hc["Ulimits"]}
        nofile = limits["nofile"][0]
        assert limits == {"core": (0, 0), "nofile": (nofile, nofile)} and 1024 <= nofile <= 65536, limits
        r = await sb.exec("ulimit -c; ulimit -n")
        assert r.stdout.split() == ["0", str(nofile)], r
        labels = info["Config"]["Labels"]
        assert labels[DOCKER_NODE] == "node-1" and labels[DOCKER_SANDBOX] == sb.id and labels[DOCKER_JOB] == "dj"
        assert info["Config"]["Hostname"] == sb.id
        u = await sb._call("info", Empty(), InfoReply)
        assert u.usage.memory_bytes > 0 and u.usage.pids >= 1, u.usage
    finally:
        await sb.destroy()


async def test_docker_snapshot_is_a_docker_and_a_corral_image(docker_client, docker_env):
    name = f"dsnap-{secrets.token_hex(4)}"
    sb = await docker_client.create(image=docker_env.image, substrate="docker")
    try:
        await sb.exec("mkdir -p /work && echo state > /work/s.txt && rm /bin/vi")
        r = await sb._call("snapshot", SnapshotRequest(name=name), SnapshotReply, timeout=600)
        img = r.image
        assert img.name == name and img.labels["docker_image"] == f"corral-snapshot/{name}:latest", img
        assert (await sb.exec("cat /work/s.txt")).stdout == "state\n"  # the source keeps running
    finally:
        await sb.destroy()
    try:
        # the committed Docker image runs on the docker substrate ...
        async with await docker_client.create(image=f"corral-snapshot/{name}:latest", substrate="docker") as d2:
            r = await d2.exec("cat /work/s.txt; ls /bin/vi 2>&1 || echo gone")
            assert r.stdout == "state\n" + r.stdout.split("\n", 1)[1] and r.stdout.endswith("gone\n"), r
        # ... and the imported corral image on the container substrate
        async with await docker_client.create(image=name, substrate="container") as c2:
            r = await c2.exec("cat /work/s.txt; ls /bin/vi 2>&1 || echo gone")
            assert r.stdout.startswith("state\n") and r.stdout.endswith("gone\n"), r
    finally:
        await docker_client.request(subjects.IMAGE_DELETE, NameRequest(name=name), ImageDeleteReply, 30)
        subprocess.run(["docker", "rmi", "-f", f"corral-snapshot/{name}:latest"], capture_output=True)


async def test_docker_runs_corral_images(docker_client):
    """A corral image name Docker lacks is exported to Docker once (from the node's layers)."""
    async with await docker_client.create(image="busybox", substrate="docker") as sb:
        r = await sb.exec("ls /bin/busybox && echo ok")
        assert r.stdout.endswith("ok\n"), r
        assert sb.info.image == "busybox"
    p = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", "corral-image/busybox"], capture_output=True, text=True)
    assert p.stdout.strip(), "the export is not a Docker image"
    subprocess.run(["docker", "rmi", *p.stdout.split()], capture_output=True)  # a cache: made again when needed


async def test_docker_heartbeat_substrates(docker_nc, nc):
    async def substrates_of(conn) -> list[str]:
        sub = await conn.subscribe(subjects.NODE_HEARTBEAT)
        try:
            return json.loads((await sub.next_msg(timeout=10)).data)["substrates"]
        finally:
            await sub.unsubscribe()

    assert sorted(await substrates_of(docker_nc)) == ["container", "docker"]
    assert sorted(await substrates_of(nc)) == ["container", "function"]


async def test_docker_reconcile_after_kill9(docker_env):
    s = make_stack(node_args=["--substrate", "docker"])
    await s.start()
    try:
        c = await AsyncClient.connect(s.url)
        keep = await c.create(image=docker_env.image, substrate="docker", cpu=0.2, memory_mb=64)
        await keep.exec("echo before > /state.txt; sleep 600 >/dev/null 2>&1 &")
        agent = s.proc("node-1").popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        # a container of this node's that has no record (a create cut short by the crash)
        tag = _state_tag(s)
        stray = subprocess.run(["docker", "create", "--label", f"{DOCKER_NODE}=node-1", "--label", f"{DOCKER_STATE}={tag}",
                                "--label", f"{DOCKER_SANDBOX}=sb-deadbeef0000", docker_env.image, "/bin/sh"],
                               capture_output=True, text=True).stdout.strip()
        assert stray
        nc2 = await nats.connect(s.url)
        rec = await nc2.subscribe(subjects.node_event("node-1", "reconciled"))
        s.restart("node-1")
        m = json.loads((await rec.next_msg(timeout=60)).data)
        assert keep.id in m["adopted"] and "sb-deadbeef0000" in m["cleaned"], m
        await nc2.close()
        r = await keep.exec("cat /state.txt; ps")
        assert r.stdout.startswith("before\n") and "sleep 600" in r.stdout, r
        assert subprocess.run(["docker", "inspect", stray], capture_output=True).returncode != 0, "stray container kept"
        await keep.destroy()
        await c.close()
    finally:
        await s.stop()
    assert _docker_containers(s) == []
    shutil.rmtree(s.data_dir, ignore_errors=True)


async def test_docker_unreachable_node_agent_refuses_to_start(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/corral-no-such-docker.sock")
    s = make_stack(node_args=["--substrate", "container", "--substrate", "docker"], monitor=False)
    try:
        with pytest.raises(RuntimeError, match="node-1 exited"):
            await s.start(timeout=60)
        with open(f"{s.data_dir}/logs/node-1.log", errors="replace") as f:
            log = f.read()
        assert "substrate 'docker' is enabled but Docker is not reachable" in log, log[-2000:]
        assert "corral-no-such-docker.sock" in log
    finally:
        await s.stop()
        shutil.rmtree(s.data_dir, ignore_errors=True)


async def test_image_export_and_import_docker(stack, client, docker_env):
    """corral image -> Docker (its layers mounted and `docker import`ed) and Docker image ->
    corral (`docker save`, image-cache import of the archive): what `corral image export --docker`
    and `corral image import-docker` do."""
    if docker_env.error:
        pytest.fail(docker_env.error)
    from corral_sdk.dockerio import export_image, import_docker_image

    ref = f"corral-export-test/busybox:{secrets.token_hex(4)}"
    name = f"from-docker-{secrets.token_hex(4)}"
    try:
        assert await export_image(stack.url, "busybox", ref) == ref
        out = subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "/bin/busybox", "echo", "exported"],
                             capture_output=True, text=True)
        assert out.stdout == "exported\n", out
        image = await import_docker_image(stack.url, ref, name)
        assert image.name == name and len(image.layers) == 1, image
        r = await client.run("cat /etc/passwd | head -1; echo via-docker-import", image=name)
        assert r.stdout.endswith("via-docker-import\n"), r
        with pytest.raises(NotFound):
            await import_docker_image(stack.url, "no-such-docker-image:x", "nope")
    finally:
        subprocess.run(["docker", "rmi", "-f", ref], capture_output=True)
        with contextlib.suppress(Exception):
            await client.request(subjects.IMAGE_DELETE, NameRequest(name=name), ImageDeleteReply, 30)


# ============================================================================ helpers


async def _raw(nc, subject: str, body, timeout: float = 60) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return json.loads((await nc.request(subject, data, timeout=timeout)).data)


async def _audit_events(nc, node: str, sid: str, want, timeout: float = 15) -> list[dict]:
    js = nc.jetstream()
    sub = await js.subscribe(subjects.audit(node, sid), ordered_consumer=True)
    found: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not found:
            try:
                m = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                break
            found += [e for e in json.loads(m.data)["events"] if want(e)]
    finally:
        await sub.unsubscribe()
    assert found, f"no audit event for {sid} on {subjects.audit(node, sid)}"
    return found


async def _procs(t: Target, text: str) -> list[str]:
    """Processes whose command line holds `text` where the sandbox's run: the host's, or inside
    a guest (which has a kernel of its own: the host does not see them)."""
    if t.substrate not in GUESTS:
        return _host_procs(text)
    r = await ok(t, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done")
    return [line for line in r.stdout.splitlines() if re.search(rf"(^|\s){re.escape(text)}(\s|$)", line)]


def _host_procs(text: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and re.search(rf"(^|\s){re.escape(text)}(\s|$)", cmd):
            out.append(f"{pid}: {cmd}")
    return out
