"""Creating a sandbox on this node: `corral.node.<node>.create`, and each item of a node batch
(batch.py), both through `Create.create`."""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics
from corral_common.contract import envelope
from corral_common.contract.errors import Conflict, CorralError, InvalidRequest, NotFound, Unavailable
from corral_common.contract.messages import NodeCreate, SandboxInfo, SandboxSpec
from corral_common.contract.replies import NodeCreateReply, SandboxReply
from corral_common.layers import Catalog

from ..audit.wiring import AuditWiring
from ..events import Events
from ..lifecycle import Lifecycle
from ..placements import Placements
from ..sandbox_labels import sandbox_labels
from ..substrates import Substrate
from ..substrates.base import Sandbox
from ..table import SandboxTable
from ..warm import Warm

log = logging.getLogger("corral.node")

CREATE_SECONDS = metrics.histogram(
    "corral_sandbox_create_seconds", "Time to create a sandbox on the node", ("node", "substrate"),
    buckets=(0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


def fork_spec(source: SandboxSpec, spec: SandboxSpec) -> SandboxSpec:
    """A fork's spec: the source's image; its protections kept (its protected paths and
    canaries, which its copied files may hold, with the request's added; a fork must not be a
    way to read what the source guards unwatched); its environment, labels and workdir under
    the request's, so its commands run as the source's would. Limits and network are the
    request's (the SDK's fork() asks for the source's cpu and memory unless told otherwise)."""
    paths = list(dict.fromkeys([*source.protected_paths, *spec.protected_paths]))
    return msgspec.structs.replace(spec, image=source.image, protected_paths=paths, canaries={**source.canaries, **spec.canaries},
                                   labels={**source.labels, **spec.labels}, env={**source.env, **spec.env},
                                   workdir=spec.workdir if spec.workdir not in ("", "/") else source.workdir)


class Create:
    def __init__(self, nc: NATS, node: str, table: SandboxTable, catalog: Catalog, warm: Warm, audit: AuditWiring,
                 placements: Placements, events: Events, lifecycle: Lifecycle):
        self.nc = nc
        self.node = node
        self.table = table
        self.catalog = catalog
        self.warm = warm
        self.audit = audit
        self.placements = placements
        self.events = events
        self.lifecycle = lifecycle

    async def on_create(self, msg: Msg) -> NodeCreateReply | None:
        """`corral.node.<node>.create`. None when the reply was published already (a direct reply)."""
        c = await self.create(bus.decode(msg.data, NodeCreate), reply=msg.reply or "")
        return None if c.replied else c

    async def create(self, req: NodeCreate, *, claimed: bool = False, reply: str = "") -> NodeCreateReply:
        """Make the sandbox `req` asks for (or find it made already), after the node's admission.
        The reply's `counted_at` is the node time from which every heartbeat counts the sandbox
        (None when it existed already); `replied`: the answers went out already, to `reply` and
        straight to the client.

        `claimed`: its placement key holds a claim already (a batch item: batch.py); otherwise
        the create claims it. `reply`: the scheduler's reply subject, given when the create may
        answer the client directly (req.reply_to) before its bookkeeping."""
        spec = req.spec
        sub = self.table.substrate_for(spec)
        if req.sandbox_id in self.table.sandboxes:
            return NodeCreateReply(sandbox=self.table.sandboxes[req.sandbox_id].info)
        source = None
        if spec.fork_of:
            source = self._fork_source(spec)
            spec = fork_spec(source.spec, spec)
        # the check and the booking happen with no await in between: concurrent creates each see
        # the ones accepted before them
        self.table.admit_create(req.sandbox_id, spec)
        try:
            return await self._create(req, spec, sub, claimed, reply, source)
        finally:
            self.table.done_creating(req.sandbox_id)

    def _fork_source(self, spec: SandboxSpec) -> Sandbox:
        """The running sandbox `spec.fork_of` names, if this request may fork it: another tenant's
        is as unknown as one that does not exist."""
        src = self.table.sandboxes.get(spec.fork_of)
        if src is None or (spec.tenant and src.info.tenant != spec.tenant):
            raise NotFound(f"sandbox {spec.fork_of!r} (to fork) not found on node {self.node}")
        if src.spec.substrate != spec.substrate:
            raise InvalidRequest(f"a fork has its source's substrate: sandbox {src.id} is {src.spec.substrate!r}, "
                                 f"the request asks for {spec.substrate!r}")
        if src.paused or src.info.state != "running":
            raise InvalidRequest(f"sandbox {src.id} is {src.info.state}: only a running sandbox can be forked (resume it first)")
        return src

    async def _create(self, req: NodeCreate, spec: SandboxSpec, sub: Substrate, claimed: bool, reply: str,
                      source: Sandbox | None) -> NodeCreateReply:
        now = time.time()
        info = SandboxInfo(id=req.sandbox_id, node=self.node, state="creating", substrate=spec.substrate, image=spec.image,
                           created_at=now, expires_at=now + spec.ttl_s, job=spec.job, labels=sandbox_labels(spec),
                           cpu=spec.cpu, memory_mb=spec.memory_mb, request_id=spec.request_id, tenant=spec.tenant)
        t0 = time.perf_counter()
        # a warm sandbox's image was in the catalog when it was built (the pool re-checks); a
        # fork is built cold (its upper is filled before its overlay is mounted)
        sb = await self.warm.claim(info, spec) if source is None else None
        if sb is None and sub.uses_catalog:  # docker resolves its own (local Docker) images
            await self.catalog.image(spec.image)  # NotFound with the list of images, before any work
        try:
            if source is not None:
                sb = await sub.fork(source, info, spec)
            elif sb is None:
                sb = await sub.create(info, spec)
        except CorralError:
            await self.events.failed(info.id, "create failed", job=spec.job)
            raise
        sb.info.state = "running"
        if not claimed:
            await self._claim_or_undo(sb, sub)
        if spec.canaries or spec.protected_paths:
            await self._protect(sb, sub, claimed)
        # on the loop when nothing of this sandbox carries a permission mark (opening its root
        # cannot wait on this loop's answer): a thread hop costs more than the marks
        await self.audit.watch_activity(sb, sub, inline=not (spec.canaries or spec.protected_paths))
        # from here on it counts as a sandbox, in every heartbeat taken at or after counted_at (no
        # await in between): the scheduler drops its reservation for it once such a heartbeat is in
        counted_at = time.time()
        self.table.done_creating(sb.id)
        await self.lifecycle.register(sb, sub, record=claimed)  # serves corral.v1.sandbox.<id>.> before anyone hears of it
        CREATE_SECONDS.labels(self.node, spec.substrate).observe(time.perf_counter() - t0)
        direct = bool(req.reply_to and reply)
        if direct:
            # the client's answer goes straight to it; the scheduler hears first (same flush) that
            # it was given, and only records the placement
            try:
                await self.nc.publish(reply, envelope.encode(NodeCreateReply(sandbox=sb.info, replied=True, counted_at=counted_at)))
                await self.nc.publish(req.reply_to, envelope.encode(SandboxReply(sandbox=sb.info)))
            except Exception:
                log.warning("could not publish the create reply", extra={"fields": {"sandbox": sb.id}})
            await asyncio.sleep(0)  # the flusher writes both before the bookkeeping below
        try:
            sub.settle(sb)
        except Exception:
            log.exception("create bookkeeping failed", extra={"fields": {"sandbox": sb.id}})
        self.audit.limits.check(sb, sub)
        reason = f"forked from {source.id}" if source is not None else "claimed from the warm pool" if sb.warm_id else ""
        await self.events.of(sb, "created", reason=reason)
        await self.events.of(sb, "ready")
        return NodeCreateReply(sandbox=sb.info, counted_at=counted_at, replied=direct)

    async def _protect(self, sb: Sandbox, sub: Substrate, claimed: bool) -> None:
        """Plant the canaries and mark the protected paths; on failure undo the whole create."""
        try:
            for cpath, content in sb.spec.canaries.items():
                await sub.write_file(sb, cpath, content.encode(), 0o644, True)
            await self.audit.watch_files(sb, sub)
        except BaseException as e:
            await self.audit.unmark(sb.id)
            await asyncio.shield(sub.destroy(sb))
            if not claimed:  # our claim names a sandbox that is gone (a batch item's is removed by the batch)
                await self.placements.delete(sb.id)
            await self.events.failed(sb.id, "create failed", job=sb.spec.job)
            if isinstance(e, CorralError):
                raise
            raise InvalidRequest(f"could not plant canaries or protect paths: {e}") from None

    async def _claim_or_undo(self, sb: Sandbox, sub: Substrate) -> None:
        """Claim the new sandbox's placement (claim.py). If another node holds the id (the
        scheduler gave up on this node's late answer and placed it there), destroy what was built
        here and refuse with `conflict` naming the owner: one id never names two live sandboxes."""
        try:
            owner = await self.placements.claim(sb.info)
        except BaseException as e:
            await asyncio.shield(sub.destroy(sb))
            if isinstance(e, Exception):
                raise Unavailable(f"placement of {sb.id} not recorded on node {self.node}: {e}", retry_after_s=0.5) from None
            raise
        if not owner:
            return
        await asyncio.shield(sub.destroy(sb))
        logs.kv(log, logging.WARNING, "create undone: the id is placed on another node", sandbox=sb.id, owner=owner)
        await self.events.failed(sb.id, f"create undone: sandbox {sb.id} is placed on node {owner}", job=sb.info.job)
        raise Conflict(f"sandbox {sb.id} is already placed on node {owner}; this node's late create was undone")
