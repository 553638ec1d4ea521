"""Egress allowlists (`network: "allowlist"`): a sandbox reaches exactly what its spec names, on
"the internet" this test builds itself (a network namespace with two addresses and two servers
each, behind a veth on the host), never anything else and never the node; refused attempts are
audited and alerted on, allowed ones are not; nothing is left behind."""
from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time

import pytest

from corral_common import egress
from corral_common.contract import labels
from corral_common.contract.errors import InvalidRequest as ContractInvalid
from corral_node_agent.egress import resolve
from corral_sdk import InvalidRequest

from .test_audit_sources import Watch

SERVER = """
import http.server, socketserver, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(self.server.server_address[1]).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
for port in (8080, 8081):
    s = socketserver.ThreadingTCPServer(("0.0.0.0", port), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def internet():
    """Two addresses in a network namespace of this test's own, each serving 8080 and 8081."""
    tag, k = secrets.token_hex(2), 10 + secrets.randbelow(200)
    ns, host_if, ns_if = f"crl-inet-{tag}", f"cih{tag}", f"cin{tag}"
    a, b = f"10.214.{k}.2", f"10.214.{k}.3"
    _sh("ip", "netns", "add", ns)
    server = None
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "addr", "add", f"10.214.{k}.1/24", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        for addr in (a, b):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ns_if)
        _sh("ip", "-n", ns, "link", "set", ns_if, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield a, b
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _leftovers(sid: str) -> list[str]:
    out = []
    for table, chain in (("filter", "CORRAL-EGRESS"), ("filter", "CORRAL-EGRESS-IN"), ("nat", "POSTROUTING")):
        p = subprocess.run(["iptables", "-w", "-t", table, "-S", chain], capture_output=True, text=True)
        out += [ln for ln in p.stdout.splitlines() if f"corral:{sid}" in ln]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    import hashlib

    tag = hashlib.sha256(sid.encode()).hexdigest()[:10]
    out += [ln for ln in links.splitlines() if tag in ln]
    return out


FETCH = "timeout 10 wget -q -O- http://{}/ 2>/dev/null; echo \" rc=$?\""


async def test_a_sandbox_reaches_exactly_its_allowlist(stack, client, nc, internet):
    a, b = internet
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, network="allowlist", egress=[f"{a}:8080"])
    sid = sb.id
    try:
        async with Watch(nc, sb.info.node, sid) as w:
            r = await sb.exec(FETCH.format(f"{a}:8080"), timeout_s=30)
            assert r.stdout.strip() == "8080 rc=0", r
            for target in (f"{a}:8081", f"{b}:8080", f"{b}:8081"):
                r = await sb.exec(FETCH.format(target), timeout_s=30)
                assert r.stdout.strip().endswith("rc=1") and "808" not in r.stdout.split("rc=")[0], (target, r)  # refused, not timed out
            # the node itself (its end of the link, and the bus on it) is never reachable
            gw = (await sb.exec("ip route | awk '/default/ {print $3}'")).stdout.strip()
            r = await sb.exec(f"nc -w 3 {gw} {stack.nats_port} </dev/null; echo rc=$?", timeout_s=30)
            assert "rc=0" not in r.stdout and "INFO" not in r.stdout, r

            def verdicts() -> dict[str, bool]:
                return {e.target: e.denied for e in w.of("net")}

            await w.until(lambda: {f"{a}:8080", f"{a}:8081", f"{b}:8080"} <= set(verdicts()), what="connect events")
            v = verdicts()
            assert v[f"{a}:8080"] is False and v[f"{a}:8081"] is True and v[f"{b}:8080"] is True, v
            allowed = next(e for e in w.of("net") if e.target == f"{a}:8080")
            assert allowed.detail.get("allowed") == "1" and allowed.labels.get(labels.NETWORK) == "allowlist"
            await w.until(lambda: any(x.rule == "network_egress" for x in w.alerts), what="an alert on the refused ones")
            await asyncio.sleep(1.0)
            flagged = [x.message for x in w.alerts if x.rule == "network_egress"]
            assert flagged and all("refused by the egress allowlist" in m for m in flagged), flagged
            assert not any(f"{a}:8080 " in m for m in flagged), flagged
    finally:
        await sb.destroy()
    for _ in range(50):
        if not _leftovers(sid):
            break
        time.sleep(0.1)
    assert _leftovers(sid) == []


async def test_allowlist_requests_that_cannot_be_kept_are_refused(client, internet):
    a, _ = internet
    bad = [dict(network="allowlist"), dict(egress=[a]), dict(network="allowlist", egress=["127.0.0.1"]),
           dict(network="allowlist", egress=["10.0.0.0/33"]), dict(network="allowlist", egress=[f"{a}:99999"]),
           dict(network="allowlist", egress=["no such host!"]), dict(network="allowlist", egress=[a], substrate="docker")]
    for kw in bad:
        with pytest.raises(InvalidRequest):
            await client.create(image="busybox", cpu=0.2, memory_mb=64, **kw)
    with pytest.raises(InvalidRequest):
        await client.run("true", network="allowlist", egress=[a])
    # the label that tells the monitor an allowlist is in force is the node's alone
    sb = await client.create(image="busybox", cpu=0.2, memory_mb=64, labels={labels.NETWORK: "allowlist", "mine": "1"})
    try:
        assert sb.info.labels == {"mine": "1"}, sb.info.labels
        r = await sb.exec("ip -o link | grep -c eth0; true")
        assert r.stdout.strip() == "0", r  # network "none": no interface but lo
    finally:
        await sb.destroy()
    # a name is resolved by the node at create; one resolving to loopback is refused
    with pytest.raises(ContractInvalid):
        resolve([egress.parse("localhost")])
    assert egress.allows([("10.1.0.0/16", None), ("10.2.0.1/32", 443)], "10.1.2.3", 80)
    assert egress.allows([("10.2.0.1/32", 443)], "10.2.0.1", 443) and not egress.allows([("10.2.0.1/32", 443)], "10.2.0.1", 80)
