"""A function call's seccomp filter, compiled once per node (substrates/function_filter.py): the
program a call runs under answers every syscall as the program runc compiles for the call's
profile does; corral-exec installs exactly one, before the command, leaves the command none of its
own fds (the filter's fd 3 is closed) and fails a command that cannot run the way runc did (127, 126)."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import time

import pytest_asyncio

from corral_common.contract.messages import ExecResult
from corral_node_agent.initbin import ensure_binary
from corral_node_agent.substrates.function_filter import capture, read_filters
from corral_node_agent.substrates.function_run import seccomp_profile
from corral_sdk import AsyncClient

from .. import seccomp_bpf
from ..conftest import running_stack
from .test_monitor import metric


@pytest_asyncio.fixture(scope="module")
async def slots():
    """A stack whose function calls all start runc in a slot (no warm tier), and a client."""
    os.environ["CORRAL_FUNCTION_WARM"] = "0"
    try:
        async with running_stack(monitor=False, env_builder=False) as st:
            os.environ.pop("CORRAL_FUNCTION_WARM")
            client = await AsyncClient.connect(st.url)
            try:
                yield st, client
            finally:
                await client.close()
    finally:
        os.environ.pop("CORRAL_FUNCTION_WARM", None)


async def call(client: AsyncClient, cmd: str, **kw) -> ExecResult:
    return await client.run(cmd, image="busybox", substrate="function", cpu=0.5, memory_mb=128, **kw)


async def compiled_calls(st, client: AsyncClient) -> float:
    """Calls until one has run under the captured program (the first call starts the capture, in
    the background); how many have."""
    url = st.proc("node-1").metrics_url
    deadline = time.monotonic() + 60
    while (n := metric(url, "corral_function_seccomp_total", how="compiled")) == 0:
        assert time.monotonic() < deadline, "no function call got the compiled seccomp filter within 60 s"
        r = await call(client, "true")
        assert r.exit_code == 0, r
        await asyncio.sleep(0.2)
    return n


def pid_of(text: str, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().replace(b"\0", b" ").strip() == text.encode():
                        return int(pid)
            except (OSError, ValueError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process {text!r}")


async def test_a_call_runs_under_exactly_the_program_runc_compiles_for_its_profile(slots):
    st, client = slots
    url = st.proc("node-1").metrics_url
    before = await compiled_calls(st, client)
    tok = secrets.randbelow(900000) + 100000
    running = asyncio.create_task(call(client, f"grep -E '^(NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status; "
                                              f"exec sleep {tok}", timeout_s=5))
    pid = await asyncio.to_thread(pid_of, f"sleep {tok}")
    installed = await asyncio.to_thread(read_filters, pid)
    r = await running
    assert r.timed_out and r.stdout.split() == ["NoNewPrivs:", "1", "Seccomp:", "2", "Seccomp_filters:", "1"], r
    assert metric(url, "corral_function_seccomp_total", how="compiled") > before

    # runc's own compilation of the same profile, in a container of this test's. runc's output is
    # not byte-for-byte stable (two captures of one profile differ in layout), so the programs
    # are compared by what they answer: every syscall number of each architecture, zero and
    # random arguments, and the values the rules compare
    profile = seccomp_profile()
    other = copy.deepcopy(profile)  # a control: the same policy but mount allowed must differ
    other["syscalls"].insert(0, {"names": ["mount"], "action": "SCMP_ACT_ALLOW"})
    for rule in other["syscalls"][1:]:
        rule["names"] = [n for n in rule["names"] if n != "mount"]
    other["syscalls"] = [r for r in other["syscalls"] if r["names"]]
    with tempfile.TemporaryDirectory(prefix="crl-filter-") as tmp:
        exec_path = ensure_binary(f"{tmp}/bin", "corral-exec")
        parent = f"/corral-test-filter-{secrets.token_hex(4)}"
        runc = shutil.which("runc") or "runc"
        try:
            compiled = await capture(runc, f"{tmp}/runc", tmp, parent, exec_path, profile)
            looser = await capture(runc, f"{tmp}/runc", tmp, parent, exec_path, other)
            # the capture's container leaves nothing: no bundle, no runc state, no cgroup
            assert [d for d in os.listdir(tmp) if d.startswith("fn-")] == [] and os.listdir(f"{tmp}/runc") == []
            assert cgroup_children(parent) == []
        finally:
            remove_cgroup(parent)
    assert len(installed) == 1, [len(p) for p in installed]
    assert await asyncio.to_thread(seccomp_bpf.same_answers, installed[0], compiled, profile) == []
    mount = seccomp_bpf.syscall_number("mount", "SCMP_ARCH_X86_64" if platform.machine() == "x86_64" else "SCMP_ARCH_AARCH64")
    differ = await asyncio.to_thread(seccomp_bpf.same_answers, installed[0], looser, profile)
    assert differ and any(f"nr {mount} " in d for d in differ), differ[:5]


async def test_the_compiled_filter_denies_and_allows_what_the_policy_says(slots):
    st, client = slots
    await compiled_calls(st, client)
    r = await call(client, "unshare -n true; echo rc=$?; mount -t tmpfs none /mnt; echo rc=$?; "
                           "echo hi > /tmp/x && cat /tmp/x; ls /proc/self/fd/ | sort -n | tr '\\n' ' '")
    lines = r.stdout.splitlines()
    assert lines[0] != "rc=0" and lines[1] != "rc=0" and lines[2] == "hi", r
    # ls's own directory fd is 3: the filter's memfd was closed before the command started
    assert lines[3].split() == ["0", "1", "2", "3"], r


async def test_a_command_that_cannot_run_fails_as_it_did_under_runc(slots):
    st, client = slots
    await compiled_calls(st, client)
    r = await client.run(["/no/such/tool", "x"], image="busybox", substrate="function")
    assert (r.exit_code, r.stderr) == (127, "corral: cannot run /no/such/tool: No such file or directory\n"), r
    r = await client.run(["nosuchtool"], image="busybox", substrate="function")
    assert (r.exit_code, r.stderr) == (127, "corral: cannot run nosuchtool: No such file or directory\n"), r
    r = await client.run(["/etc/passwd"], image="busybox", substrate="function")
    assert (r.exit_code, r.stderr) == (126, "corral: cannot run /etc/passwd: Permission denied\n"), r
    r = await client.run(["echo", "--", "--hold"], image="busybox", substrate="function")
    assert (r.exit_code, r.stdout) == (0, "-- --hold\n"), r


def test_corral_exec_refuses_a_missing_or_malformed_filter():
    """Without a whole filter on fd 3 the command never runs (125), never runs unfiltered."""
    with tempfile.TemporaryDirectory(prefix="crl-filter-") as tmp:
        exec_path = ensure_binary(f"{tmp}/bin", "corral-exec")
        for content, why in ((b"", "malformed"), (b"1234567", "malformed"), (None, "cannot read")):
            redirect = ""
            if content is not None:
                with open(f"{tmp}/f", "wb") as f:
                    f.write(content)
                redirect = f' 3<"{tmp}/f"'
            p = subprocess.run(["sh", "-c", f'exec 3<&-; exec "$0" -- /bin/echo ran{redirect}', exec_path],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True)
            assert p.returncode == 125 and "ran" not in p.stdout and why in p.stderr, (content, p)
        p = subprocess.run([exec_path, "/bin/echo", "ran"], capture_output=True, text=True)
        assert p.returncode == 125 and "usage" in p.stderr, p


def test_nothing_of_the_nodes_capture_is_left(slots):
    """The stack's own capture (done by the calls above) left no bundle or runc state; its cgroups
    and mounts are what the fixture's leak check (leaks.assert_clean) covers when the stack stops."""
    st, _ = slots
    node = f"{st.data_dir}/nodes/node-1"
    left = [p for d in ("functions", "runc-fn") for p in os.listdir(f"{node}/{d}") if p.startswith("fn-filter")]
    assert left == [], left


def cgroup_roots() -> list[str]:
    """The v2 root and, on a v1 or hybrid host, each controller's hierarchy."""
    return ["/sys/fs/cgroup"] + [f"/sys/fs/cgroup/{c}" for c in os.listdir("/sys/fs/cgroup") if not os.path.isfile(f"/sys/fs/cgroup/{c}")]


def cgroup_children(rel: str) -> list[str]:
    """Sub-cgroups of `rel` in every hierarchy that has it."""
    return [f"{r}{rel}/{d}" for r in cgroup_roots() if os.path.isdir(f"{r}{rel}")
            for d in os.listdir(f"{r}{rel}") if os.path.isdir(f"{r}{rel}/{d}")]


def remove_cgroup(rel: str) -> None:
    for r in cgroup_roots():
        for d in (f"{r}{rel}", os.path.dirname(f"{r}{rel}")):
            if d.rstrip("/") != r and os.path.isdir(d):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
