"""The stack guard: a process that stops an embedded stack whose owner died without stopping it.

A `Stack` runs nats-server, the services and node-agents as their own processes (each in its
own session, so a Ctrl-C of the owner's terminal does not reach them and `Stack.stop` can take
them down in order). When the owner is killed with SIGKILL (pytest killed by a CI timeout,
`kill -9` of `corral up`) nobody runs `Stack.stop`, and the whole stack, sandboxes and mounts
included, would run on forever.

So the stack's first process is this guard. Its stdin is the read end of a pipe whose only write
end the owner holds (non-inheritable, so no other child keeps it open); the owner writes one
line per process it starts (`+ <pid> <name>`). The kernel closes the write end when the owner
dies, however it dies: the guard reads EOF. If the owner said `bye` first (a clean
`Stack.stop`), the guard just exits; otherwise it does what `Stack.stop` would have done, in the
same order: node-agents first (on SIGTERM they destroy their sandboxes, which needs NATS and the
node's loader still up), then loaders, the other services and nats-server last, then the same
cgroup and mount sweeps.

Why not PR_SET_PDEATHSIG on every child: it fires on the exit of the parent *thread* that forked
it (not the process), nats-server is a Go binary that cannot watch a pipe itself, and every child
would be signalled at once, so node-agents would clean up while NATS goes down under them.

Processes are tracked by pidfd (opened when registered, while the owner has not reaped them yet),
so a pid reused after a process exited is never signalled."""
from __future__ import annotations

import argparse
import glob
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Iterable

from . import stackhosts

BYE = b"bye\n"


def stop_order(name: str) -> int:
    """The group a process stops in: the gateway (no new runs), node-agents, loaders, other
    services, nats-server."""
    if name == "gateway":
        return -1
    if name.startswith("node-"):
        return 0
    if name.startswith("loader-"):
        return 1
    if name == "nats-server" or name.startswith("nats-server-"):
        return 3
    return 2


def sweep_cgroups(data_dir: str, nodes: int) -> None:
    """Safety net like sweep_mounts: a node-agent killed with -9 (or a test that failed before
    restarting one) leaves its sandboxes' inits running, reparented to PID 1. Every process in
    this stack's node cgroups is killed and the cgroups removed, the node's parent cgroup
    included, so nothing of the stack outlives it."""
    for i in range(nodes):
        sweep_node_cgroups(data_dir, f"node-{i + 1}")


def sweep_node_cgroups(data_dir: str, node: str) -> None:
    """Kill every process in one node's cgroups and remove them (also: a host of the stack dying)."""
    parents = []
    # "cgroup-parent" (container and function sandboxes), "cgroup-parent-gvisor", ...
    for path in glob.glob(os.path.join(data_dir, "nodes", node, "cgroup-parent*")):
        try:
            with open(path) as f:
                parents.append(f.read().strip().strip("/"))
        except OSError:
            continue
    tops = [d for parent in parents if parent
            for d in (os.path.join("/sys/fs/cgroup", h, parent) for h in os.listdir("/sys/fs/cgroup")) if os.path.isdir(d)]
    if not tops:
        return
    for top in tops:
        for d, _, _ in os.walk(top):
            if os.path.exists(f"{d}/freezer.state"):
                try:
                    with open(f"{d}/freezer.state", "w") as f:
                        f.write("THAWED")
                except OSError:
                    pass  # gone meanwhile; a frozen survivor is killed below anyway (SIGKILL is queued)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids: set[int] = set()
        for top in tops:
            for d, _, _ in os.walk(top):
                try:
                    with open(f"{d}/cgroup.procs") as f:
                        pids.update(int(x) for x in f.read().split())
                except OSError:
                    pass  # removed meanwhile: nothing left in it
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # exited meanwhile
        time.sleep(0.05)
    for top in tops:
        for d, _, _ in sorted(os.walk(top, topdown=False), key=lambda w: -w[0].count("/")):
            try:
                os.rmdir(d)
            except OSError:
                pass  # still populated (a process that would not die): left for the next sweep


def sweep_mounts(data_dir: str) -> None:
    """Safety net for processes that were killed (kill -9 tests, crashes): nothing this stack
    mounted under its data dir may outlive it."""
    from corral_common import linux

    for mp in linux.mounted_under(os.path.abspath(data_dir)):
        try:
            linux.umount(mp, detach=True)
        except OSError:
            pass  # unmounted meanwhile (a parent's detach took it along)


def sweep_uid_ranges(data_dir: str) -> None:
    """Safety net like sweep_mounts: the host uid ranges a node-agent killed for good still
    claimed for its sandboxes (files naming a dir of this stack) are released, and so are claims
    whose owner dir is gone (of a stack whose data dir was removed without this sweep), as a
    node-agent's start-up does."""
    from corral_common import config

    root = os.path.abspath(data_dir) + os.sep
    try:
        names = os.listdir(config.UID_RANGES_DIR)
    except OSError:
        return
    for name in names:
        path = os.path.join(config.UID_RANGES_DIR, name)
        try:
            with open(path) as f:
                owner = f.readline().strip()
            if owner.startswith(root) or (owner and not os.path.isdir(owner)):
                os.unlink(path)
        except OSError:
            continue


class Tracked:
    def __init__(self, pid: int, name: str, fd: int):
        self.pid = pid
        self.name = name
        self.fd = fd  # pidfd: readable once the process has exited

    def alive(self) -> bool:
        return not select.select([self.fd], [], [], 0)[0]

    def signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            pass  # exited meanwhile


def log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} stack-guard: {msg}", file=sys.stderr, flush=True)


def stop_all(procs: list[Tracked], timeout: float) -> None:
    """Stack.stop's order: each group gets SIGTERM and `timeout` seconds, then SIGKILL."""
    for group in sorted({stop_order(p.name) for p in procs}):
        members = [p for p in procs if stop_order(p.name) == group and p.alive()]
        for p in members:
            log(f"SIGTERM {p.name} (pid {p.pid})")
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in members:
            left = max(0.0, deadline - time.monotonic())
            if select.select([p.fd], [], [], left)[0]:
                continue
            log(f"{p.name} (pid {p.pid}) did not stop in {timeout:g}s: SIGKILL")
            p.signal(signal.SIGKILL)
            select.select([p.fd], [], [], 10)


def watch(stream: Iterable[bytes], data_dir: str, nodes: int, timeout: float, remove_data_dir: bool) -> int:
    """Read registrations until EOF; then stop the stack unless the owner said bye."""
    procs: list[Tracked] = []
    clean = False
    for line in stream:
        if line == BYE:
            clean = True
            continue
        parts = line.split(maxsplit=2)
        if len(parts) != 3 or parts[0] != b"+":
            log(f"ignoring malformed line {line!r}")
            continue
        pid, name = int(parts[1]), parts[2].strip().decode()
        try:
            procs.append(Tracked(pid, name, os.pidfd_open(pid)))
        except ProcessLookupError:
            log(f"{name} (pid {pid}) exited before it was registered")
    if clean:
        return 0
    log(f"the stack's owner died without stopping it: stopping {len(procs)} processes")
    stop_all(procs, timeout)
    sweep_cgroups(data_dir, nodes)
    sweep_mounts(data_dir)
    sweep_uid_ranges(data_dir)
    stackhosts.sweep(data_dir)
    if remove_data_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    log("stack stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m corral_sdk.stackguard", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds each group gets after SIGTERM")
    ap.add_argument("--remove-data-dir", action="store_true", help="the data dir is the owner's scratch: remove it too")
    a = ap.parse_args(argv)
    # a Ctrl-C or hang-up meant for the owner must not end the guard before it sees the owner go
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    return watch(sys.stdin.buffer, a.data_dir, a.nodes, a.timeout, a.remove_data_dir)


if __name__ == "__main__":
    sys.exit(main())
