"""Create/destroy churn must leave nothing behind on the node: no sandbox dirs, mounts, cgroups,
runc containers, corral-init (or any other) processes; whatever the sandbox was doing at destroy
time (idle, exec'd, holding a session, running background processes, paused, mid-exec)."""
from __future__ import annotations

import asyncio
import glob
import os
import time

import pytest

from corral_sdk import Conflict, NotFound

from .. import leaks

CG = "/sys/fs/cgroup"
CYCLES = 50


def _cg_pids(node: str, sid: str) -> list[int]:
    found = glob.glob(f"{CG}/pids/corral/{node}-*/{sid}")
    return leaks.cgroup_pids(found[0] if found else f"{CG}/pids/corral/{node}/{sid}")


def _starttime(pid: int) -> str | None:
    """Identity of a process across pid reuse (field 22 of /proc/pid/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _init_cgroup(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def _init_processes() -> set[int]:
    """corral-init processes. leaks.init_processes() looks for an exe ending in /corral-init, but
    seen from the host the exe of a sandbox's PID 1 reads `/.corral/init` (the bind mount's path
    inside the sandbox's mount namespace), so it is matched here too."""
    out = set(leaks.init_processes())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/exe") == "/.corral/init":
                    out.add(int(pid))
            except OSError:
                pass
    return out


def _procs_in_node_cgroups(data_dir: str, node: str) -> dict[int, str]:
    """Every host process whose cgroup (any hierarchy) lies under the node's cgroup parent."""
    parent = leaks.cgroup_parent(data_dir, node)
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for line in _init_cgroup(int(pid)).splitlines():
            path = line.split(":", 2)[-1]
            if path.startswith(f"{parent}/"):
                out[int(pid)] = path
                break
    return out


def _sandbox_leftovers(data_dir: str, node: str, sid: str, procs: dict[int, str]) -> list[str]:
    """Everything of one destroyed sandbox still on the host (empty when clean)."""
    sdir = f"{data_dir}/nodes/{node}/sandboxes/{sid}"
    out = []
    if os.path.exists(sdir):
        out.append(f"dir {sdir}: {sorted(os.listdir(sdir))}")
    out += [f"mount {m}" for m in leaks.mounts_under(sdir)]
    parent = leaks.cgroup_parent(data_dir, node)
    for h in sorted(os.listdir(CG)):
        if os.path.isdir(f"{CG}/{h}{parent}/{sid}"):
            out.append(f"cgroup {h}{parent}/{sid}")
    out += [f"process {p}" for p in leaks.processes_with(sdir)]
    for pid, start in procs.items():
        if _starttime(pid) == start:
            state = _state(pid)
            # a dead sandbox init waiting to be reaped by whoever its parent is: runc detaches it
            # and it is reparented to the host's PID 1, whose reaping is not corral's business.
            # A zombie held by the node-agent (or any live process, or one still running) is.
            if state.startswith("Z") and _ppid(pid) in (0, 1):
                continue
            out.append(f"pid {pid} still exists ({state}, parent {_ppid(pid)}: {_comm(_ppid(pid))})")
    return out


async def _wait_for(cond, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_create_destroy_churn_leaves_nothing(stack, client):
    node = "node-1"
    runc_root = f"{stack.data_dir}/nodes/{node}/runc"
    before = leaks.node_leftovers(stack.data_dir, node)
    inits_before = _init_processes()
    ids: list[str] = []
    problems: list[str] = []
    t_start = time.monotonic()

    for i in range(CYCLES):
        sb = await client.create(image="busybox", cpu=0.25, memory_mb=64, ttl_s=600, labels={"test": "leaks"})
        ids.append(sb.id)
        assert sb.info.node == node
        sdir = f"{stack.data_dir}/nodes/{node}/sandboxes/{sb.id}"
        with open(f"{sdir}/init.pid") as f:
            init_pid = int(f.read().strip())
        assert init_pid in _init_processes(), (
            f"cycle {i}: the init of {sb.id} (pid {init_pid}, {_state(init_pid)}) died right after create; "
            "if another corral stack started on this host meanwhile, its node-agent swept this one's cgroups "
            "(see test_isolation.py::test_another_stack_on_the_same_host_leaves_our_sandboxes_alone)")
        kind = "plain"
        inflight: asyncio.Task | None = None

        if i % 5 == 1:
            kind = "exec"
            r = await sb.exec("echo hi; ls / >/dev/null")
            assert r.exit_code == 0 and r.stdout == "hi\n", r
        elif i % 5 == 2:
            kind = "session"
            await sb.exec("cd /tmp; export A=1", session="s")
            r = await sb.exec("echo $A $(pwd)", session="s")
            assert r.stdout == "1 /tmp\n", r
        elif i % 5 == 3:
            kind = "files"
            await sb.files.write("/tmp/x/y", b"data" * 1000)
            assert await sb.files.read("/tmp/x/y") == b"data" * 1000
        if i == 7:
            kind = "background"
            await sb.exec("sleep 1007 >/dev/null 2>&1 & sleep 1008 & (sleep 1009 &) ; echo started")
            await sb.exec("sleep 1010 >/dev/null 2>&1 &", session="bg")
            assert await _wait_for(lambda: len(_cg_pids(node, sb.id)) >= 6), _cg_pids(node, sb.id)
        elif i == 13:
            kind = "paused"
            await sb.exec("sleep 1013 >/dev/null 2>&1 &")
            await sb.pause()
            info = await sb.refresh()
            assert info.state == "paused", info
            with pytest.raises(Conflict):
                await sb.exec("true")
        elif i == 19:
            kind = "paused-with-session"
            await sb.exec("sleep 1019 >/dev/null 2>&1 &", session="p")
            await sb.pause()
        elif i == 21:
            kind = "mid-exec"
            inflight = asyncio.create_task(sb.exec("sleep 1021; echo never", timeout_s=30))
            await asyncio.sleep(0.3)
        elif i == 23:
            kind = "timed-out"
            r = await sb.exec("sleep 1023 & sleep 1024", timeout_s=0.3)
            assert r.timed_out, r
        elif i == 29:
            kind = "many-processes"
            await sb.exec("for n in $(seq 1 40); do sleep 1029 >/dev/null 2>&1 & done")
            assert await _wait_for(lambda: len(_cg_pids(node, sb.id)) >= 41), len(_cg_pids(node, sb.id))
        elif i == 31:
            kind = "paused-resumed"
            await sb.pause()
            await sb.resume()
            assert (await sb.exec("echo back")).stdout == "back\n"
        elif i == 37:
            kind = "oom"
            r = await sb.exec("x=$(head -c 100000000 /dev/zero | tr '\\0' a)", timeout_s=20)
            assert r.oom_killed, r

        # every process of this sandbox, identified across pid reuse
        procs = {p: s for p in _cg_pids(node, sb.id) if (s := _starttime(p)) is not None}
        procs.setdefault(init_pid, _starttime(init_pid) or "")
        t0 = time.monotonic()
        await sb.destroy()
        took = time.monotonic() - t0
        if inflight is not None:
            try:
                res = await asyncio.wait_for(inflight, 10)
                if "never" in res.stdout:
                    problems.append(f"cycle {i} ({kind}): the in-flight exec completed after destroy: {res}")
            except asyncio.TimeoutError:
                problems.append(f"cycle {i} ({kind}): an exec in flight at destroy never got an answer")
            except Exception:
                pass  # an error reply is the right answer for an exec whose sandbox was destroyed
        if took > 5:
            problems.append(f"cycle {i} ({kind}): destroy took {took:.1f}s")
        left = _sandbox_leftovers(stack.data_dir, node, sb.id, procs)
        if left:
            # give anything asynchronous a moment before calling it a leak
            await asyncio.sleep(1)
            left = _sandbox_leftovers(stack.data_dir, node, sb.id, procs)
        if left:
            problems.append(f"cycle {i} ({kind}) {sb.id}: {left}")
        if sb.id in leaks.runc_containers(runc_root):
            problems.append(f"cycle {i} ({kind}) {sb.id}: runc still lists the container")
        if i % 10 == 0:
            with pytest.raises(NotFound):
                await sb.exec("true")

    elapsed = time.monotonic() - t_start
    assert not problems, "\n".join(problems)

    # node-wide: nothing new compared with before the churn, nothing naming our sandboxes
    after = leaks.node_leftovers(stack.data_dir, node)
    for key in ("sandbox_dirs", "mounts", "cgroups", "runc"):
        new = sorted(set(after[key]) - set(before[key]))
        assert new == [], f"{key} left after {CYCLES} create/destroy cycles: {new}"
        ours = [x for x in after[key] if any(sid in x for sid in ids)]
        assert ours == [], f"{key} of destroyed sandboxes: {ours}"
    inits_after = _init_processes()
    parent = leaks.cgroup_parent(stack.data_dir, node)
    # only this stack's: other stacks on the host (parallel runs) have their own cgroup parents
    new_inits = sorted(p for p in inits_after - inits_before if f"{parent}/" in _init_cgroup(p))
    assert new_inits == [], f"corral-init processes left: {[(p, _init_cgroup(p)) for p in new_inits]}"
    ours = [p for p in inits_after if any(sid in _init_cgroup(p) for sid in ids)]
    assert ours == [], f"corral-init of destroyed sandboxes still running: {ours}"
    stray = {p: f"{cg} [{_state(p)}]" for p, cg in _procs_in_node_cgroups(stack.data_dir, node).items()
             if any(sid in cg for sid in ids) and not (_state(p).startswith("Z") and _ppid(p) in (0, 1))}
    assert stray == {}, f"processes still in destroyed sandboxes' cgroups: {stray}"
    # and the control plane forgot them too
    listed = {s.id for s in await client.list()}
    assert not listed & set(ids), sorted(listed & set(ids))
    assert elapsed < 90, f"{CYCLES} cycles took {elapsed:.0f}s"
