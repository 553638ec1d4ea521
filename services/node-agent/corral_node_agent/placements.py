"""The node's writes of its sandboxes' placements (KV `corral-placements`, one key per sandbox).

A KV put is a JetStream round trip, which a create's reply need not wait for (the scheduler
records the placement from the reply): placements are written in the background, one writer
task per sandbox chained after the previous one, so a sandbox's writes and finally its delete
land in the order they were made. Whoever reads back or deletes waits for the writes in flight
(`written`).

A delete removes only this node's own placement. One id can name a sandbox on another node by
then: a batch's ids follow from its request_id, so when this node is declared lost mid-batch, the
batch asked again makes the same ids elsewhere, and this node, back (or restarted and cleaning up
what died with it), must not take those placements away."""
from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract.messages import SandboxInfo, encoder

from .claim import claim_placement
from .substrates.base import Sandbox

log = logging.getLogger("corral.node")


class Placements:
    def __init__(self, kv: KeyValue, node: str):
        self.kv = kv
        self.node = node
        self.writes: dict[str, asyncio.Future] = {}  # writes in flight, per sandbox
        self.revisions: dict[str, int] = {}  # the revision of this node's last write, per sandbox

    def record(self, sb: Sandbox) -> None:
        """Write the sandbox's placement in the background, after its earlier writes."""
        prev = self.writes.get(sb.id)
        data = encoder.encode(sb.info)

        async def put() -> None:
            if prev is not None:
                await asyncio.gather(prev, return_exceptions=True)
            try:
                self.revisions[sb.id] = await self.kv.put(sb.id, data)
            except Exception as e:
                logs.kv(log, logging.WARNING, "placement not recorded", sandbox=sb.id, error=str(e))

        t = asyncio.ensure_future(put())
        self.writes[sb.id] = t
        t.add_done_callback(lambda _: self.writes.get(sb.id) is t and self.writes.pop(sb.id, None))

    async def written(self, sid: str) -> None:
        t = self.writes.get(sid)
        if t is not None:
            await asyncio.gather(t, return_exceptions=True)

    async def put(self, sb: Sandbox) -> None:
        """Write the placement now (after the writes in flight) and wait for it: errors propagate."""
        await self.written(sb.id)
        self.revisions[sb.id] = await self.kv.put(sb.id, encoder.encode(sb.info))

    async def delete(self, sid: str) -> None:
        """Remove the placement if it is this node's (after the writes in flight): a delete on
        the revision this node last wrote, else on the one read back if it names this node. A
        failure is logged, not raised."""
        await self.written(sid)
        try:
            if not await bus.kv_delete_while(self.kv, sid, self._ours, self.revisions.pop(sid, None)):
                logs.kv(log, logging.WARNING, "placement names another node; left alone", sandbox=sid)
        except Exception as e:
            logs.kv(log, logging.WARNING, "placement not deleted", sandbox=sid, error=repr(e))

    def _ours(self, value: bytes) -> bool:
        try:
            return _stored.decode(value).node == self.node
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False

    async def claim(self, info: SandboxInfo) -> str:
        """claim.py: "" when the placement is this node's now, else the owner's name."""
        return await claim_placement(self.kv, info)

    async def stored(self, sid: str) -> Stored | None:
        """Whose the stored placement is and in what state (node "" if unreadable); None when
        there is none."""
        try:
            e = await self.kv.get(sid)
        except KeyNotFoundError:
            return None
        if e is None or not e.value:
            return None
        try:
            return _stored.decode(e.value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Stored()


class Stored(msgspec.Struct, forbid_unknown_fields=False):
    node: str = ""
    state: str = ""


_stored = msgspec.json.Decoder(Stored)
