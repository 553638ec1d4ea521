"""Hosts as network namespaces: the multi-host topology of `corral up --hosts N` on one machine.

Each host is a network namespace with one veth into a bridge in the root namespace and an
address of its own (10.250.k.2, .3, ... on a /24 not in use here); the bridge carries 10.250.k.1,
so a client on the machine reaches every host as it would reach machines on a LAN. A host's
processes (its nats-server, node-agent, image loader and whatever services it is given) are
started with `nsenter --net` only: they share the machine's filesystem and mount namespace (a
node's mounts and cgroups stay where the stack's sweeps look), but they listen on, and can only
be reached at, their host's address, and a host whose link is cut is cut off from every other.

Bridged traffic crosses the root namespace's FORWARD chain when br_netfilter is loaded (dockerd
loads it and sets the policy to DROP), so the bridge gets one ACCEPT rule of its own, removed
with it.

The topology is recorded in `<data>/run/hosts.json`, so the stack guard removes it too when the
stack's owner dies without stopping it."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import signal
import subprocess
from dataclasses import asdict, dataclass

RECORD = "hosts.json"
SUPERNET = ipaddress.IPv4Network("10.250.0.0/16")  # one /24 per stack with hosts


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def _ipt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)


def _subnets_in_use() -> set[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show").stdout
    nets = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.add(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
    return nets


@dataclass
class Hosts:
    tag: str  # 5 hex digits: names stay within IFNAMSIZ and apart from other stacks'
    subnet: str
    count: int

    @classmethod
    def plan(cls, count: int) -> Hosts:
        used = _subnets_in_use()
        for _ in range(64):
            net = ipaddress.IPv4Network(f"10.250.{secrets.randbelow(250) + 1}.0/24")
            if not any(net.overlaps(u) for u in used):
                return cls(secrets.token_hex(3)[:5], str(net), count)
        raise RuntimeError(f"no free /24 in {SUPERNET} for the hosts' network")

    @property
    def bridge(self) -> str:
        return f"crb{self.tag}"

    @property
    def gateway(self) -> str:
        return str(ipaddress.IPv4Network(self.subnet)[1])

    def netns(self, i: int) -> str:
        return f"corral-{self.tag}-h{i + 1}"

    def address(self, i: int) -> str:
        return str(ipaddress.IPv4Network(self.subnet)[i + 2])

    def veth(self, i: int) -> str:
        """The host's link as the bridge sees it (its other end is `eth0` in the host)."""
        return f"crh{self.tag}{i + 1}"

    def _comment(self) -> list[str]:
        return ["-m", "comment", "--comment", f"corral-hosts-{self.tag}"]

    def create(self, data_dir: str) -> None:
        run = os.path.join(data_dir, "run")
        os.makedirs(run, exist_ok=True)
        with open(os.path.join(run, RECORD), "w") as f:  # first: a failure half-way is still swept
            json.dump(asdict(self), f)
        plen = ipaddress.IPv4Network(self.subnet).prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        _ipt("-I", "FORWARD", "-i", self.bridge, "-o", self.bridge, *self._comment(), "-j", "ACCEPT")
        for i in range(self.count):
            ns = self.netns(i)
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge)
            _ip("link", "set", self.veth(i), "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/{plen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside host `i`'s network (nsenter execs it: the pid is the process's own)."""
        return ["nsenter", f"--net=/run/netns/{self.netns(i)}", "--", *argv]

    def pids(self, i: int) -> list[int]:
        p = _ip("netns", "pids", self.netns(i), check=False)
        return [int(x) for x in p.stdout.split()]

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process in host `i`'s network namespace; returns their pids."""
        pids = self.pids(i)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def destroy(self) -> None:
        """Remove the namespaces (their veths go with them), the bridge and its rule; whatever
        is already gone is skipped."""
        for i in range(self.count):
            self.kill(i)
            _ip("netns", "del", self.netns(i), check=False)
        _ip("link", "del", self.bridge, check=False)
        while _ipt("-D", "FORWARD", "-i", self.bridge, "-o", self.bridge, *self._comment(), "-j", "ACCEPT").returncode == 0:
            pass


def sweep(data_dir: str) -> None:
    """Remove the hosts recorded under `data_dir` (the stack's stop and its guard both call it)."""
    path = os.path.join(data_dir, "run", RECORD)
    try:
        with open(path) as f:
            hosts = Hosts(**json.load(f))
    except (OSError, ValueError, TypeError):
        return
    hosts.destroy()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
