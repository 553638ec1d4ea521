"""A stack whose owner is killed with SIGKILL goes down with it: the stack guard stops every
process of it in Stack.stop's order (node-agents first, so they destroy their sandboxes while
NATS and the loader still run), and nothing of it is left on the host: no process, no sandbox
init, no runc container, mount or cgroup."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from corral_sdk import stackhosts
from corral_sdk.stack import free_port
from corral_sdk.stackguard import sweep_cgroups, sweep_mounts

from ..conftest import IMAGE_DIR
from ..leaks import assert_clean, inits_of_node, mounts_under, processes_with

# The owner: starts a minimal stack (1 node, no monitor, no env-builder), makes a sandbox with a
# background process in it, prints every pid and waits to be killed.
OWNER = r"""
import asyncio, json, sys
from corral_sdk import AsyncClient
from corral_sdk.stack import Stack

async def main():
    hosts = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    s = Stack(data_dir=sys.argv[1], nodes=1, nats_port=int(sys.argv[2]), image_dir=sys.argv[3], monitor=False, env_builder=False,
              hosts=hosts)
    await s.start()
    c = await AsyncClient.connect(s.url)
    sb = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=600)
    await sb.exec("sleep 600 &")
    print(json.dumps({"procs": {p.name: p.popen.pid for p in s.procs}, "guard": s.guard.pid,
                      "hosts": s.topology.tag if s.topology else ""}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _read_line(p: subprocess.Popen, timeout: float) -> str:
    if select.select([p.stdout], [], [], timeout)[0]:
        return p.stdout.readline()
    return ""


@pytest.mark.parametrize("hosts", [0, 3], ids=["loopback", "hosts"])
def test_a_killed_owner_takes_the_stack_down(hosts: int):
    """With hosts (network namespaces on a bridge, `corral up --hosts 3`), those go as well."""
    data = tempfile.mkdtemp(prefix="crl-orph-", dir="/tmp")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, data, str(free_port()), IMAGE_DIR, str(hosts)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pidfds: dict[str, int] = {}
    try:
        line = _read_line(owner, 180)
        assert line, f"the owner printed no pids (exit {owner.poll()}): {owner.stderr.read() if owner.poll() is not None else ''}"
        started = json.loads(line)
        pids = {**started["procs"], "stack-guard": started["guard"]}
        nats = {"nats-server-1", "nats-server-2", "nats-server-3"} if hosts else {"nats-server"}
        assert nats | {"image-cache", "scheduler", "loader-1", "node-1"} <= set(pids), pids
        tag = started["hosts"]
        assert bool(tag) == bool(hosts) and len(_netns_of(tag)) == hosts
        # opened while the owner, their parent, has not reaped them: these are the processes it started
        pidfds = {name: os.pidfd_open(pid) for name, pid in pids.items()}
        assert len(inits_of_node(data, "node-1")) == 1  # the sandbox runs

        owner.send_signal(signal.SIGKILL)
        owner.wait()

        # every process of the stack exits (the guard last); bounded generously: node-agent
        # shutdown destroys the sandbox, each group gets 60 s before SIGKILL
        deadline = time.monotonic() + 300
        for name, fd in pidfds.items():
            assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], f"{name} still runs after its owner died"
        assert processes_with(data) == []
        assert inits_of_node(data, "node-1") == []
        assert mounts_under(data + "/") == []
        assert_clean(data, "node-1")
        with open(os.path.join(data, "logs", "node-1.log")) as f:
            assert "node-agent stopped" in f.read()  # a clean shutdown (SIGTERM), not the guard's SIGKILL
        if hosts:  # no namespace, bridge or packet filter rule of the hosts is left
            assert _netns_of(tag) == []
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
            assert f"crb{tag}" not in links and f"crh{tag}" not in links
            rules = subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
            assert f"corral-hosts-{tag}" not in rules
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for fd in pidfds.values():  # after a failure: nothing may outlive the test
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([fd], [], [], 10)
            os.close(fd)
        sweep_cgroups(data, 1)
        sweep_mounts(data)
        stackhosts.sweep(data)
        shutil.rmtree(data, ignore_errors=True)


def _netns_of(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if tag and line.startswith(f"corral-{tag}-")]
