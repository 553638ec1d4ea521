"""Port forwards into this node's sandboxes: `corral.v1.sandbox.<id>.port.open`.

The node connects to 127.0.0.1:<port> from inside the sandbox's network namespace (the
substrate's connect_port) and relays that stream over the bus to the client's inbox
(corral_common/tunnel.py). Nothing inside the sandbox gains a route out, and nothing outside
gains a route in: the only peer is the one socket the node opened. Every forward is audited
(kind `net`, op `port_open` / `port_close`) and ends with its sandbox.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.audit import AuditEvent
from corral_common.contract.errors import Capacity, InvalidRequest
from corral_common.contract.messages import PortOpenRequest
from corral_common.contract.replies import PortOpenReply
from corral_common.tunnel import TunnelEnd

from .audit.wiring import AuditWiring
from .substrates import Substrate
from .substrates.base import Sandbox

log = logging.getLogger("corral.node")

MAX_PER_SANDBOX = 64

OPEN = metrics.gauge("corral_tunnels_open", "Port forwards open into sandboxes", ("node",))
OPENED = metrics.counter("corral_tunnels_opened_total", "Port forwards opened", ("node",))
BYTES = metrics.counter("corral_tunnel_bytes_total", "Bytes relayed by port forwards", ("node", "direction"))


class Tunnels:
    def __init__(self, nc: NATS, node: str, audit: AuditWiring):
        self.nc = nc
        self.node = node
        self.audit = audit
        self.open: dict[str, dict[TunnelEnd, asyncio.Task]] = {}  # sandbox id -> its forwards

    async def on_open(self, msg: Msg, sb: Sandbox, sub: Substrate) -> PortOpenReply:
        req = bus.decode(msg.data, PortOpenRequest)
        send_to = req.reply_to or msg.reply
        if not send_to:
            raise InvalidRequest("port.open needs a reply subject (or reply_to) to send the stream to")
        mine = self.open.setdefault(sb.id, {})
        if len(mine) >= MAX_PER_SANDBOX:
            raise Capacity(f"sandbox {sb.id} has {len(mine)} port forwards open, the most allowed; close one first")
        sock = await sub.connect_port(sb, req.port)
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        token = secrets.token_hex(16)  # unguessable: nobody else can write into the stream
        end = TunnelEnd(self.nc, subjects.tunnel(token), reader, writer)
        try:
            await end.listen()
        except BaseException:
            writer.close()
            raise
        target = f"127.0.0.1:{req.port}"
        self.audit.emit(AuditEvent(**self.audit.base(sb.id), kind="net", op="port_open", target=target,
                                   detail={"tunnel": token}))
        mine[end] = asyncio.create_task(self._relay(sb.id, end, send_to, target, token))
        OPENED.labels(self.node).inc()
        OPEN.labels(self.node).inc()
        return PortOpenReply(tunnel=subjects.tunnel(token), window=end.window, chunk=end.chunk)

    async def _relay(self, sid: str, end: TunnelEnd, reply_to: str, target: str, token: str) -> None:
        try:
            stats = await end.run(reply_to)
        except Exception as e:  # the stream is closed by run; only say why
            stats = end.stats
            stats.reason = stats.reason or f"relay failed: {e}"
            log.exception("port forward failed", extra={"fields": {"sandbox": sid, "target": target}})
        finally:
            self.open.get(sid, {}).pop(end, None)
            OPEN.labels(self.node).dec()
        BYTES.labels(self.node, "from_sandbox").inc(stats.bytes_out)
        BYTES.labels(self.node, "to_sandbox").inc(stats.bytes_in)
        self.audit.emit(AuditEvent(**self.audit.base(sid), kind="net", op="port_close", target=target,
                                   detail={"tunnel": token, "reason": stats.reason[:200],
                                           "bytes_to_sandbox": str(stats.bytes_in),
                                           "bytes_from_sandbox": str(stats.bytes_out)}))
        logs.kv(log, logging.INFO, "port forward closed", sandbox=sid, target=target, reason=stats.reason,
                to_sandbox=stats.bytes_in, from_sandbox=stats.bytes_out)

    async def close_sandbox(self, sid: str, reason: str) -> None:
        """End a sandbox's forwards (it is being destroyed); their close and audit are done on return."""
        mine = self.open.pop(sid, {})
        for end in mine:
            end.close(reason)
        if mine:
            await asyncio.gather(*mine.values(), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(self.close_sandbox(sid, "node-agent stopping") for sid in list(self.open)))
