"""One TCP stream carried over NATS: the two ends of a port forward into a sandbox.

Sandboxes have no network route in (network "none"); a client reaches a server inside one
(Chromium's DevTools endpoint, a web app under test) only through the bus. The node holding the
sandbox connects to the port from inside the sandbox's network namespace; the client (the SDK's
port forward, or any NATS client) holds the other end. Each end owns a local byte stream and two
subjects: it listens on its own and publishes to its peer's (`sandbox.<id>.port.open` pairs the
client's inbox with the node's `corral.v1.tunnel.<token>`).

A frame is a NATS message whose header `Corral-Tunnel` says what it is:
- `data`: the body is stream bytes (at most `chunk`); `Corral-Seq` counts this direction's data
  and eof frames from 0. A frame out of sequence means the bus dropped one (a slow consumer): the
  tunnel closes rather than hand on a stream with a hole in it.
- `eof`: this direction has ended (sequenced too); the peer shuts down its stream's write side.
- `ack`: `Corral-Ack` is how many bytes the acknowledging end has written to its local stream. A
  sender keeps at most `window` bytes unacknowledged, so a slow reader slows the writer instead of
  filling the bus, the client or the node; a peer that sends past the window is cut off.
- `ping`: sent after `ping_s` of silence; an end that hears nothing for `idle_s` closes.
- `close`: the sender is gone (the body says why); the other end closes its stream too.
The tunnel ends when both directions have ended (each end by itself, no close sent), or at the
first close, error or silence.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

KIND = "Corral-Tunnel"
SEQ = "Corral-Seq"
ACK = "Corral-Ack"

CHUNK = 128 * 1024  # well under the server's 1 MB default max_payload
WINDOW = 2 * 1024 * 1024


class TunnelStats(msgspec.Struct, kw_only=True):
    bytes_out: int = 0  # read from the local stream and sent to the peer
    bytes_in: int = 0  # received from the peer and written to the local stream
    reason: str = ""  # why it ended


class TunnelEnd:
    """One end: pumps its local stream to `send_to` and what arrives on `listen_on` into it."""

    def __init__(self, nc: NATS, listen_on: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 window: int = WINDOW, chunk: int = CHUNK, ping_s: float = 5.0, idle_s: float = 30.0):
        self.nc = nc
        self.listen_on = listen_on
        self.send_to = ""
        self.reader = reader
        self.writer = writer
        self.window = window
        self.chunk = chunk
        self.ping_s = ping_s
        self.idle_s = idle_s
        self.stats = TunnelStats()
        self.sub: Subscription | None = None
        self.done = asyncio.Event()
        self.acked = 0  # of bytes_out, what the peer has written out
        self.acked_changed = asyncio.Event()
        self.expect_seq = 0
        self.inbound: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the peer's eof
        self.queued = 0  # bytes in `inbound`
        self.out_ended = False
        self.in_ended = False
        self.peer_closed = False
        self.last_heard = self.last_sent = time.monotonic()

    async def listen(self) -> None:
        """Subscribe before the peer can send (frames wait in the subscription until run)."""
        self.sub = await self.nc.subscribe(self.listen_on, pending_bytes_limit=4 * self.window + 1024 * 1024)

    async def run(self, send_to: str) -> TunnelStats:
        """Relay until the tunnel ends; the local stream is closed on return."""
        if self.sub is None:
            await self.listen()
        self.send_to = send_to
        tasks = [asyncio.create_task(c) for c in (self._receive(), self._pump_out(), self._pump_in(), self._watch())]
        try:
            await self.done.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # after both eofs the peer ends by itself once it has written our last bytes; a close
            # would cut that short
            if not self.peer_closed and self.stats.reason != "done":
                with contextlib.suppress(Exception):
                    await self._send("close", self.stats.reason.encode())
            if self.sub is not None:
                with contextlib.suppress(Exception):
                    await self.sub.unsubscribe()
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        return self.stats

    def close(self, reason: str) -> None:
        if not self.done.is_set():
            self.stats.reason = reason
            self.done.set()

    async def _send(self, kind: str, body: bytes = b"", extra: dict[str, str] | None = None) -> None:
        await self.nc.publish(self.send_to, body, headers={KIND: kind, **(extra or {})})
        self.last_sent = time.monotonic()

    # ---- the local stream to the peer

    async def _pump_out(self) -> None:
        seq = 0
        try:
            while True:
                while self.stats.bytes_out - self.acked >= self.window:
                    self.acked_changed.clear()
                    await self.acked_changed.wait()
                data = await self.reader.read(self.chunk)
                if not data:
                    await self._send("eof", extra={SEQ: str(seq)})
                    self.out_ended = True
                    self._maybe_done()
                    return
                await self._send("data", data, {SEQ: str(seq)})
                seq += 1
                self.stats.bytes_out += len(data)
        except (ConnectionError, OSError) as e:
            self.close(f"local stream failed: {e}")

    # ---- the peer to the local stream

    async def _receive(self) -> None:
        assert self.sub is not None
        async for msg in self.sub.messages:
            self.last_heard = time.monotonic()
            self.on_frame(msg)
            if self.done.is_set():
                return

    def on_frame(self, msg: Msg) -> None:
        """Take one frame from the peer (also those that arrived before the relay started)."""
        headers = msg.headers or {}
        kind = headers.get(KIND, "")
        if kind in ("data", "eof"):
            seq = headers.get(SEQ, "")
            if seq != str(self.expect_seq):
                self.close(f"frame {seq or '?'} arrived where {self.expect_seq} was due: the bus lost part of the stream")
                return
            self.expect_seq += 1
            if kind == "eof":
                self.inbound.put_nowait(None)
                return
            self.queued += len(msg.data)
            if self.queued > self.window + self.chunk:
                self.close("the peer sent past its window")
                return
            self.inbound.put_nowait(msg.data)
        elif kind == "ack":
            try:
                acked = int(headers.get(ACK, ""))
            except ValueError:
                self.close("malformed ack")
                return
            if acked > self.acked:
                self.acked = min(acked, self.stats.bytes_out)
                self.acked_changed.set()
        elif kind == "close":
            self.peer_closed = True
            self.close(f"peer closed: {msg.data.decode(errors='replace')[:200]}" if msg.data else "peer closed")
        elif kind != "ping":
            self.close(f"unknown frame kind {kind!r}")

    async def _pump_in(self) -> None:
        try:
            while True:
                data = await self.inbound.get()
                if data is None:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    self.in_ended = True
                    self._maybe_done()
                    return
                self.writer.write(data)
                await self.writer.drain()
                self.queued -= len(data)
                self.stats.bytes_in += len(data)
                await self._send("ack", extra={ACK: str(self.stats.bytes_in)})
        except (ConnectionError, OSError) as e:
            self.close(f"local stream failed: {e}")

    def _maybe_done(self) -> None:
        if self.out_ended and self.in_ended:
            self.close("done")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(self.ping_s, self.idle_s) / 2)
            now = time.monotonic()
            if now - self.last_heard > self.idle_s:
                self.close(f"peer silent for {self.idle_s:g}s")
                return
            if now - self.last_sent >= self.ping_s:
                await self._send("ping")
