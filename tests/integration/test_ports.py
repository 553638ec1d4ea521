"""Port forwards over the bus (`sandbox.<id>.port.open`): a TCP stream to a server on a sandbox's
loopback, with no network route into the sandbox. Bytes arrive whole and in order both ways
(megabytes, past the flow-control window), half-closes carry, errors are clear, the raw contract
refuses inboxes that are not inboxes, hostile servers cannot grow the node, every forward is
audited, and a destroyed sandbox ends its forwards."""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys

import msgspec
import nats
import pytest
import pytest_asyncio

from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent
from corral_common.contract.errors import InvalidRequest, Unavailable
from corral_common.contract.replies import PortOpenReply
from corral_sdk import AsyncClient

from ..conftest import ensure_builtin_images, running_stack

pytestmark = pytest.mark.timeout(300)

# a server for the tests: `echo` sends back what it reads, then the sha256 of it, and closes;
# `flood` writes zeros until the client goes away
SERVER = r"""
import hashlib, socket, sys, threading
def echo(c):
    h = hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b:
            break
        h.update(b)
        c.sendall(b)
    c.sendall(b"SHA " + h.hexdigest().encode())
    c.close()
def flood(c):
    try:
        while True:
            c.sendall(bytes(65536))
    except OSError:
        c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[2])))
s.listen(16)
open("/tmp/ready", "w").close()
while True:
    c, _ = s.accept()
    threading.Thread(target={"echo": echo, "flood": flood}[sys.argv[1]], args=(c,), daemon=True).start()
"""


@pytest_asyncio.fixture(scope="module")
async def stack():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1, monitor=False, env_builder=False) as s:
        yield s


@pytest_asyncio.fixture(scope="module")
async def served(stack):
    """A debian sandbox running the echo server on 7000 and the flood server on 7001."""
    c = await AsyncClient.connect(stack.url)
    sb = await c.create(image="debian", memory_mb=256, ttl_s=1200)
    await sb.files.write("/srv/server.py", SERVER)
    for mode, port in (("echo", 7000), ("flood", 7001)):
        r = await sb.exec(f"rm -f /tmp/ready; python3 /srv/server.py {mode} {port} >/tmp/{mode}.log 2>&1 & "
                          "for i in $(seq 100); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1",
                          session="servers")
        assert r.exit_code == 0, r
    yield c, sb
    await sb.destroy()
    await c.close()


def tcp_round_trip(port: int, data: bytes) -> bytes:
    """What a plain blocking client gets back for `data` on a local port (it half-closes after)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


async def echo_through(reader, writer, payload: bytes) -> tuple[bytes, str]:
    async def send() -> None:
        for i in range(0, len(payload), 1 << 20):
            writer.write(payload[i:i + (1 << 20)])
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    got = await asyncio.wait_for(reader.read(-1), 120)
    await sender
    writer.close()
    body, _, sha = got.rpartition(b"SHA ")
    return body, sha.decode()


async def test_bytes_arrive_whole_and_in_order_both_ways(served):
    c, sb = served
    payload = os.urandom(9 * 1024 * 1024 + 12345)  # several windows' worth, not a chunk multiple
    reader, writer = await sb.connect_port(7000)
    body, sha = await echo_through(reader, writer, payload)
    assert sha == hashlib.sha256(payload).hexdigest()  # the server read exactly what was sent
    assert body == payload  # and every byte came back, in order


async def test_many_streams_at_once_stay_apart(served):
    c, sb = served
    payloads = [os.urandom(200_000 + i) for i in range(12)]

    async def one(p: bytes) -> bytes:
        r, w = await sb.connect_port(7000)
        body, sha = await echo_through(r, w, p)
        assert sha == hashlib.sha256(p).hexdigest()
        return body

    assert await asyncio.gather(*(one(p) for p in payloads)) == payloads


async def test_local_forward_serves_plain_tcp_clients(served):
    """The forward is a real local port: a client that knows nothing of corral uses it."""
    c, sb = served
    async with await sb.forward(7000) as fwd:
        outs = await asyncio.gather(*(asyncio.to_thread(tcp_round_trip, fwd.local_port, b"hello over the bus")
                                      for _ in range(3)))
    want = b"hello over the bus" + b"SHA " + hashlib.sha256(b"hello over the bus").hexdigest().encode()
    assert outs == [want] * 3


async def test_nothing_listening_is_a_clear_error(served):
    c, sb = served
    with pytest.raises(Unavailable, match=r"nothing listens on 127\.0\.0\.1:7999 inside sandbox"):
        await sb.connect_port(7999)
    # through a forward: the local connection is closed and the reason kept
    async with await sb.forward(7999) as fwd:
        r, w = await asyncio.open_connection("127.0.0.1", fwd.local_port)
        assert await asyncio.wait_for(r.read(), 30) == b""
        w.close()
        assert fwd.errors and "nothing listens" in fwd.errors[-1]


async def test_raw_contract_refuses_bad_requests(stack, served):
    """A client that speaks only the JSON contract: bad ports and reply subjects that are not an
    inbox (the node would publish the sandbox's bytes there) get invalid_request; without
    `reply_to`, the frames follow the reply on the request's own reply subject."""
    c, sb = served
    nc = await nats.connect(stack.url)
    try:
        subject = subjects.sandbox_op(sb.id, "port.open")
        for body in ({"port": 0, "reply_to": "_INBOX.abc"}, {"port": 70000, "reply_to": "_INBOX.abc"},
                     {"port": 7000, "reply_to": subjects.audit("node-1", sb.id)},
                     {"port": 7000, "reply_to": "_INBOX.>"}, {"port": 7000, "reply_to": "_INBOX.a b"},
                     {"port": "7000", "reply_to": "_INBOX.abc"}):
            msg = await nc.request(subject, msgspec.json.encode(body), timeout=10)
            reply = msgspec.json.decode(msg.data)
            assert reply["ok"] is False and reply["error"]["code"] == "invalid_request", (body, reply)
        # a raw client opens one by hand: frames with the documented headers
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        msg = await nc.request(subject, msgspec.json.encode({"port": 7000, "reply_to": inbox}), timeout=10)
        opened = msgspec.json.decode(msg.data, type=PortOpenReply)
        await nc.publish(opened.tunnel, b"raw", headers={"Corral-Tunnel": "data", "Corral-Seq": "0"})
        await nc.publish(opened.tunnel, b"", headers={"Corral-Tunnel": "eof", "Corral-Seq": "1"})
        got = b""
        while not got.endswith(hashlib.sha256(b"raw").hexdigest().encode()):
            f = await sub.next_msg(timeout=30)
            kind = f.headers["Corral-Tunnel"]
            if kind == "data":
                got += f.data
                await nc.publish(opened.tunnel, b"", headers={"Corral-Tunnel": "ack", "Corral-Ack": str(len(got))})
            else:
                assert kind in ("ping", "ack"), kind
        assert got == b"raw" + b"SHA " + hashlib.sha256(b"raw").hexdigest().encode()
        await sub.unsubscribe()
        # no reply_to: the reply, then the frames, on the request's reply subject
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subject, msgspec.json.encode({"port": 7000}), reply=inbox)
        first = await sub.next_msg(timeout=10)
        assert not (first.headers or {}).get("Corral-Tunnel"), first.headers
        opened = msgspec.json.decode(first.data, type=PortOpenReply)
        await nc.publish(opened.tunnel, b"", headers={"Corral-Tunnel": "eof", "Corral-Seq": "0"})
        f = await sub.next_msg(timeout=30)
        while f.headers["Corral-Tunnel"] != "data":
            f = await sub.next_msg(timeout=30)
        assert f.data.startswith(b"SHA "), f.data
        await sub.unsubscribe()
    finally:
        await nc.close()


async def test_a_flooding_server_is_held_to_the_window(stack, served):
    """A server that never stops writing, to a client that reads slowly: the node reads no more
    than the window ahead of what the client took (without flow control it would have read
    gigabytes into memory by the time the client gives up), and the node stays well."""
    c, sb = served
    nc = await nats.connect(stack.url)
    closes: list[AuditEvent] = []

    async def on_audit(m) -> None:
        closes.extend(e for e in msgspec.json.decode(m.data, type=AuditBatch).events
                      if e.op == "port_close" and e.target == "127.0.0.1:7001")

    asub = await nc.subscribe(subjects.audit("*", sb.id), cb=on_audit)
    try:
        reader, writer = await sb.connect_port(7001)
        got = 0
        for _ in range(20):
            got += len(await reader.read(65536))
            await asyncio.sleep(0.1)
        writer.close()
        for _ in range(200):
            if closes:
                break
            await asyncio.sleep(0.1)
        assert len(closes) == 1, closes
        from_sandbox = int(closes[0].detail["bytes_from_sandbox"])
        # the window (2 MiB) plus what sits in local socket and stream buffers
        assert got <= from_sandbox < got + 8 * 1024 * 1024, (got, from_sandbox)
        assert (await sb.exec("echo alive")).stdout == "alive\n"
    finally:
        await asub.unsubscribe()
        await nc.close()


async def test_forwards_are_audited_and_end_with_their_sandbox(stack):
    c = await AsyncClient.connect(stack.url)
    nc = await nats.connect(stack.url)
    audit: list[AuditEvent] = []

    async def on_audit(m) -> None:
        audit.extend(msgspec.json.decode(m.data, type=AuditBatch).events)

    asub = await nc.subscribe(subjects.AUDIT_ALL, cb=on_audit)
    try:
        sb = await c.create(image="debian", memory_mb=256, ttl_s=600)
        await sb.files.write("/srv/server.py", SERVER)
        r = await sb.exec("python3 /srv/server.py echo 7000 >/dev/null 2>&1 & "
                          "for i in $(seq 100); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1", session="s")
        assert r.exit_code == 0, r
        reader, writer = await sb.connect_port(7000)
        writer.write(b"x" * 1000)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(1000), 30) == b"x" * 1000
        await sb.destroy()
        # the node ends the stream: the client sees it end, with no data lost before
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
        for _ in range(100):
            if any(e.op == "port_close" and e.sandbox == sb.id for e in audit):
                break
            await asyncio.sleep(0.1)
        mine = [e for e in audit if e.sandbox == sb.id and e.kind == "net"]
        opens = [e for e in mine if e.op == "port_open"]
        closes = [e for e in mine if e.op == "port_close"]
        assert len(opens) == 1 and opens[0].target == "127.0.0.1:7000", mine
        assert len(closes) == 1 and "sandbox destroyed" in closes[0].detail["reason"], mine
        assert closes[0].detail["bytes_to_sandbox"] == "1000" and closes[0].detail["bytes_from_sandbox"] == "1000"
        assert closes[0].detail["tunnel"] == opens[0].detail["tunnel"]
    finally:
        await asub.unsubscribe()
        await nc.close()
        await c.close()


async def test_port_forward_cli(stack, served):
    c, sb = served
    from corral_sdk.stack import free_port

    port = free_port()
    env = {**os.environ, "CORRAL_NATS_URL": stack.url}
    p = subprocess.Popen([sys.executable, "-m", "corral_sdk.cli", "sandbox", "port-forward", sb.id, "7000",
                          "--local-port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = await asyncio.to_thread(p.stdout.readline)
        assert f"forwarding 127.0.0.1:{port} -> {sb.id}" in line, line
        assert (await asyncio.to_thread(tcp_round_trip, port, b"cli")).startswith(b"cliSHA ")
    finally:
        p.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(p.wait, 30) == 0
    # a sandbox that does not exist: a clear error and a non-zero exit
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "corral_sdk.cli", "sandbox", "port-forward",
                                                  "sb-nope", "7000"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "sb-nope" in r.stdout + r.stderr, r


async def test_port_out_of_range_from_the_sdk(served):
    c, sb = served
    with pytest.raises(InvalidRequest, match="port"):
        await sb.connect_port(0)
