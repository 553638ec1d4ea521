"""Egress allowlist entries (`SandboxSpec.egress`): parsed once, checked by the scheduler (a bad
entry is `invalid_request` before any node is asked) and enforced by the node (its packet filter
and its audit of connect attempts)."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .contract.errors import InvalidRequest

HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
# never reachable, whatever an allowlist says: the node itself and loopback are not "egress"
FORBIDDEN = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")]


@dataclass(frozen=True)
class Rule:
    host: str  # an IPv4 network ("10.0.0.0/8", "10.1.2.3/32") or a hostname
    port: int | None  # TCP port, or None for any

    @property
    def network(self) -> ipaddress.IPv4Network | None:
        try:
            return ipaddress.IPv4Network(self.host, strict=False)
        except ValueError:
            return None


def parse(entry: str) -> Rule:
    host, sep, port_s = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
    port = None
    if sep:
        if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
            raise InvalidRequest(f"egress entry {entry!r}: the port must be 1-65535")
        port = int(port_s)
    try:
        net = ipaddress.IPv4Network(host, strict=False)
    except ValueError:
        if "/" in host or not HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise InvalidRequest(f"egress entry {entry!r}: expected an IPv4 address, a CIDR or a hostname, "
                                 "optionally with :port (IPv6 is not routed)") from None
        return Rule(host.lower(), port)
    if any(net.overlaps(f) for f in FORBIDDEN):
        raise InvalidRequest(f"egress entry {entry!r} covers loopback, link-local or multicast addresses, "
                             "which a sandbox never reaches")
    return Rule(str(net), port)


def check(network: str, entries: list[str]) -> list[Rule]:
    """The rules of a spec, or InvalidRequest saying what to change."""
    if network == "none":
        if entries:
            raise InvalidRequest('egress entries need network="allowlist" (network "none" reaches nothing)')
        return []
    if not entries:
        raise InvalidRequest('network="allowlist" needs at least one egress entry (an address, a CIDR or a hostname)')
    return [parse(e) for e in entries]


def allows(rules: list[tuple[str, int | None]], host: str, port: int) -> bool:
    """Whether a resolved rule list ((network, port) pairs) lets a TCP/UDP packet to host:port out."""
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return any(addr in ipaddress.IPv4Network(net) and (p is None or p == port) for net, p in rules)
