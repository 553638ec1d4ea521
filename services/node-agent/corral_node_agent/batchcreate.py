"""`corral.node.<node>.create_batch`: the node side of a scheduler batch.

The scheduler sends a node its whole share of a create_batch in one request (a thousand round
trips cost more than the creates of idle sandboxes). Each item goes through the node's ordinary
single-create path (`NodeAgent._on_create`, so a batch sandbox is made exactly like any other),
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

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from corral_common import bus, logs, metrics
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import Event, NodeCreate, NodeCreateBatch, SandboxInfo, encoder, error, ok

log = logging.getLogger("corral.node-agent")

ITEMS = metrics.counter("corral_node_batch_items_total", "create_batch items by outcome", ("node", "outcome"))


class _ItemMsg:
    """What `_on_create` reads of a request (its data), for an item of a batch, whose placement
    key is claimed already (`claimed`: the create does not claim it again)."""

    __slots__ = ("data", "claimed")

    def __init__(self, data: bytes):
        self.data = data
        self.claimed = True


def claims_dir(agent) -> str:
    return f"{agent.state_dir}/claims"


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


async def clean_claims(agent) -> list[str]:
    """At agent start, after adoption: the claims a killed predecessor left. A claim whose sandbox
    was adopted is just forgotten (adoption wrote its placement); any other is deleted from KV if
    the key still holds exactly that claim (compare-and-set on its revision: a placement written
    since, by this node or another, stays). Returns the ids whose claims were removed."""
    d = claims_dir(agent)
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
        if name not in agent.sandboxes:
            try:
                e = await agent.placements.get(name)
                if e is not None and e.value == claim:
                    await agent.placements.delete(name, last=e.revision)
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
        await agent._publish_event(Event(kind="failed", ts=time.time(), sandbox_id=sid, node=agent.node,
                                         reason="create interrupted: the node-agent stopped mid-batch; claim removed"))
    if removed:
        logs.kv(log, logging.WARNING, "leftover batch claims removed", node=agent.node, sandboxes=removed)
    return removed


class BatchCreate:
    def __init__(self, agent, parallel: int = 4):
        self.agent = agent
        self.notes = claims_dir(agent)
        os.makedirs(self.notes, exist_ok=True)
        self.slots = asyncio.Semaphore(parallel)  # per node, across concurrent batch requests
        self.inflight: dict[str, asyncio.Future] = {}

    async def handle(self, msg) -> bytes:
        req = bus.decode(msg.data, NodeCreateBatch)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._item(it) for it in req.items))
        made = sum(1 for r in results if r.startswith(b'{"ok":true'))
        logs.kv(log, logging.INFO, "batch created", node=self.agent.node, items=len(results), made=made,
                seconds=round(time.perf_counter() - t0, 3))
        # every item made is in the node's heartbeats taken from now on (node clock, like theirs)
        return b'{"ok":true,"counted_at":' + repr(time.time()).encode() + b',"results":[' + b",".join(results) + b"]}"

    async def _item(self, item: NodeCreate) -> bytes:
        sid = item.sandbox_id
        agent = self.agent
        if sid in agent.sandboxes:
            return ok(sandbox=agent.sandboxes[sid].info)
        if sid in self.inflight:  # the same item twice at once (a repeated batch): one create
            return await asyncio.shield(self.inflight[sid])
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.inflight[sid] = fut
        try:
            out = await self._create(item)
        except BaseException as e:
            out = error("internal", f"create of {sid} on node {agent.node} was interrupted ({type(e).__name__})")
            fut.set_result(out)
            raise
        finally:
            self.inflight.pop(sid, None)
        fut.set_result(out)
        return out

    async def _create(self, item: NodeCreate) -> bytes:
        agent, sid, spec = self.agent, item.sandbox_id, item.spec
        async with self.slots:
            now = time.time()
            claim = SandboxInfo(id=sid, node=agent.node, state="creating", substrate=spec.substrate, image=spec.image,
                                created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=spec.labels,
                                cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id)
            data = encoder.encode(claim)
            note = f"{self.notes}/{sid}"
            _note(note, data)  # before the claim exists: a kill at any point leaves the note
            try:
                await agent.placements.create(sid, data)
            except KeyWrongLastSequenceError:
                _unnote(note)
                if sid in agent.sandboxes:
                    return ok(sandbox=agent.sandboxes[sid].info)
                ITEMS.labels(agent.node, "conflict").inc()
                return error("conflict", f"sandbox {sid} is already placed on another node (a repeated batch item)")
            # any other error (its ack lost: the claim may exist) or a cancellation (the agent is
            # stopping) leaves the note, and the next start removes the claim if it is still there
            out = await self._make(item)
            _unnote(note)
            return out

    async def _make(self, item: NodeCreate) -> bytes:
        agent, sid = self.agent, item.sandbox_id
        try:
            out = await agent._on_create(_ItemMsg(encoder.encode(item)))
        except CorralError as e:
            await self._unclaim(sid)
            ITEMS.labels(agent.node, e.code.value).inc()
            return error(e.code.value, e.message, e.retry_after_s)
        except Exception as e:  # a bug: this item fails, the others go on
            await self._unclaim(sid)
            log.exception("batch item failed", extra={"fields": {"sandbox": sid}})
            ITEMS.labels(agent.node, "internal").inc()
            return error("internal", f"internal error creating {sid} on node {agent.node} ({type(e).__name__}: {e})")
        ITEMS.labels(agent.node, "ok").inc()
        return out

    async def _unclaim(self, sid: str) -> None:
        if sid in self.agent.sandboxes:
            return
        try:
            await self.agent.placements.delete(sid)
        except Exception as e:
            logs.kv(log, logging.WARNING, "placement not deleted", sandbox=sid, error=repr(e))
