"""Reaching a server inside a sandbox: TCP streams to its loopback ports, carried over the bus.

A sandbox has no network route in. `sb.forward(9222)` listens on a local port instead; each
connection to it asks the sandbox's node (`port.open`) to connect to 127.0.0.1:9222 inside the
sandbox and relays the bytes both ways (corral_common/tunnel.py). Anything that speaks TCP works
through it unchanged: Playwright's `connect_over_cdp`, a browser, curl, a database client.
`sb.connect_port(8000)` gives one such stream as an asyncio (reader, writer) pair.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from nats.errors import TimeoutError as NatsTimeout

from corral_common.contract import subjects
from corral_common.contract.envelope import decode_reply
from corral_common.contract.errors import CorralError, NotFound, Timeout
from corral_common.contract.messages import PortOpenRequest, encoder
from corral_common.contract.replies import PortOpenReply
from corral_common.tunnel import KIND as FRAME_KIND
from corral_common.tunnel import TunnelEnd, TunnelStats

if TYPE_CHECKING:
    from .client import AsyncSandbox

log = logging.getLogger("corral.sdk")


async def open_tunnel(sb: AsyncSandbox, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      timeout: float = 30.0) -> tuple[TunnelEnd, asyncio.Task[TunnelStats]]:
    """Relay (reader, writer) to `port` inside the sandbox; the relay runs as the returned task
    (its result: the TunnelStats; `end.close(why)` ends it). Raises the node's error (nothing
    listens, not a container, ...) before anything is relayed, the local stream closed."""
    nc = sb.client.nc
    inbox = nc.new_inbox()
    end = TunnelEnd(nc, inbox, reader, writer)
    await end.listen()
    try:
        # one inbox for the reply and the frames after it: the request's own reply route is the
        # one that also reaches a tenant (frames the node sent before its reply wait here)
        await nc.publish(subjects.sandbox_op(sb.id, "port.open"), encoder.encode(PortOpenRequest(port=port)), reply=inbox)
        early = []
        assert end.sub is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise Timeout(f"port.open on {sb.id} got no reply within {timeout:g}s")
            try:
                msg = await end.sub.next_msg(timeout=left)
            except NatsTimeout:
                continue
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                raise NotFound(f"no node owns sandbox {sb.id!r}: it was destroyed, expired, or never existed")
            if FRAME_KIND not in headers:
                r = decode_reply(msg.data, PortOpenReply)
                break
            early.append(msg)
    except BaseException:
        if end.sub is not None:
            with contextlib.suppress(Exception):
                await end.sub.unsubscribe()
        writer.close()
        raise
    for msg in early:
        end.on_frame(msg)
    end.window, end.chunk = r.window, r.chunk
    task = asyncio.create_task(end.run(r.tunnel))
    _relays.add(task)  # referenced until it ends, whoever holds it
    task.add_done_callback(_relays.discard)
    return end, task


_relays: set[asyncio.Task[TunnelStats]] = set()


class PortForward:
    """A local TCP port (on `host`) whose connections each reach `port` inside the sandbox."""

    def __init__(self, sb: AsyncSandbox, port: int, local_port: int = 0, host: str = "127.0.0.1"):
        self.sb = sb
        self.port = port
        self.host = host
        self.local_port = local_port
        self.server: asyncio.Server | None = None
        self.relays: dict[TunnelEnd, asyncio.Task[TunnelStats]] = {}
        self.errors: list[str] = []  # connections the sandbox side refused, newest last (up to 100)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.local_port}"

    async def start(self) -> PortForward:
        self.server = await asyncio.start_server(self._accept, self.host, self.local_port)
        self.local_port = self.server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            end, relay = await open_tunnel(self.sb, self.port, reader, writer)
        except CorralError as e:
            self.errors = [*self.errors[-99:], str(e)]
            log.warning("port forward to %s:%d refused: %s", self.sb.id, self.port, e)
            return
        self.relays[end] = relay
        relay.add_done_callback(lambda _t: self.relays.pop(end, None))

    async def close(self) -> None:
        """Stop listening and end every relayed connection."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        relays = dict(self.relays)
        for end in relays:
            end.close("port forward closed by the client")
        await asyncio.gather(*relays.values(), return_exceptions=True)

    async def __aenter__(self) -> PortForward:
        return self if self.server is not None else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect_port(sb: AsyncSandbox, port: int, timeout: float = 30.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """One stream to `port` inside the sandbox, as an asyncio (reader, writer) pair."""
    mine, theirs = socket.socketpair()
    try:
        reader, writer = await asyncio.open_connection(sock=mine)
    except BaseException:
        mine.close()
        theirs.close()
        raise
    try:
        await open_tunnel(sb, port, reader, writer, timeout)
    except BaseException:
        theirs.close()
        raise
    return await asyncio.open_connection(sock=theirs)
