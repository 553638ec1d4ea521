"""The microvm and vm substrates: each sandbox a QEMU guest (`-M microvm`, or a q35 PC) with a
kernel of its own (TCG here, where nested KVM does not run a vCPU; see substrates/microvm.py). The
same contract as a container for what they offer (exec, stdin, cwd, env, timeouts, files, disk_mb,
pause), a clear error for what they do not offer yet, and nothing left behind; every test runs on
both."""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time

import msgspec
import nats
import pytest
import pytest_asyncio

from corral_common.contract import subjects
from corral_common.contract.images import ImageDeleteReply, NameRequest
from corral_common.contract.messages import Event, ExecChunk, ExecResult
from corral_node_agent.substrates.microvm_guest import find_kernel
from corral_sdk import AsyncClient, Conflict, Forbidden, InvalidRequest, NotFound

from .. import leaks
from ..conftest import running_stack
from .test_audit_sources import Watch, check_canaries, check_protected_paths, import_protected_image
from .test_changes import check_listing_and_packing
from .test_warm_pool import Heartbeats


@pytest_asyncio.fixture(scope="module")
async def vm_stack():
    # what `corral up --microvm --vm --warm-pool microvm:busybox=1 --warm-pool vm:busybox=1` starts
    async with running_stack(monitor=False, microvm=True, vm=True,
                             node_args=["--warm-pool", "microvm:busybox=1", "--warm-pool", "vm:busybox=1"]) as s:
        c = await AsyncClient.connect(s.url)
        yield s, c
        await c.close()


@pytest.fixture(scope="module", params=["microvm", "vm"])
def substrate(request) -> str:
    return request.param


@pytest_asyncio.fixture(scope="module")
async def guest(vm_stack, substrate):
    _, c = vm_stack
    sb = await c.create(image="busybox", substrate=substrate, memory_mb=128, disk_mb=16)
    yield sb
    with contextlib.suppress(NotFound):
        await sb.destroy()


async def test_a_guest_has_a_kernel_and_processes_of_its_own(guest, substrate):
    r = await guest.exec("uname -r; cat /proc/1/cmdline | tr '\\0' ' '; echo; ps -o args | grep -c -e '[n]ats-server' -e '[p]ython'; hostname")
    release, init, host_procs, hostname = r.stdout.strip().split("\n")
    assert release == find_kernel()[1], r  # the distribution's kernel package, not the host's kernel
    # PID 1 of the sandbox's PID namespace is corral-guest's holder, not anything of the host's
    assert init.strip().startswith("/bin/corral-guest hold"), r
    assert host_procs == "0", r  # the host's processes (this test, the stack's services) are not there to see
    assert hostname == guest.id
    r = await guest.exec("ls /sys/class/net")
    assert r.stdout.split() == ["lo"], r  # no network device: network none
    r = await guest.exec("ls /sys/bus/pci/devices 2>/dev/null | wc -l")
    assert (int(r.stdout) > 0) == (substrate == "vm"), r  # a q35 PC has a PCI bus; a microvm has none


async def test_exec_keeps_the_contract(guest):
    r = await guest.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n"), r
    r = await guest.exec(["/bin/sh", "-c", 'echo "$A|$1"', "x", "arg one"], env={"A": "b c"})
    assert r.stdout == "b c|arg one\n", r
    r = await guest.exec("cat; pwd", stdin="line\n", cwd="/etc")
    assert r.stdout == "line\n/etc\n", r
    r = await guest.exec("true", cwd="/no/such/dir")
    assert r.exit_code == 126 and "/no/such/dir" in r.stderr, r
    r = await guest.exec(["no-such-command"])
    assert r.exit_code == 127 and "no-such-command" in r.stderr, r
    r = await guest.exec("head -c 300000 /dev/zero | tr '\\0' x", max_output_bytes=1000)
    assert r.truncated and r.stdout == "x" * 1000, (r.truncated, len(r.stdout))


async def test_a_timeout_kills_the_exec_and_its_children_but_not_the_guest(guest):
    r = await guest.exec("sleep 300 & sleep 301; echo never", timeout_s=1)
    assert r.timed_out and r.exit_code == 137 and "never" not in r.stdout and "timed out" in r.stderr, r
    r = await guest.exec("ps -o args | grep -c '^sleep 30[01]'")
    assert r.stdout.strip() == "0", r
    r = await guest.exec("sleep 200 >/dev/null 2>&1 & echo started")  # a background process does not hold the exec
    assert r.exit_code == 0 and r.stdout == "started\n", r
    r = await asyncio.wait_for(guest.exec("echo alive"), 30)
    assert r.stdout == "alive\n"


async def test_the_guest_agent_is_out_of_the_sandboxs_reach(guest):
    """The sandbox's commands are root of the guest's kernel without its powers: they see only
    their own processes (the agent and its timers are in another PID namespace), hold no
    capability, cannot mount, load modules, power the guest off, write the kernel's knobs or
    reach the virtio-serial port the agent answers the host on; a timeout still holds."""
    r = await guest.exec("for f in /proc/[0-9]*/fd/*; do readlink $f; done; echo end")
    assert r.stdout.endswith("end\n") and "vport" not in r.stdout, r  # the agent's line to the host is not inherited
    r = await guest.exec("ps -o pid,args")
    assert "agent.sh" not in r.stdout and "/init" not in r.stdout.replace("/bin/corral-guest", ""), r
    kill_timers = "for p in $(pidof sleep); do kill -9 $(cut -d' ' -f4 /proc/$p/stat) $p; done 2>/dev/null"
    r = await asyncio.wait_for(guest.exec(f"sleep 0.3; {kill_timers}; sleep 77", timeout_s=1), 30)
    assert r.timed_out and r.exit_code == 137 and r.duration_ms < 5000, r  # the guest's own timer ended it
    r = await guest.exec("ps -o args | grep -c '^sleep 77'")
    assert r.stdout.strip() == "0", r
    r = await guest.exec("grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status | tr -s '\\t' ' '")
    assert r.stdout.splitlines() == ["CapEff: 0000000000000000", "CapBnd: 0000000000000000", "NoNewPrivs: 1", "Seccomp: 2"], r
    r = await guest.exec("ls /dev; ls /dev | grep -c -e vport -e hvc -e vd -e mem; "
                         "for t in 'mount -t tmpfs x /mnt' 'poweroff -f' 'insmod /lib/modules/x.ko' 'rmmod erofs' "
                         "'echo 1 > /proc/sys/vm/drop_caches' 'echo b > /proc/sysrq-trigger' 'touch /sys/kernel/x' "
                         "'chroot /proc/1/root true' 'cat /proc/1/root/agent.sh'; do sh -c \"$t\" 2>/dev/null && echo \"did: $t\"; done; echo end")
    assert r.stdout.split()[-2:] == ["0", "end"] and "did:" not in r.stdout, r
    assert (await guest.exec("echo alive")).stdout == "alive\n"


async def test_files_round_trip_and_disk_mb_binds(guest):
    data = bytes(range(256)) * 40
    await guest.files.write("/work/deep/f.bin", data, mode=0o640)  # parents made
    assert await guest.files.read("/work/deep/f.bin") == data
    r = await guest.exec("stat -c %a /work/deep/f.bin; od -An -tx1 -N4 /work/deep/f.bin")
    assert r.stdout.split() == ["640", "00", "01", "02", "03"], r
    with pytest.raises(NotFound):
        await guest.files.read("/no/such/file")
    with pytest.raises(InvalidRequest):
        await guest.files.write("/etc/passwd/f", b"x")  # under a file
    with pytest.raises(InvalidRequest):
        await guest.files.read("/etc")
    r = await guest.exec("mkfifo /tmp/pipe")
    with pytest.raises(InvalidRequest, match="regular"):  # a FIFO would hold the agent's reader forever
        await guest.files.read("/tmp/pipe")
    with pytest.raises(InvalidRequest, match="regular"):
        await guest.files.write("/tmp/pipe", b"x")
    with pytest.raises(InvalidRequest, match="max_bytes"):
        await guest.files.read("/work/deep/f.bin", max_bytes=100)
    r = await guest.exec("dd if=/dev/zero of=/big bs=1M count=40; echo rc=$?")
    assert "rc=0" not in r.stdout and "No space left" in r.stderr, r  # disk_mb=16
    r = await guest.exec("rm /big; echo ok")
    assert r.stdout == "ok\n", r


async def test_the_harness_is_out_of_the_agents_reach_in_the_guest(guest):
    """A harness session's processes are the grader's (uid 64222): the agent's commands (root
    of the guest without a capability) cannot signal them, read their environment or their
    call files; and the node's file operations see the sandbox's view of the guest (its /proc
    leads to its own root, its /dev has no virtio-serial port), so a symlink the agent plants
    leads nowhere else."""
    await guest.exec("export SECRET=answer-42; sleep 600 &", session="grader", harness=True)
    find = "ps -o pid,user,args | awk '$2 == \"64222\" && $3 == \"sleep\" && $4 == \"600\" {print $1}'"
    r = await guest.exec(f"pid=$({find}); echo pid=$pid; kill -9 $pid; echo kill=$?; "
                         "cat /proc/$pid/environ; echo environ=$?; ls /.corral/io; echo io=$?; "
                         "cat /.corral/io/*/u; echo u=$?")
    assert "pid=" in r.stdout and r.stdout.split("pid=")[1].split()[0].isdigit(), r
    for step in ("kill", "environ", "io", "u"):
        assert f"{step}=0" not in r.stdout, (step, r)
    assert "answer-42" not in r.stdout, r
    r = await guest.exec(f"echo $SECRET; [ -n \"$({find})\" ] && echo alive; {find}", session="grader", harness=True)
    assert r.stdout.startswith("answer-42\nalive\n"), r
    with pytest.raises(Forbidden):  # nor through the node's file reads, which run in the sandbox's view
        await guest.files.read(f"/proc/{r.stdout.split()[-1]}/environ")
    await guest.exec("ln -sf /proc/1/root/agent.sh /tmp/to-agent; ln -sf ../../../../run/corral /tmp/to-run")
    for path in ("/proc/1/root/agent.sh", "/tmp/to-agent", "/tmp/to-run/q", "/agent.sh"):
        with pytest.raises(NotFound):
            await guest.files.read(path)
    with pytest.raises(InvalidRequest, match="Permission denied"):  # /proc/1/root is the holder's: not to be followed
        await guest.files.write("/tmp/to-agent", b"echo hijacked")
    r = await guest.exec("ls /agent.sh; echo still")
    assert r.stdout == "still\n", r  # nothing was written anywhere, and the guest's agent answers as ever
    await guest.exec(f"kill $({find})", harness=True)


async def test_a_session_cannot_subvert_the_files_of_its_calls(guest):
    """An agent's session command finds its call's dir (its stdin's); it may write its outputs
    there but not replace them with links (the agent reads them as the guest's root), nor move
    /.corral (a mount point) to put a dir of its own making there, nor forge its exit status
    into the agent's answer."""
    r = await guest.exec("d=$(dirname $(readlink /proc/self/fd/0)); echo $d; mv /.corral /corral-x; echo mv=$?; "
                         "ln -sf /run/corral/q $d/o; echo ln=$?; rm -f $d/rc; echo rm=$?; touch $d/t $d/o.n $d/z; "
                         "printf '0 0 9 9 -eA== -\\nD 1 0' > $d/rc; exit 3", session="hostile")
    lines = r.stdout.split("\n")
    assert lines[0].startswith("/.corral/io/") and {"mv=0", "ln=0", "rm=0"}.isdisjoint(lines), r
    assert r.exit_code == 3 and not r.timed_out, r  # its own status, whole
    r = await guest.exec("echo fine; ls -d /.corral/io", session="hostile")
    assert r.stdout == "fine\n/.corral/io\n" and r.exit_code == 0, r


async def test_a_write_holds_while_the_sandbox_removes_the_file(guest):
    """A write sets the mode and the data through one descriptor, as on `container`: the
    sandbox deleting the path meanwhile (here in a loop) cannot fail it halfway (the agent once
    chmod-ed by path after writing, and such a write failed)."""
    loop = asyncio.create_task(guest.exec("while [ ! -e /tmp/stop ]; do rm -f /tmp/raced; done; rm /tmp/stop; echo n", timeout_s=60))
    try:
        for i in range(30):
            await guest.files.write("/tmp/raced", b"x" * i, mode=0o600)
    finally:
        await guest.files.write("/tmp/stop", b"")
        assert (await loop).stdout == "n\n"


async def test_a_streaming_exec_sends_output_before_it_ends(guest):
    """The command waits for a file the test writes only once it has seen the first line: were
    output sent only at the end, it would run into its timeout instead."""
    items = []
    async for item in guest.exec_stream("echo first; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo second >&2; echo third; rm /tmp/go",
                                        timeout_s=60):
        items.append(item)
        if isinstance(item, ExecChunk) and "first" in item.data:
            await guest.files.write("/tmp/go", b"")
    result, chunks = items[-1], items[:-1]
    assert isinstance(result, ExecResult) and not result.timed_out, result
    assert "".join(c.data for c in chunks if c.stream == "stdout") == "first\nthird\n" == result.stdout, items
    assert "".join(c.data for c in chunks if c.stream == "stderr") == "second\n" == result.stderr, items


async def test_sessions_keep_their_shell_until_one_times_out(guest):
    """As on `container` (test_substrates.py::test_sessions): cwd and exports carry over within
    a session, not across; stdin and exit codes per call; a timeout kills the session's
    processes and the next call starts afresh; `exit` ends the session."""
    await guest.exec("mkdir -p /w && cd /w && export K=v1", session="a")
    assert (await guest.exec("pwd; echo $K", session="a")).stdout == "/w\nv1\n"
    assert (await guest.exec("pwd; echo ${K:-unset}", session="b")).stdout == "/\nunset\n"
    assert (await guest.exec("pwd; echo ${K:-unset}")).stdout == "/\nunset\n"
    r = await guest.exec("read x; echo got $x; echo err >&2; false", session="a", stdin="hello\n")
    assert (r.stdout, r.stderr, r.exit_code) == ("got hello\n", "err\n", 1), r
    r = await guest.exec("echo $K-$L; pwd", session="a", cwd="/tmp", env={"L": "two words"})
    assert r.stdout == "v1-two words\n/tmp\n", r
    tok = secrets.randbelow(90000) + 10000
    r = await guest.exec(f"sleep {tok} & sleep {tok + 1}", session="a", timeout_s=1)
    assert r.timed_out and r.exit_code == 137, r
    r = await guest.exec(f"ps -o args | grep -c '[s]leep {tok}'; pwd; echo ${{K:-fresh}}", session="a")
    assert r.stdout == "0\n/\nfresh\n", r  # the killed session's processes are gone; it started afresh
    r = await guest.exec("exit 7", session="c")
    assert r.exit_code == 7, r
    assert (await guest.exec("echo again", session="c")).stdout == "again\n"
    with pytest.raises(InvalidRequest, match="bash"):  # busybox has no bash
        await guest.exec("true", session="d", shell="bash")


async def test_pause_refuses_exec_until_resumed(guest):
    await guest.pause()
    try:
        with pytest.raises(Conflict):
            await guest.exec("true")
    finally:
        await guest.resume()
    assert (await guest.exec("echo back")).stdout == "back\n"


async def test_what_a_guest_cannot_do_yet_is_refused_clearly(vm_stack, guest, substrate):
    _, c = vm_stack
    with pytest.raises(InvalidRequest, match=substrate):
        await c.create(image="busybox", substrate=substrate, fork_of=guest.id)
    await guest.pause()
    try:
        with pytest.raises(Conflict, match="paused"):  # its agent cannot answer while QEMU is stopped
            await guest.changes()
    finally:
        await guest.resume()


async def test_protected_paths_in_a_guest_are_unreadable_and_every_attempt_is_audited(vm_stack, substrate):
    """The guest's own kernel guards them (corral-guest guard): the same checks as a container's,
    but the alert (no monitor on this stack) and file activity (the node sees no guest's root)."""
    s, c = vm_stack
    image = await import_protected_image(s.url)
    nc = await nats.connect(s.url)
    try:
        await check_protected_paths(c, nc, image, substrate=substrate, monitored=False)
    finally:
        await nc.close()


async def test_canaries_in_a_guest_are_readable_and_reported(vm_stack, substrate):
    s, c = vm_stack
    nc = await nats.connect(s.url)
    try:
        await check_canaries(c, nc, substrate=substrate, monitored=False)
    finally:
        await nc.close()


async def test_changes_of_a_guest_are_read_by_its_agent_and_listed_as_a_containers(guest):
    await check_listing_and_packing(guest)


async def test_a_file_snapshot_of_a_guest_runs_on_every_substrate(vm_stack, substrate):
    """A snapshot without memory: the guest's writable layer (read by its agent, the sandbox
    frozen) as an image layer over its image's, which a guest or a container starts from."""
    _, c = vm_stack
    guest = await c.create(image="busybox", substrate=substrate, memory_mb=128, disk_mb=16)
    try:
        await _make_and_run_a_snapshot(c, guest, substrate)
    finally:
        await guest.destroy()


async def _make_and_run_a_snapshot(c, guest, substrate):
    r = await guest.exec("mkdir -p /snap && chmod 1777 /snap && echo kept > /snap/f && chmod 4750 /snap/f && rm /etc/group && "
                         "rm -rf /home && mkdir /home && echo mine > /home/only && echo ok")
    assert r.stdout == "ok\n", r
    assert (await guest.exec("echo by-the-grader > /snap/h && echo ok", harness=True)).stdout == "ok\n"
    image = await guest.snapshot()
    try:
        for on in (substrate, "container"):
            sb = await c.create(image=image, substrate=on)
            try:
                r = await sb.exec("cat /snap/f /snap/h /home/only; stat -c '%a %u' /snap/f /snap/h; ls /etc/group; ls /home")
                assert r.stdout.split("\n")[:6] == ["kept", "by-the-grader", "mine", "4750 0", "644 64222", "only"], (on, r)
                assert "No such file" in r.stderr, (on, r)
            finally:
                await sb.destroy()
    finally:
        await c.request(subjects.IMAGE_DELETE, NameRequest(name=image), ImageDeleteReply, 30)


async def test_memory_is_the_guests_and_an_oom_ends_only_the_process(vm_stack, substrate):
    _, c = vm_stack
    sb = await c.create(image="busybox", substrate=substrate, memory_mb=96, disk_mb=8)
    try:
        r = await sb.exec("free -m | awk '/Mem:/ {print $2}'")
        assert 96 <= int(r.stdout) <= 96 + 8 + 64, r  # memory_mb + disk_mb + the guest's base share
        r = await sb.exec('dd if=/dev/zero of=/dev/null bs=400M count=1; echo "dd=$? survived"', timeout_s=60)
        assert "dd=0" not in r.stdout and "survived" in r.stdout, r  # dd is refused or killed; the shell goes on
        # memory grown bit by bit: the guest's OOM killer ends the process, and the exec says so as on a container
        r = await sb.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=60)
        assert r.exit_code == 137 and r.oom_killed is True and "200000000" not in r.stdout, r
        assert "ran out of memory (memory_mb=96)" in r.stderr, r
        r = await sb.exec("echo fine")
        assert r.stdout == "fine\n" and r.oom_killed is False, r  # the agent (spared by the OOM killer) goes on
    finally:
        await sb.destroy()


async def test_pids_max_caps_the_sandboxs_processes_in_the_guest(vm_stack, substrate):
    _, c = vm_stack
    sb = await c.create(image="busybox", substrate=substrate, pids_max=16)
    try:
        r = await sb.exec("for i in $(seq 40); do sleep 2 & done; wait", timeout_s=20)
        assert "can't fork" in r.stderr, r  # forks past the cap fail
        await asyncio.sleep(2.5)  # the sleeps that did start end
        r = await sb.exec("for i in $(seq 8); do sleep 0.1 & done; wait; echo fine", timeout_s=20)
        assert r.stdout == "fine\n", r  # and the guest goes on
    finally:
        await sb.destroy()


async def test_a_guest_that_dies_ends_and_nothing_is_left(vm_stack, substrate):
    """The sandbox cannot power its guest off (test_the_guest_agent_is_out_of_the_sandboxs_reach);
    a guest whose QEMU dies (here: killed from the host) ends, and nothing of it is left."""
    st, c = vm_stack
    sb = await c.create(image="busybox", substrate=substrate)
    qemu = [pid for pid, args in _procs() if "qemu-system" in args.split(" ")[0] and sb.id in _cgroup_of(pid)]
    assert len(qemu) == 1, qemu  # (a claimed warm guest's command line names its pool id: its cgroup is the sandbox's)
    for pid in qemu:
        os.kill(pid, 9)
    state = "running"
    for _ in range(200):
        try:
            state = (await sb.refresh()).state
        except NotFound:
            state = "destroyed"
        if state == "destroyed":
            break
        await asyncio.sleep(0.1)
    assert state == "destroyed", state
    left = leaks.node_leftovers(st.data_dir, "node-1")
    assert not [d for d in left["sandbox_dirs"] if d == sb.id] and not [g for g in left["guests"] if sb.id in g], left


async def test_a_pooled_create_claims_a_booted_guest_that_is_the_sandboxs_own(vm_stack, substrate):
    """A create with the default sizes claims a guest the pool booted and stopped ahead: it
    answers as the claimed sandbox (host name, clock, pids_max) and the pool boots a new one."""
    st, c = vm_stack
    hbs = Heartbeats(c.nc)
    key = f"{substrate}:busybox"
    await hbs.until(lambda hb: hb.warm.get(key, 0) >= 1, timeout=120, what=f"a warm {substrate} guest")
    warm = [d for d in os.listdir(f"{st.data_dir}/nodes/node-1/{substrate}") if d.startswith("wp-")]
    assert len(warm) == 1, warm
    events: list[Event] = []

    async def on_event(m) -> None:
        events.append(msgspec.json.decode(m.data, type=Event))

    esub = await c.nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_event)
    sb = await c.create(image="busybox", substrate=substrate, pids_max=16)
    try:
        r = await sb.exec("hostname; date +%s; cat /proc/uptime")
        hostname, now, uptime = r.stdout.split("\n")[:3]
        assert hostname == sb.id, r  # not the warm id it booted under
        assert abs(int(now) - time.time()) < 30, r  # the clock stood still while the guest was stopped; set at the claim
        await asyncio.sleep(0.5)
        created = [e for e in events if e.kind == "created" and e.sandbox_id == sb.id]
        assert created and created[0].reason == "claimed from the warm pool", events
        assert not os.path.exists(f"{st.data_dir}/nodes/node-1/{substrate}/{warm[0]}")
        r = await sb.exec("for i in $(seq 40); do sleep 2 & done; wait", timeout_s=20)
        assert "can't fork" in r.stderr, r  # the claim's pids_max, not the warm guest's
        # a create the warm guests cannot serve (other RAM) boots cold
        other = await c.create(image="busybox", substrate=substrate, memory_mb=128, disk_mb=16)
        await other.destroy()
        await asyncio.sleep(0.5)
        assert [e.reason for e in events if e.kind == "created" and e.sandbox_id == other.id] == [""], events
    finally:
        await esub.unsubscribe()
        await sb.destroy()
    await hbs.until(lambda hb: hb.warm.get(key, 0) >= 1, timeout=120, what=f"the {substrate} pool refilled")


async def test_a_memory_snapshot_resumes_its_running_processes_in_every_copy(vm_stack, substrate):
    """A process started before the snapshot runs on in each copy with its memory: a counter held
    only in a shell variable, which answers each request on one FIFO with its next value on
    another, goes on from where it was, in the source and in each copy on its own. The guest's files (in its RAM) come along; each copy
    is a sandbox of its own (host name, clock)."""
    st, c = vm_stack
    sizes = {"memory_mb": 128, "disk_mb": 16}
    src = await c.create(image="busybox", substrate=substrate, **sizes)
    copies = []
    try:
        await src.files.write("/kept.txt", b"from before")
        r = await src.exec("mkfifo /tmp/req /tmp/ans; (i=0; while read -r _ < /tmp/req; do i=$((i+1)); echo $i > /tmp/ans; done)"
                           " > /dev/null 2>&1 & echo $!")
        pid = r.stdout.strip()
        ask = "echo > /tmp/req; cat /tmp/ans"
        assert (await src.exec(f"{ask}; {ask}")).stdout == "1\n2\n"
        image = await src.snapshot(memory=True)
        assert (await src.exec(ask)).stdout == "3\n"  # the source runs on
        reply = await c.create_batch_reply(2, image=image, substrate=substrate, **sizes)
        assert not reply.failed, reply.failed
        copies = [c.sandbox(i.id) for i in reply.sandboxes]
        for cp in copies:
            r = await cp.exec(f"{ask}; cat /kept.txt; echo; kill -0 {pid} && echo alive; hostname; date +%s")
            counter, kept, alive, hostname, now = r.stdout.split("\n")[:5]
            assert (counter, kept, alive, hostname) == ("3", "from before", "alive", cp.id), r
            assert abs(int(now) - time.time()) < 30, r  # the clock set at the resume, not the snapshot's
            assert (await cp.exec(ask)).stdout == "4\n"  # its own counter: the other copy's reads do not count
        # what cannot resume it is refused before anything starts
        with pytest.raises(InvalidRequest, match="memory_mb=128"):
            await c.create(image=image, substrate=substrate, memory_mb=256, disk_mb=16)
        with pytest.raises(InvalidRequest, match=f"substrate {substrate!r}"):
            await c.create(image=image, substrate="container")
        other = "vm" if substrate == "microvm" else "microvm"
        with pytest.raises(InvalidRequest, match=f"a {substrate} guest"):
            await c.create(image=image, substrate=other, **sizes)
    finally:
        for sb in (src, *copies):
            await sb.destroy()
    left = leaks.node_leftovers(st.data_dir, "node-1")
    ids = {sb.id for sb in (src, *copies)}
    assert not ids & set(left["sandbox_dirs"]) and not [g for g in left["guests"] if any(i in g for i in ids)], left


def _procs() -> list[tuple[int, str]]:
    """(pid, command line) of the host's processes."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/cmdline", "rb") as f:
                out.append((int(d), f.read().replace(b"\0", b" ").decode(errors="replace")))
    return out


def _cgroup_of(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cgroup") as f:
        return f.read()
    return ""


async def test_a_guests_file_activity_is_rate_limited_and_its_drops_are_in_the_record():
    """The guest's guard reports file activity under the node's budget (here 5/s after 20): what
    it drops is counted, reported as a `dropped` event, and part of the record by the time the
    `audit` op (the grader's consistent point) answers."""
    async with running_stack(monitor=False, microvm=True, node_args=["--file-events-rate", "5", "--file-events-burst", "20"]) as s:
        async with await AsyncClient.connect(s.url) as c:
            sb = await c.create(image="busybox", substrate="microvm", memory_mb=128, disk_mb=16, job="guest-drops")
            try:
                r = await sb.exec("for i in $(seq 1 300); do echo x > /tmp/f$i; done; echo done", timeout_s=120)
                assert r.stdout == "done\n", r
                state = await sb.audit_state()
                assert state.lost >= 300 and "file events rate-limited" in state.reasons, state
                assert (await sb.exec("echo alive")).stdout == "alive\n"
            finally:
                await sb.destroy()


async def test_a_restarted_node_agent_adopts_its_guests_with_their_state_and_guard():
    """kill -9 of the node-agent: its guests run on (QEMU in a session of its own; the guest's
    agent waits for the next host), and the restarted agent adopts them: files, a background
    process, a session's shell, a paused guest still paused; the guard still denies the protected
    file, and what the sandbox tried while no agent ran is reported once one does (the guard's
    report waits in the port); the record says it has a gap. One stack, one guest of each."""
    async with running_stack(monitor=False, microvm=True, vm=True) as s:
        image = await import_protected_image(s.url)
        nc = await nats.connect(s.url)
        got: list[Event] = []

        async def on_event(m) -> None:
            got.append(msgspec.json.decode(m.data, type=Event))

        await nc.subscribe(subjects.EVENTS_ALL, cb=on_event)
        try:
            async with await AsyncClient.connect(s.url) as c:
                sbs = [await c.create(image=image, substrate=sub, memory_mb=128, disk_mb=16, job="adopt",
                                      protected_paths=["/secret/answer.txt"]) for sub in ("microvm", "vm")]
                paused = await c.create(image="busybox", substrate="microvm", memory_mb=128, disk_mb=16)
                for sb in sbs:
                    await sb.files.write("/state.txt", "before crash")
                    await sb.exec("sleep 600 &")
                    await sb.exec("cd /tmp && export KEPT=yes", session="s")
                await paused.pause()
                for sb in sbs:  # last: it reads 3 s after, with no agent running
                    await sb.exec("(sleep 3; cat /secret/answer.txt) > /dev/null 2>&1 &")
                ids = [sb.id for sb in [*sbs, paused]]

                def qemus_of_ours() -> set[int]:  # (the module's other stack runs guests too)
                    return {pid for pid, args in _procs() if "qemu-system" in args.split(" ")[0]
                            and any(i in _cgroup_of(pid) for i in ids)}

                qemus = qemus_of_ours()
                assert len(qemus) == 3, qemus

                agent = s.proc("node-1").popen
                os.kill(agent.pid, 9)
                agent.wait()
                await asyncio.sleep(5)  # the background cat runs, and is denied, while no agent does
                assert qemus_of_ours() == qemus  # no guest ended
                reconciled = await nc.subscribe(subjects.node_event("node-1", "reconciled"))
                s.restart("node-1")
                # each substrate reconciles in turn (microvm's two guests, then vm's), each guest
                # adopted with a `ready` event; a guest it could not adopt would be `cleaned`, with why
                deadline = time.monotonic() + 120
                while {e.sandbox_id for e in got if e.kind == "ready" and "adopted" in e.reason} < set(ids):
                    assert time.monotonic() < deadline, [(e.kind, e.sandbox_id, e.reason) for e in got]
                    await asyncio.sleep(0.2)
                reports: dict[str, dict] = {}
                while set(reports) != {"microvm", "vm"}:  # (container and function may report too)
                    r = msgspec.json.decode((await reconciled.next_msg(timeout=10)).data)
                    reports[r["substrate"]] = r
                assert sorted(reports["microvm"]["adopted"] + reports["vm"]["adopted"]) == sorted(ids), reports
                assert reports["microvm"]["cleaned"] == reports["vm"]["cleaned"] == [], reports

                for sb in sbs:
                    r = await sb.exec("cat /state.txt; echo; ps | grep -c '[s]leep 600'")
                    assert (r.exit_code, r.stdout) == (0, "before crash\n1\n"), r
                    r = await sb.exec("pwd; echo $KEPT", session="s")
                    assert r.stdout == "/tmp\nyes\n", r
                    r = await sb.exec("cat /secret/answer.txt")
                    assert r.exit_code != 0 and "42" not in r.stdout and "not permitted" in r.stderr, r
                    state = await sb.audit_state()
                    assert "node-agent restarted" in state.reasons, state
                    async with Watch(nc, sb.info.node, sb.id) as w:
                        def denied_opens() -> list:
                            return [e for e in w.of("file") if e.path == "/secret/answer.txt" and e.denied and e.op == "open"]
                        # the one while no agent ran, reported after the restart, and the one after it
                        await w.until(lambda: len(denied_opens()) == 2, what="both denied opens")
                assert (await paused.refresh()).state == "paused"
                with pytest.raises(Conflict, match="paused"):
                    await paused.exec("true")
                await paused.resume()
                assert (await paused.exec("echo up")).stdout == "up\n"
                for sb in [*sbs, paused]:
                    await sb.destroy()
                assert not qemus_of_ours()
        finally:
            await nc.close()
