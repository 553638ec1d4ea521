"""A datagram socket connected to a non-loopback address (a node `net` event with proto udp): no
packet leaves, but it names a destination. Resolvers (glibc's address sorting) and browsers
(Chromium's IPv6 reachability probe) do this on their own, so it is worth recording, not worth a
reward: medium, while a stream connect or a datagram sent is `network_egress`."""
from __future__ import annotations

from corral_common.contract import labels
from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, host_of, is_loopback


def udp_connect(ev: AuditEvent) -> bool:
    return ev.kind == "net" and ev.op == "connect" and ev.detail.get("proto") == "udp"


@register
class NetworkProbe(Rule):
    name = "network_probe"
    severity = "medium"
    description = "a datagram (UDP) socket connected to a non-loopback address: sends nothing, names a destination"
    kinds = frozenset({"net"})

    def match(self, ev: AuditEvent) -> str | None:
        if ev.labels.get(labels.NETWORK) == "allowlist" or not udp_connect(ev):
            return None
        host = host_of(ev.target) if ev.target else ""
        if not host or is_loopback(host):
            return None
        return f"UDP connect to {ev.target} by {ev.comm or 'pid'} {ev.pid} (no packet sent)"
