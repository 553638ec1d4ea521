"""`corral.node.<node>.create_batch`: the node side of a scheduler batch.

The scheduler sends a node its whole share of a create_batch in one request (a thousand round
trips cost more than the creates of idle sandboxes). Each item goes through the node's ordinary
single-create path (`Create.create`, create.py, so a batch sandbox is made exactly like any other),
a few at a time, and the reply carries one result per item, in order: a failed item does not
fail the others.

Before an item is made it claims its placement key with a KV create (compare-and-set on "no such
key"). Batch items have ids derived from the batch's request_id, so a retried batch (its scheduler
replica died mid-way) may ask another node for an item this node already made or is making: the
claim fails there and the item is answered `conflict` instead of being made twice.

While an item's create runs, its claim is also noted on disk (`<node state>/claims/<id>`, the
claim's bytes): an agent killed mid-batch leaves `creating` claims in KV that nothing would ever
remove; the next agent on the node removes them at start (`clean_claims`), each with a
compare-and-set delete that only succeeds while the key still holds that very claim."""
from __future__ import annotations

import asyncio
import logging
import os
import time

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from corral_common import bus, logs, metrics
from corral_common.contract.envelope import ErrorBody
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import NodeCreate, NodeCreateBatch, NodeItemResult, SandboxInfo, encoder
from corral_common.contract.replies import NodeBatchReply

from ..events import Events
from ..placements import Placements
from ..sandbox_labels import sandbox_labels
from ..table import SandboxTable
from .create import Create

log = logging.getLogger("corral.node-agent")

ITEMS = metrics.counter("corral_node_batch_items_total", "create_batch items by outcome", ("node", "outcome"))


def claims_dir(state_dir: str) -> str:
    return f"{state_dir}/claims"


def _note(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def _unnote(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def clean_claims(state_dir: str, table: SandboxTable, placements: Placements, events: Events) -> list[str]:
    """At agent start, after adoption: the claims a killed predecessor left. A claim whose sandbox
    was adopted is just forgotten (adoption wrote its placement); any other is deleted from KV if
    the key still holds exactly that claim (compare-and-set on its revision: a placement written
    since, by this node or another, stays). Returns the ids whose claims were removed."""
    d = claims_dir(state_dir)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = f"{d}/{name}"
        if name.endswith(".tmp"):
            _unnote(path)
            continue
        try:
            with open(path, "rb") as f:
                claim = f.read()
        except OSError:
            continue
        if name not in table.sandboxes:
            try:
                e = await placements.kv.get(name)
                if e is not None and e.value == claim:
                    await placements.kv.delete(name, last=e.revision)
                    removed.append(name)
            except KeyNotFoundError:
                pass
            except KeyWrongLastSequenceError:
                pass  # written meanwhile: not ours to remove
            except Exception as e:
                logs.kv(log, logging.WARNING, "leftover claim not removed", sandbox=name, error=str(e))
                continue  # keep the note: the next start tries again
        _unnote(path)
    for sid in removed:
        await events.failed(sid, "create interrupted: the node-agent stopped mid-batch; claim removed")
    if removed:
        logs.kv(log, logging.WARNING, "leftover batch claims removed", node=events.node, sandboxes=removed)
    return removed


def _failed(code: str, message: str, retry_after_s: float | None = None) -> NodeItemResult:
    return NodeItemResult(ok=False, error=ErrorBody(code=code, message=message, retry_after_s=retry_after_s))


class BatchCreate:
    def __init__(self, node: str, state_dir: str, creator: Create, table: SandboxTable, placements: Placements, parallel: int = 4):
        self.node = node
        self.creator = creator
        self.table = table
        self.placements = placements
        self.notes = claims_dir(state_dir)
        os.makedirs(self.notes, mode=0o700, exist_ok=True)  # the state dir is searchable by sandbox uids
        self.slots = asyncio.Semaphore(parallel)  # per node, across concurrent batch requests
        self.inflight: dict[str, asyncio.Future] = {}

    async def handle(self, msg: Msg) -> NodeBatchReply:
        req = bus.decode(msg.data, NodeCreateBatch)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._item(it) for it in req.items))
        made = sum(1 for r in results if r.ok)
        logs.kv(log, logging.INFO, "batch created", node=self.node, items=len(results), made=made,
                seconds=round(time.perf_counter() - t0, 3))
        # every item made is in the node's heartbeats taken from now on (node clock, like theirs)
        return NodeBatchReply(counted_at=time.time(), results=results)

    async def _item(self, item: NodeCreate) -> NodeItemResult:
        sid = item.sandbox_id
        if sid in self.table.sandboxes:
            return NodeItemResult(ok=True, sandbox=self.table.sandboxes[sid].info)
        if sid in self.inflight:  # the same item twice at once (a repeated batch): one create
            return await asyncio.shield(self.inflight[sid])
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.inflight[sid] = fut
        try:
            out = await self._create(item)
        except BaseException as e:
            out = _failed("internal", f"create of {sid} on node {self.node} was interrupted ({type(e).__name__})")
            fut.set_result(out)
            raise
        finally:
            self.inflight.pop(sid, None)
        fut.set_result(out)
        return out

    async def _create(self, item: NodeCreate) -> NodeItemResult:
        sid, spec = item.sandbox_id, item.spec
        async with self.slots:
            now = time.time()
            claim = SandboxInfo(id=sid, node=self.node, state="creating", substrate=spec.substrate, image=spec.image,
                                created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=sandbox_labels(spec),
                                cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id, tenant=spec.tenant)
            data = encoder.encode(claim)
            note = f"{self.notes}/{sid}"
            _note(note, data)  # before the claim exists: a kill at any point leaves the note
            try:
                await self.placements.kv.create(sid, data)
            except KeyWrongLastSequenceError:
                _unnote(note)
                if sid in self.table.sandboxes:
                    return NodeItemResult(ok=True, sandbox=self.table.sandboxes[sid].info)
                ITEMS.labels(self.node, "conflict").inc()
                return _failed("conflict", f"sandbox {sid} is already placed on another node (a repeated batch item)")
            # any other error (its ack lost: the claim may exist) or a cancellation (the agent is
            # stopping) leaves the note, and the next start removes the claim if it is still there
            out = await self._make(item)
            _unnote(note)
            return out

    async def _make(self, item: NodeCreate) -> NodeItemResult:
        sid = item.sandbox_id
        try:
            c = await self.creator.create(item, claimed=True)
        except CorralError as e:
            await self._unclaim(sid)
            ITEMS.labels(self.node, e.code.value).inc()
            return _failed(e.code.value, e.message, e.retry_after_s)
        except Exception as e:  # a bug: this item fails, the others go on
            await self._unclaim(sid)
            log.exception("batch item failed", extra={"fields": {"sandbox": sid}})
            ITEMS.labels(self.node, "internal").inc()
            return _failed("internal", f"internal error creating {sid} on node {self.node} ({type(e).__name__}: {e})")
        ITEMS.labels(self.node, "ok").inc()
        return NodeItemResult(ok=True, sandbox=c.sandbox)

    async def _unclaim(self, sid: str) -> None:
        if sid in self.table.sandboxes:
            return
        await self.placements.delete(sid)
