"""Where every sandbox is, as this replica sees it: fed by the placements KV bucket (each
node-agent writes its own) and by the nodes' answers to this replica's creates, which arrive
before the KV watch echoes them. Kept with the per-job totals and a per-node index so that
admission and a lost node cost the same with 380,000 live sandboxes as with 10."""
from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common import bus
from corral_common.contract.errors import CorralError, NotFound
from corral_common.contract.messages import SandboxInfo, SandboxSpec

from .quotas import JobTotals

_info_decoder = msgspec.json.Decoder(SandboxInfo)
log = logging.getLogger("corral.scheduler")
# the placement of an id the scheduler gave up on: no node may claim it (claim.py in the node-agent
# reads its empty `node` as "another node's"); not a SandboxInfo, so every reader skips it
FENCE = b'{"node":"","fenced":true}'


class Placements:
    def __init__(self, kv: KeyValue):
        self.kv = kv
        self.placed: dict[str, SandboxInfo] = {}
        self.by_node: dict[str, set[str]] = {}  # node -> ids of its placements
        self.totals = JobTotals()
        # sandboxes whose placements this replica deleted when their node was declared lost:
        # id -> (node, when); a call to one waits for the node to show up again before `not_found`
        self.lost_recent: dict[str, tuple[str, float]] = {}
        # creates this replica is placing (set when the node's answer is recorded): the node may
        # have answered the client directly, whose next call must not be answered `not_found`
        self.placing: dict[str, asyncio.Event] = {}
        self.watcher: bus.KVWatch | None = None

    def get(self, sid: str) -> SandboxInfo | None:
        return self.placed.get(sid)

    def on_node(self, node: str) -> list[SandboxInfo]:
        """The node's sandboxes, by the per-node index: scanning every placement per lost node
        stalls the loop."""
        return [self.placed[sid] for sid in list(self.by_node.get(node, ())) if sid in self.placed]

    def set(self, info: SandboxInfo) -> None:
        if self.lost_recent:
            self.lost_recent.pop(info.id, None)
        old = self.placed.get(info.id)
        self.placed[info.id] = info
        if old is not None:
            if old.node != info.node:
                self._by_node_discard(old)
                self.by_node.setdefault(info.node, set()).add(info.id)
            if old.job == info.job and old.cpu == info.cpu and old.memory_mb == info.memory_mb:
                return  # the same sandbox seen again (reply, then the KV watch): totals unchanged
            self.totals.add(old, -1)
        else:
            self.by_node.setdefault(info.node, set()).add(info.id)
        self.totals.add(info)

    def unplace(self, sid: str) -> None:
        old = self.placed.pop(sid, None)
        if old is not None:
            self.totals.add(old, -1)
            self._by_node_discard(old)

    def _by_node_discard(self, info: SandboxInfo) -> None:
        ids = self.by_node.get(info.node)
        if ids is not None:
            ids.discard(info.id)
            if not ids:
                del self.by_node[info.node]

    async def lookup(self, sid: str) -> SandboxInfo | None:
        """The sandbox as this replica knows it, else as the KV bucket holds it: another replica's
        create, or a node's write this replica's watch has not delivered yet."""
        info = self.placed.get(sid)
        if info is not None:
            return info
        e = await bus.kv_get(self.kv, sid, "the placement table")
        if e is None or not e.value:
            return None
        try:
            return _info_decoder.decode(e.value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def fork_source(self, spec: SandboxSpec) -> tuple[SandboxSpec, str]:
        """`spec` as a fork of `spec.fork_of` (its source's substrate and image) and the node it is
        made on: its source's. The node checks the rest (running, not paused, forkable). Another
        tenant's sandbox is as unknown as one that does not exist."""
        src = await self.lookup(spec.fork_of)
        if src is None or src.state not in ("running", "paused") or (spec.tenant and src.tenant != spec.tenant):
            raise NotFound(f"sandbox {spec.fork_of!r} (to fork) not found; it may have been destroyed")
        return msgspec.structs.replace(spec, substrate=src.substrate, image=src.image), src.node

    async def in_kv(self, sid: str) -> bool | None:
        """Whether the bucket holds `sid` (None: the bucket could not be read)."""
        try:
            await self.kv.get(sid)
            return True
        except KeyNotFoundError:
            return False
        except Exception:
            return None

    async def fence(self, sid: str) -> tuple[bool, SandboxInfo | None]:
        """Make sure no node can make `sid` from now on, for a create the scheduler gives up on:
        write a placement that names no node (nodes claim an id by creating its key, so each
        later claim finds it taken, undoes its sandbox and answers `conflict`). Returns
        (True, None) once fenced, (True, the sandbox) if a node had claimed it first (it exists),
        (False, None) if the bucket could not be written (a retry must then wait for `sid`)."""
        try:
            await self.kv.create(sid, FENCE)
            return True, None
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:
            log.warning("placement not fenced", extra={"fields": {"sandbox": sid, "error": repr(e)}})
            return False, None
        try:
            info = await self.lookup(sid)
        except CorralError:
            return False, None
        if info is not None and info.state in ("running", "paused"):
            self.set(info)
            return True, info
        return True, None

    async def delete_lost(self, sid: str, node: str) -> None:
        """Delete the placement of `sid` on `node`, which is lost, if the bucket still holds one
        on that node: a table behind the bucket (its watch failing over) may still show a
        placement that another node made since under the same id (a batch asked again), and
        that one stays. The delete is on the revision read, so nothing written since is lost."""
        def on_node(value: bytes) -> bool:
            try:
                return _info_decoder.decode(value).node == node
            except (msgspec.DecodeError, msgspec.ValidationError):
                return False  # a fence, or not a placement: not the lost node's

        await bus.kv_delete_while(self.kv, sid, on_node)

    async def start(self) -> None:
        self.watcher = bus.KVWatch(self.kv)
        await self.watcher.start()

    async def watch(self) -> None:
        assert self.watcher is not None
        async for e in self.watcher:
            if e.operation in ("DEL", "PURGE") or not e.value:
                self.unplace(e.key)
                continue
            try:
                self.set(_info_decoder.decode(e.value))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue

    async def caught_up(self, timeout: float = 2.0) -> bool:
        """The table holds every placement change the bucket had when called (a destroy's delete,
        acked before the destroy was answered, included): see KVWatch.caught_up."""
        return self.watcher is not None and await self.watcher.caught_up(timeout)

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
