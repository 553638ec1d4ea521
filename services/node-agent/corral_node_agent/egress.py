"""Egress allowlists (`network: "allowlist"`): a route out of a container sandbox to exactly the
destinations its spec names, enforced on the node, outside the sandbox's reach.

A sandbox with an allowlist gets a veth pair: `eth0` inside (10.213.x.y/30, default route via the
host end), the host end `crx<id>`. The node's packet filter (iptables, chains CORRAL-EGRESS on
FORWARD and CORRAL-EGRESS-IN on INPUT, every rule tagged `corral:<sandbox>`) lets through only new
connections from that interface to the allowed networks (and ports), and their replies; nothing
reaches the node itself (so never the bus), nothing unsolicited comes in. Replies find their way
back because the node masquerades the sandbox's address. Hostnames are resolved by the node when
the sandbox is created and written into its /etc/hosts: no DNS server is reachable (unless an
entry allows one), so a name the allowlist does not give resolves nowhere. Refused attempts are
audited by the seccomp watch of connect/sendto (audit/wiring.py asks `allows`).

Teardown deletes the rules by their tag and the veth (the sandbox's end goes with its netns), so a
crash between the two is repaired by the next teardown or by reconciliation.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import shlex
import socket
import subprocess
import threading

from corral_common import egress, logs, metrics
from corral_common.contract.errors import InvalidRequest, Unavailable

log = logging.getLogger("corral.node.egress")

POOL = ipaddress.IPv4Network("10.213.0.0/16")  # one /30 per sandbox with an allowlist, per node
CHAIN_FWD = "CORRAL-EGRESS"
CHAIN_IN = "CORRAL-EGRESS-IN"
RECORD = "egress.json"
HOST_IF_PREFIX = "crx"

ATTACHED = metrics.gauge("corral_egress_sandboxes", "Sandboxes with an egress allowlist attached", ("node",))

Resolved = list[tuple[str, int | None]]  # (IPv4 network, TCP port or None)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def _must(argv: list[str]) -> None:
    p = _run(argv)
    if p.returncode != 0:
        raise Unavailable(f"egress set-up failed: {' '.join(argv)}: {p.stderr.strip()[-300:]}")


def _ipt(*args: str, table: str = "filter") -> list[str]:
    return ["iptables", "-w", "-t", table, *args]


def resolve(rules: list[egress.Rule]) -> tuple[Resolved, list[str]]:
    """The rules as (network, port) pairs, hostnames resolved to their IPv4 addresses now, and the
    /etc/hosts lines that make those names resolve inside."""
    out: Resolved = []
    hosts: list[str] = []
    for r in rules:
        if r.network is not None:
            out.append((str(r.network), r.port))
            continue
        try:
            addrs = sorted({a[4][0] for a in socket.getaddrinfo(r.host, None, socket.AF_INET)})
        except OSError as e:
            raise InvalidRequest(f"egress host {r.host!r} does not resolve on the node: {e}") from None
        for a in addrs:
            if any(ipaddress.IPv4Address(a) in f for f in egress.FORBIDDEN):
                raise InvalidRequest(f"egress host {r.host!r} resolves to {a}, which a sandbox never reaches")
            out.append((f"{a}/32", r.port))
            hosts.append(f"{a} {r.host}")
    return out, hosts


class Egress:
    def __init__(self, node: str):
        self.node = node
        self.lock = threading.Lock()
        self.used: dict[int, str] = {}  # /30 index -> sandbox id
        self.rules: dict[str, Resolved] = {}  # sandbox id -> what it may reach (the audit asks)
        self.ready = False

    def allows(self, sid: str, host: str, port: int) -> bool | None:
        """Whether sandbox `sid` may reach host:port; None if it has no allowlist."""
        rules = self.rules.get(sid)
        return None if rules is None else egress.allows(rules, host, port)

    def _ensure_chains(self) -> None:
        if self.ready:
            return
        if _run(["iptables", "-w", "-L", "-n"]).returncode != 0:
            raise Unavailable("network=\"allowlist\" needs iptables on the node (apt-get install iptables)")
        for chain, parent in ((CHAIN_FWD, "FORWARD"), (CHAIN_IN, "INPUT")):
            _run(_ipt("-N", chain))  # exists already: fine
            if _run(_ipt("-C", parent, "-j", chain)).returncode != 0:
                _must(_ipt("-I", parent, "1", "-j", chain))
        with open("/proc/sys/net/ipv4/ip_forward") as f:
            if f.read().strip() != "1":
                with open("/proc/sys/net/ipv4/ip_forward", "w") as w:
                    w.write("1")
        self.ready = True

    def _allocate(self, sid: str) -> int:
        with self.lock:
            for i in range(1, POOL.num_addresses // 4):
                if i not in self.used:
                    self.used[i] = sid
                    return i
        raise Unavailable("this node has no address left for another sandbox with an egress allowlist")

    def attach(self, sid: str, sdir: str, pid: int, rules: list[egress.Rule]) -> list[str]:
        """Give the sandbox (its init is `pid`) its route and filter; returns the /etc/hosts lines
        to add inside. Blocking (subprocesses): run it in a thread."""
        resolved, hosts = resolve(rules)
        self._ensure_chains()
        index = self._allocate(sid)
        net = list(POOL.subnets(new_prefix=30))[index]
        host_ip, sb_ip = str(net[1]), str(net[2])
        tag = hashlib.sha256(sid.encode()).hexdigest()[:10]
        host_if, peer = f"{HOST_IF_PREFIX}{tag}", f"crp{tag}"
        record = {"index": index, "host_if": host_if, "comment": f"corral:{sid}", "sandbox_ip": sb_ip}
        with open(os.path.join(sdir, RECORD), "w") as f:
            json.dump(record, f)
        try:
            _must(["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer])
            _must(["ip", "link", "set", peer, "netns", str(pid)])
            _must(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if])
            _must(["ip", "link", "set", host_if, "up"])
            inside = ["nsenter", "-t", str(pid), "-n"]
            _must([*inside, "ip", "link", "set", peer, "name", "eth0"])
            _must([*inside, "ip", "addr", "add", f"{sb_ip}/30", "dev", "eth0"])
            _must([*inside, "ip", "link", "set", "eth0", "up"])
            _must([*inside, "ip", "route", "add", "default", "via", host_ip])
            c = ["-m", "comment", "--comment", record["comment"]]
            for dest, port in resolved:
                ports = ["-p", "tcp", "--dport", str(port)] if port is not None else []
                _must(_ipt("-A", CHAIN_FWD, "-i", host_if, "-d", dest, *ports, *c, "-j", "ACCEPT"))
            # refused at once (an agent's tool fails fast instead of hanging in connect)
            reject = ["-j", "REJECT", "--reject-with", "icmp-admin-prohibited"]
            _must(_ipt("-A", CHAIN_FWD, "-i", host_if, *c, *reject))
            _must(_ipt("-A", CHAIN_FWD, "-o", host_if, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", *c, "-j", "ACCEPT"))
            _must(_ipt("-A", CHAIN_FWD, "-o", host_if, *c, "-j", "DROP"))
            _must(_ipt("-A", CHAIN_IN, "-i", host_if, *c, *reject))
            _must(_ipt("-A", "POSTROUTING", "-s", f"{sb_ip}/32", *c, "-j", "MASQUERADE", table="nat"))
        except BaseException:
            self.detach(sid, sdir)
            raise
        self.rules[sid] = resolved
        ATTACHED.labels(self.node).set(len(self.rules))
        logs.kv(log, logging.INFO, "egress attached", sandbox=sid, interface=host_if, address=sb_ip,
                allowed=[f"{d}:{p}" if p else d for d, p in resolved])
        return hosts

    def adopt(self, sid: str, sdir: str, rules: list[egress.Rule]) -> None:
        """After a restart: the sandbox keeps its route and filter; remember its address and rules."""
        try:
            with open(os.path.join(sdir, RECORD)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return
        with self.lock:
            self.used[int(record["index"])] = sid
        try:
            self.rules[sid] = resolve(rules)[0]
        except InvalidRequest:
            self.rules[sid] = []  # its names no longer resolve here: audit every attempt as refused

    def detach(self, sid: str, sdir: str) -> None:
        """Remove the sandbox's rules (by their tag), its veth and its address; idempotent."""
        try:
            with open(os.path.join(sdir, RECORD)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return
        comment = f"corral:{sid}"
        for table, chain in (("filter", CHAIN_FWD), ("filter", CHAIN_IN), ("nat", "POSTROUTING")):
            listing = _run(_ipt("-S", chain, table=table))
            for line in listing.stdout.splitlines():
                args = shlex.split(line)
                if args[:1] == ["-A"] and comment in args:
                    _run(_ipt("-D", *args[1:], table=table))
        _run(["ip", "link", "del", record["host_if"]])
        with self.lock:
            if self.used.get(int(record["index"])) == sid:
                del self.used[int(record["index"])]
        self.rules.pop(sid, None)
        ATTACHED.labels(self.node).set(len(self.rules))
        try:
            os.unlink(os.path.join(sdir, RECORD))
        except FileNotFoundError:
            pass
