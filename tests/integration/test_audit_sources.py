"""The node-side audit sources: denied syscalls through seccomp notify (audit/seccomp.py), and
protected paths and canary files through fanotify permission events (audit/fanotify.py).

Each test does the misbehaviour in a real sandbox and checks three things: what the sandbox saw
(the call failed with EPERM, the file was unreadable or readable), the AuditEvent that arrived on
`corral.audit.<node>.<sandbox>`, and the monitor's alert on `corral.alerts.>`."""
from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import tempfile
import time

import msgspec
import pytest
import pytest_asyncio

from corral_common.contract import subjects
from corral_common.contract.audit import Alert, AuditBatch, AuditEvent
from corral_node_agent import userns
from corral_sdk import Forbidden

from .. import hostview

HERE = os.path.dirname(os.path.abspath(__file__))


class Watch:
    """Audit events of one sandbox (JetStream ordered consumer) and alerts from the bus."""

    def __init__(self, nc, node: str, sid: str):
        self.nc, self.node, self.sid = nc, node, sid
        self.events: list[AuditEvent] = []
        self.alerts: list[Alert] = []

    async def __aenter__(self):
        js = self.nc.jetstream()

        async def on_audit(msg) -> None:
            self.events.extend(msgspec.json.decode(msg.data, type=AuditBatch).events)

        async def on_alert(msg) -> None:
            a = msgspec.json.decode(msg.data, type=Alert)
            if a.sandbox == self.sid:
                self.alerts.append(a)

        self.subs = [await js.subscribe(subjects.audit(self.node, self.sid), cb=on_audit, ordered_consumer=True),
                     await self.nc.subscribe(subjects.ALERTS_ALL, cb=on_alert)]
        return self

    async def __aexit__(self, *exc):
        for s in self.subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass

    async def until(self, pred, timeout: float = 15, what: str = "") -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not pred():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; events: {[(e.kind, e.syscall, e.path, e.op) for e in self.events]}, "
                                     f"alerts: {[a.rule for a in self.alerts]}")
            await asyncio.sleep(0.05)

    def of(self, kind: str) -> list[AuditEvent]:
        return [e for e in self.events if e.kind == kind]


def static_binary(source: str) -> bytes:
    """tests/integration/data/<source>, compiled static (sandbox images may have no libc)."""
    if not shutil.which("gcc"):
        pytest.fail("gcc is needed to build the test programs (apt-get install gcc)")
    d = tempfile.mkdtemp(prefix="crl-bin-")
    out = f"{d}/prog"
    subprocess.run(["gcc", "-static", "-O1", "-o", out, f"{HERE}/data/{source}"], check=True, capture_output=True)
    with open(out, "rb") as f:
        data = f.read()
    shutil.rmtree(d, ignore_errors=True)
    return data


@pytest.fixture(scope="module")
def denied_calls_binary():
    return static_binary("denied_calls.c")


@pytest_asyncio.fixture(scope="module")
async def protected_image(stack):
    return await import_protected_image(stack.url)


async def import_protected_image(url: str) -> str:
    import nats

    d = tempfile.mkdtemp(prefix="crl-prot-")
    os.makedirs(f"{d}/secret")
    os.makedirs(f"{d}/hidden/sub")
    os.makedirs(f"{d}/visible")
    for path, text in (("secret/answer.txt", "42\n"), ("hidden/test_x.py", "def test_x():\n    assert True\n"),
                       ("hidden/sub/deep.txt", "deep\n"), ("visible/readme.txt", "hello\n")):
        with open(f"{d}/{path}", "w") as f:
            f.write(text)
    conn = await nats.connect(url)
    try:
        msg = await conn.request(subjects.IMAGE_IMPORT, json.dumps(
            {"name": "t-audit-protected", "source": "dir", "path": d, "base": "busybox"}).encode(), timeout=120)
        r = json.loads(msg.data)
        assert r["ok"] is True, r
    finally:
        await conn.close()
        shutil.rmtree(d, ignore_errors=True)
    return "t-audit-protected"


EXPECTED_SYSCALLS = {
    "ptrace": ("ptrace", None), "process_vm_readv": ("process_vm_readv", None),
    "name_to_handle_at": ("name_to_handle_at", None), "open_by_handle_at": ("open_by_handle_at", None),
    "bpf": ("bpf", None), "perf_event_open": ("perf_event_open", None), "keyctl": ("keyctl", None),
    "userfaultfd": ("userfaultfd", None), "FS_IOC_FIEMAP": ("ioctl", "FS_IOC_FIEMAP"),
    "FS_IOC_GETFSMAP": ("ioctl", "FS_IOC_GETFSMAP"), "mount": ("mount", None), "unshare": ("unshare", None),
    "FS_IOC_FIEMAP_HIGH": ("ioctl", "FS_IOC_FIEMAP"),  # the request's upper 32 bits set: the same ioctl
}


async def test_denied_syscalls_fail_with_eperm_and_are_audited(client, nc, denied_calls_binary):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600, job="audit-src", labels={"t": "seccomp"})
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            # from the shell: mount(2), unshare(2) and clone(2) with a namespace flag
            r = await sb.exec("mount -t tmpfs x /mnt; echo rc=$?; unshare -n true; echo rc=$?")
            assert r.stdout.count("rc=1") == 2, (r.stdout, r.stderr)
            assert "not permitted" in r.stderr, r.stderr
            await w.until(lambda: {"mount", "unshare"} <= {e.syscall for e in w.of("syscall")}, what="mount and unshare events")
            # every other denied call, from a static program
            await sb.files.write("/bin/denied_calls", denied_calls_binary, mode=0o755)
            r = await sb.exec("/bin/denied_calls")
            assert r.exit_code == 0, r.stderr
            got = dict(line.split() for line in r.stdout.strip().splitlines())
            assert got == {name: "1" for name in EXPECTED_SYSCALLS}, got  # every one EPERM

            def seen() -> set[tuple[str, str | None]]:
                return {(e.syscall, e.detail.get("request") if e.syscall == "ioctl" else None) for e in w.of("syscall")}

            await w.until(lambda: set(EXPECTED_SYSCALLS.values()) <= seen(), what="every denied syscall")
            for e in w.of("syscall"):
                assert e.denied and e.pid > 1 and e.node == sb.info.node and e.job == "audit-src" and e.labels == {"t": "seccomp"}
                assert e.id and e.comm in ("denied_calls", "mount", "unshare", "busybox", "sh"), e.comm
            fiemap = next(e for e in w.of("syscall") if e.detail.get("request") == "FS_IOC_FIEMAP")
            assert fiemap.op == "FS_IOC_FIEMAP" and fiemap.comm == "denied_calls"
            # the monitor turns them into alerts
            rules = {"ptrace_debugging", "handle_or_blockmap_access", "denied_syscall"}
            await w.until(lambda: rules <= {a.rule for a in w.alerts}, what="alerts")
    finally:
        await sb.destroy()


@pytest.fixture(scope="module")
def syscall_flood_binary():
    return static_binary("syscall_flood.c")


async def test_a_denied_syscall_flood_is_throttled_reported_and_fully_audited(client, nc, syscall_flood_binary):
    """A sandbox calling a denied syscall in a tight loop is slowed to the listener's rate (its
    calls wait in the kernel, not the node-agent), a "throttled" event says so, every call is
    still answered EPERM and audited, and a neighbour's execs are served meanwhile."""
    from corral_node_agent.audit.budgets import NOTIFY_BURST, NOTIFY_RATE

    a = await client.create(image="busybox", cpu=1, memory_mb=128, ttl_s=600, job="audit-src")
    b = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600, job="audit-src")
    try:
        async with Watch(nc, a.info.node, a.id) as w:
            await a.files.write("/bin/flood", syscall_flood_binary, mode=0o755)
            flood = asyncio.ensure_future(a.exec("/bin/flood 3", timeout_s=60))
            served = 0
            while not flood.done():
                r = await b.exec("echo neighbour")
                assert r.stdout == "neighbour\n", r
                served += 1
                await asyncio.sleep(0.1)
            r = await flood
            calls, eperm, secs = r.stdout.split()
            calls_n, secs_f = int(calls), float(secs)
            assert calls_n == int(eperm) > 0, r.stdout  # every call answered, every answer EPERM
            assert calls_n <= NOTIFY_BURST + NOTIFY_RATE * secs_f * 1.25 + 50, (calls_n, secs_f)
            assert served >= 1
            await w.until(lambda: any(e.op == "throttled" for e in w.of("syscall")), what="a throttled report")
            t = next(e for e in w.of("syscall") if e.op == "throttled")
            assert t.denied and t.syscall == "keyctl" and t.detail["rate_per_s"] == f"{NOTIFY_RATE:g}", t
            await w.until(lambda: sum(1 for e in w.of("syscall") if e.syscall == "keyctl" and e.op != "throttled") >= calls_n,
                          timeout=60, what=f"all {calls_n} calls audited")
            state = await a.audit_state()
            assert state.lost == 0, state
    finally:
        await a.destroy()
        await b.destroy()


async def test_protected_paths_are_unreadable_and_every_attempt_is_audited(client, nc, protected_image):
    await check_protected_paths(client, nc, protected_image)


async def check_protected_paths(client, nc, image: str, substrate: str = "container", monitored: bool = True) -> None:
    """What the sandbox sees of its protected paths, the events of every attempt, and (with a
    monitor on the stack) the alert; on a substrate whose root the node sees (`container`),
    the file activity of unprotected files too."""
    sb = await client.create(image=image, substrate=substrate, cpu=0.5, memory_mb=128, ttl_s=600, job="audit-src",
                             protected_paths=["/secret/answer.txt", "/hidden", "/not/in/image"])
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            r = await sb.exec("cat /secret/answer.txt")
            assert r.exit_code != 0 and "42" not in r.stdout and "not permitted" in r.stderr, (r.stdout, r.stderr)
            r = await sb.exec("cat /hidden/test_x.py; ls /hidden; cat /hidden/sub/deep.txt; "
                              "ln -s /secret/answer.txt /tmp/l; cat /tmp/l; cp /secret/answer.txt /tmp/c")
            assert "assert" not in r.stdout and "deep" not in r.stdout and "42" not in r.stdout, r.stdout
            assert r.stderr.count("not permitted") >= 5, r.stderr
            # unprotected files read fine, and stat still works on the protected ones
            r = await sb.exec("cat /visible/readme.txt && ls -la /secret/ >/dev/null && echo ok")
            assert r.stdout == "hello\nok\n", (r.stdout, r.stderr)
            # through the bus: refused, by name and through a link
            for path in ("/secret/answer.txt", "/secret/../secret/answer.txt", "/hidden/test_x.py", "/tmp/l", "/hidden/sub/deep.txt"):
                with pytest.raises(Forbidden):
                    await sb.files.read(path)
            assert (await sb.files.read("/visible/readme.txt")) == b"hello\n"

            def paths() -> set[str]:
                return {e.path for e in w.of("file") if e.detail.get("protected") == "1" and e.denied}

            want = {"/secret/answer.txt", "/hidden/test_x.py", "/hidden", "/hidden/sub/deep.txt"}
            await w.until(lambda: want <= paths(), what="protected-path events")
            ev = next(e for e in w.of("file") if e.path == "/secret/answer.txt" and e.op == "open")
            assert ev.comm == "cat" and ev.pid > 1 and ev.job == "audit-src"
            await w.until(lambda: len([e for e in w.of("file") if e.detail.get("via") == "files.read"]) == 5, what="files.read events")
            # (its open is ordinary file activity, not a protected-path event)
            assert not any(e.path == "/visible/readme.txt" and (e.denied or e.detail.get("protected")) for e in w.events if e.kind == "file")
            if substrate == "container":
                assert any(e.path == "/visible/readme.txt" and e.op == "open" for e in w.of("file"))
            if monitored:
                await w.until(lambda: "protected_path_read" in {a.rule for a in w.alerts}, what="protected_path_read alert")
    finally:
        await sb.destroy()


async def test_canary_reads_work_and_raise_an_alert(client, nc):
    await check_canaries(client, nc)


async def check_canaries(client, nc, substrate: str = "container", monitored: bool = True) -> None:
    content = '{"answers": [42, 7]}'
    sb = await client.create(image="busybox", substrate=substrate, cpu=0.5, memory_mb=128, ttl_s=600, job="audit-src",
                             canaries={"/root/.cache/answers.json": content, "/opt/mgmt/solution.txt": "x = 1\n"})
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            r = await sb.exec("ls -la /root/.cache /opt/mgmt >/dev/null && echo listed")
            assert r.stdout == "listed\n"
            await asyncio.sleep(0.3)
            assert not w.of("canary"), "listing a directory is not reading a canary"
            r = await sb.exec("cat /root/.cache/answers.json")
            assert r.exit_code == 0 and r.stdout == content
            await w.until(lambda: any(e.path == "/root/.cache/answers.json" for e in w.of("canary")), what="canary event")
            ev = next(e for e in w.of("canary") if e.path == "/root/.cache/answers.json")
            assert ev.comm == "cat" and not ev.denied and ev.op == "open" and ev.job == "audit-src"
            # read through the bus, it is reported too (and still readable)
            assert await sb.files.read("/opt/mgmt/solution.txt") == b"x = 1\n"
            await w.until(lambda: any(e.path == "/opt/mgmt/solution.txt" and e.detail.get("via") == "files.read" for e in w.of("canary")),
                          what="canary read through files.read")
            if monitored:
                await w.until(lambda: "canary_read" in {a.rule for a in w.alerts}, what="canary_read alert")
    finally:
        await sb.destroy()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_audit_sources_leak_no_fds(client, stack, protected_image):
    pid = stack.proc("node-1").popen.pid
    # warm up (first sandbox of an image mounts its layers), then measure
    sb = await client.create(image=protected_image, cpu=0.25, memory_mb=64, ttl_s=600, protected_paths=["/hidden"])
    await sb.destroy()
    await asyncio.sleep(0.3)
    before = _fds(pid)
    sbs = await asyncio.gather(*(client.create(image=protected_image, cpu=0.25, memory_mb=64, ttl_s=600,
                                               protected_paths=["/secret/answer.txt", "/hidden"],
                                               canaries={"/root/answers.json": "{}"}) for _ in range(5)))
    during = _fds(pid)
    assert during >= before + 5, (before, during)  # one seccomp notify fd per sandbox
    for sb in sbs:
        r = await sb.exec("cat /secret/answer.txt /root/answers.json; mount -t tmpfs x /mnt")
        assert r.stdout == "{}" and "answer.txt': Operation not permitted" in r.stderr and "mount: permission denied" in r.stderr, (r.stdout, r.stderr)
    await asyncio.gather(*(sb.destroy() for sb in sbs))
    await asyncio.sleep(0.5)
    after = _fds(pid)
    assert after <= before, (before, during, after)


async def test_adopted_sandbox_after_agent_crash_stays_protected_and_audited():
    """kill -9 the node-agent: its restart re-marks the adopted sandbox's protected paths from the
    persisted spec, and takes the sandbox's seccomp notify fd back from its init (runc sends it
    once, at start): denied syscalls are refused (EPERM) and audited again, watched ones (kill)
    work."""
    import signal

    from corral_sdk import AsyncClient

    from ..conftest import make_stack
    from ..leaks import assert_clean

    stack = make_stack(nodes=1, monitor=False)
    await stack.start()
    try:
        c = await AsyncClient.connect(stack.url)
        sb = await c.create(image="busybox", cpu=0.1, memory_mb=32, protected_paths=["/etc/passwd"])
        r = await sb.exec("cat /etc/passwd; mount -t tmpfs x /mnt")
        assert "passwd': Operation not permitted" in r.stderr and "mount: permission denied" in r.stderr, r.stderr
        agent = stack.proc("node-1").popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        t_restart = time.time()
        stack.restart("node-1")
        for _ in range(200):
            try:
                r = await sb.exec("cat /etc/passwd; echo rc=$?; unshare -n true; echo rc=$?", timeout_s=5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert "root:" not in r.stdout and "passwd': Operation not permitted" in r.stderr, (r.stdout, r.stderr)
        assert "Function not implemented" not in r.stderr and r.stderr.count("Operation not permitted") == 2, r.stderr
        with pytest.raises(Forbidden):
            await sb.files.read("/etc/passwd")
        # kill(2) is a watched call (answered through the notify fd): it works after the restart
        r = await sb.exec("sleep 30 & kill $!; echo rc=$?; wait $!; echo st=$?", timeout_s=10)
        assert "rc=0" in r.stdout and "st=143" in r.stdout, (r.stdout, r.stderr)
        # and the denied call after the restart is in the audit stream, under this sandbox
        async with Watch(c.nc, sb.info.node, sb.id) as w:
            await w.until(lambda: any(e.syscall == "unshare" and e.ts > t_restart for e in w.of("syscall")),
                          what="the unshare denied after the restart")
        await sb.destroy()
        await c.close()
    finally:
        await stack.stop()
    assert_clean(stack.data_dir, "node-1")
    shutil.rmtree(stack.data_dir, ignore_errors=True)


async def test_protected_paths_fail_closed_while_the_agent_is_down():
    """The container sees decoys over its protected paths (masks.py): while the node-agent runs,
    opening them is denied and audited as before; while it is dead (no fanotify group), a process
    of the sandbox reads empty files, never the content. The decoys cannot be removed from inside."""
    import signal

    from corral_sdk import AsyncClient

    from ..conftest import make_stack
    from ..leaks import assert_clean

    stack = make_stack(nodes=1, monitor=False)
    await stack.start()
    try:
        image = await import_protected_image(stack.url)
        c = await AsyncClient.connect(stack.url)
        sb = await c.create(image=image, cpu=0.2, memory_mb=64, protected_paths=["/secret/answer.txt", "/hidden"])
        r = await sb.exec("cat /secret/answer.txt; cat /hidden/sub/deep.txt; cat /visible/readme.txt")
        assert r.stdout == "hello\n" and r.stderr.count("Operation not permitted") == 2, (r.stdout, r.stderr)
        # the cover cannot be taken off or linked around
        r = await sb.exec("rm -f /secret/answer.txt; echo rc=$?; mv /secret/answer.txt /tmp/a; echo rc=$?; "
                          "ln /secret/answer.txt /tmp/h; echo rc=$?; rm -rf /hidden; umount /hidden; echo rc=$?")
        assert r.stdout.count("rc=1") == 4, (r.stdout, r.stderr)
        # a process that reads them as soon as the agent is gone (told so by a file the test
        # writes into the sandbox once it has killed the agent)
        await sb.exec("(while [ ! -e /tmp/go ]; do sleep 0.1; done; "
                      "cat /secret/answer.txt /hidden/test_x.py /hidden/sub/deep.txt > /tmp/out 2>&1; "
                      "echo done >> /tmp/out) >/dev/null 2>&1 &")
        agent = stack.proc("node-1").popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        sdir = glob.glob(f"{stack.data_dir}/**/sandboxes/{sb.id}", recursive=True)
        assert sdir, "the sandbox's state dir"
        # as the sandbox's root, as the files API writes (host root owns nothing in its range)
        with userns.acting_as(hostview.uid_base(sdir[0])), open(f"{hostview.root(sdir[0])}/tmp/go", "w"):
            pass
        out = f"{hostview.rw(sdir[0])}/upper/tmp/out"
        for _ in range(600):  # read from the host: the agent is still down
            if os.path.exists(out) and open(out).read().endswith("done\n"):
                break
            await asyncio.sleep(0.1)
        with open(out) as f:
            assert f.read() == "done\n"  # read while unguarded: empty files, no content, no error
        stack.restart("node-1")
        # the restarted agent marks the decoys again: denied and audited
        for _ in range(200):
            try:
                r = await sb.exec("cat /secret/answer.txt /hidden/test_x.py", timeout_s=5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert r.stdout == "" and r.stderr.count("Operation not permitted") == 2, (r.stdout, r.stderr)
        await sb.destroy()
        await c.close()
    finally:
        await stack.stop()
    assert_clean(stack.data_dir, "node-1")
    shutil.rmtree(stack.data_dir, ignore_errors=True)
