"""The node-agent service: owns the sandboxes of one node.

It answers the scheduler's `corral.node.<node>.create`, then subscribes
`corral.v1.sandbox.<id>.>` for each sandbox it created, so every later call reaches it directly.
It publishes lifecycle events, heartbeats with capacity and actual use, expires sandboxes whose
lease ran out, and on start adopts or cleans what a crashed predecessor left behind.

`NodeAgent` is the composition root: it connects, builds the rooms that hold the node's state
and serves their handlers, then stops them in order. The rooms:
- table.py: the live sandboxes and admission (capacity);
- placements.py: the KV placement writes, in order per sandbox;
- heartbeats.py: usage, heartbeats, write-back after the node was declared lost;
- lifecycle.py: register, adopt, expire, destroy;
- audit/: the audit sources and their wiring to sandboxes;
- warm.py, snapshot.py, events.py, tunnels.py (port forwards);
- handlers/: create (single and batch), run, exec, trajectories, sandbox operations."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics
from corral_common.contract import subjects
from corral_common.contract.replies import NodePingReply
from corral_common.layers import Catalog

from . import cgroups, oci
from .audit.wiring import AuditWiring
from .events import Events
from .handlers.batch import BatchCreate, clean_claims
from .handlers.create import Create
from .handlers.exec import Exec
from .handlers.ops import SandboxOps
from .handlers.run import Run
from .handlers.traj import Trajectories
from .heartbeats import Heartbeats
from .layermounts import LayerMounts
from .lifecycle import Lifecycle
from .placements import Placements
from .snapshot import Snapshots
from .substrates import REGISTRY
from .substrates.container import ContainerSubstrate
from .table import SandboxTable, node_capacity
from .trajectory import TrajectoryLog
from .tunnels import Tunnels
from .warm import Warm
from .warmpool import PoolConfig

log = logging.getLogger("corral.node")


class AgentConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    node: str
    state_dir: str
    substrates: list[str] = msgspec.field(default_factory=lambda: ["container"])
    cpu: float = 0.0  # 0: the machine's cores
    cpu_overcommit: float = 8.0  # the most CPU requests may add up to, as a multiple of cpu
    memory_mb: int = 0  # 0: 90% of MemTotal
    max_sandboxes: int = 4096
    heartbeat_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    keep_sandboxes_on_exit: bool = False
    loader_wait_s: float = 60.0
    usage_top: int = 256  # sandboxes listed one by one in a heartbeat (busiest first)
    warm_pool: PoolConfig | None = None  # warm pools (warmpool.py): container's, and microvm:/vm: ones
    #: False (`--no-audit`): no audit events at all (exec log, file activity, denied syscalls are
    #: plain EPERM); protected paths are still enforced. For measuring the cost of auditing.
    audit: bool = True
    file_events_rate: float = 2000.0  # file-activity events per second per sandbox (token bucket rate)
    file_events_burst: float = 10000.0  # and its burst; beyond, events are dropped and the drop is audited


class NodeAgent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.node = cfg.node
        self.state_dir = f"{cfg.state_dir}/nodes/{cfg.node}"
        self.table = SandboxTable(cfg.node, node_capacity(cfg.cpu, cfg.memory_mb, cfg.max_sandboxes, cfg.cpu_overcommit))
        self.audit = AuditWiring(cfg.node, self.state_dir, self.table, enabled=cfg.audit,
                                 file_events_rate=cfg.file_events_rate, file_events_burst=cfg.file_events_burst)

    async def run(self, stop: asyncio.Event) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        oci.raise_own_nofile()
        # teardowns, file ops and audit-mark updates block in threads (syscalls, runc delete):
        # more than the default cpu+4 workers, so a burst of destroys does not stall the rest
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(16, thread_name_prefix="node"))
        metrics_url = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.nc = nc = await bus.connect(self.cfg.nats_url, name=f"corral-node-agent-{self.node}")
        js = nc.jetstream()
        await bus.ensure_streams(js)
        self.placements = Placements(await bus.ensure_kv(js, subjects.KV_PLACEMENTS), self.node)
        catalog = await Catalog(js).open()  # read here; only the image-cache writes it
        self.layers = LayerMounts(nc, catalog, self.node, f"{self.state_dir}/layers")
        await self._wait_loader()
        await self.audit.start(js)  # before any sandbox exists, created or adopted
        for name in self.cfg.substrates:
            cls = REGISTRY.get(name)
            if cls is None:
                raise SystemExit(f"unknown substrate {name!r}; known: {', '.join(REGISTRY)}")
            sub = cls(self.node, self.state_dir, self.layers)  # type: ignore[call-arg]
            self.audit.configure(sub)
            sub.run_watcher = self.audit.watch_run
            if isinstance(sub, ContainerSubstrate) and name == "container":
                self.audit.egress_allows = sub.egress.allows  # allowlists are the container substrate's
            await sub.start()
            self.table.substrates[name] = sub
        self.responder = bus.Responder(nc, "node-agent", package="corral_node_agent", metadata={"node": self.node})
        events = Events(nc, self.node)
        self.warm: Warm | None = None
        self.heartbeats = Heartbeats(nc, self.node, self.table, self.placements, events, self.audit,
                                     lambda: self.warm, self.cfg.heartbeat_s, self.cfg.usage_top, metrics_url)
        self.warm = Warm(self.node, self.cfg.warm_pool, self.table, self.audit, catalog, lambda: self.heartbeats.observed_mem_mb)
        self.tunnels = Tunnels(nc, self.node, self.audit)
        self.lifecycle = Lifecycle(nc, self.node, self.table, self.audit, self.placements, events, self.responder,
                                   self.heartbeats.usage, self.tunnels)
        snapshots = Snapshots(nc, js, self.node, self.state_dir)
        trajectories = Trajectories(nc, self.node, await TrajectoryLog(js).open(), snapshots)
        ops = SandboxOps(self.table, self.lifecycle, self.audit, self.placements, snapshots,
                         trajectories.replay(Exec(nc, self.node, self.audit)), trajectories, self.tunnels)
        self.lifecycle.handler_for = ops.handler
        self.heartbeats.displaced = self.lifecycle.safe_destroy
        create = Create(nc, self.node, self.table, catalog, self.warm, self.audit, self.placements, events, self.lifecycle)
        # the scheduler declared this node lost (it missed our heartbeats: paused, overloaded,
        # restarting) and deleted our placements: write back those of the sandboxes still alive
        await self.heartbeats.listen()
        # before the first sandbox subscription (adopted ones' in reconcile): a ping's serving_s
        # then never claims more than the truth
        self.heartbeats.serving_since = time.monotonic()
        await self.lifecycle.reconcile()
        self.heartbeats.adopted = self.lifecycle.adopted  # their placements are checked after the first heartbeat
        await clean_claims(self.state_dir, self.table, self.placements, events)  # batch claims a killed predecessor never finished
        # one subscription per sandbox (lifecycle.register), listed in discovery as one endpoint
        self.responder.declare("sandbox", subjects.sandbox_all("*"))
        await self.responder.serve(subjects.node_create(self.node), create.on_create, "create")
        batch = BatchCreate(self.node, self.state_dir, create, self.table, self.placements)
        await self.responder.serve(subjects.node_create_batch(self.node), batch.handle, "create_batch")
        await self.responder.serve(subjects.node_ping(self.node), self._on_ping, "ping")
        await self.responder.serve(subjects.node_run(self.node), Run(nc, self.node, self.table, self.audit, events).on_run, "run")
        await trajectories.serve(self.responder)
        self.warm.start()
        metrics.UP.labels("node-agent").set(1)
        self.heartbeats.start()
        self.lifecycle.spawn(self.lifecycle.reap())
        await bus.ready(self.nc, log, "node-agent ready", node=self.node, metrics=metrics_url,
                substrates=list(self.table.substrates), capacity=msgspec.to_builtins(self.table.capacity))
        await stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        table = self.table
        table.accepting = False
        await self.responder.unserve(subjects.node_create(self.node))
        await self.responder.unserve(subjects.node_create_batch(self.node))
        await self.heartbeats.publish(stopping=True)
        if self.warm is not None:
            await self.warm.close()
        # creates already accepted finish first (no new ones start): one registered after the list
        # below was taken would outlive the agent, its placement left for the scheduler to find
        deadline = time.monotonic() + 60
        while table.creating and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.cfg.keep_sandboxes_on_exit:
            await asyncio.gather(*(self.lifecycle.destroy(sid, "node-agent shutdown") for sid in list(table.sandboxes)),
                                 return_exceptions=True)
            # destroys already in flight (requests, TTL) are skipped above: let them finish too
            deadline = time.monotonic() + 120
            while table.destroying and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        await self.tunnels.close()  # those of sandboxes kept for a successor
        await self.responder.drain(timeout=5)
        self.heartbeats.close()
        self.lifecycle.cancel()
        for sub in table.substrates.values():
            await sub.close()
        if not self.cfg.keep_sandboxes_on_exit:
            await self.layers.close()
            parents = {sub.cgroup_parent for sub in table.substrates.values()} - {""}
            if not table.sandboxes:
                # nothing of a node that stopped for good stays on its host: its cgroup parents neither
                for parent in sorted(parents):
                    await asyncio.to_thread(cgroups.remove_parent, parent)
        await self.audit.close()  # kept sandboxes: their last execs' limits are reported first
        try:
            await self.nc.drain()
        except Exception:  # shutting down: a connection already closed has nothing to drain
            pass
        metrics.UP.labels("node-agent").set(0)
        logs.kv(log, logging.INFO, "node-agent stopped", node=self.node, kept=len(table.sandboxes))

    async def _wait_loader(self) -> None:
        """Sandboxes need the node's image loader (image-cache); wait for it, say so if absent."""
        deadline = time.monotonic() + self.cfg.loader_wait_s
        warned = False
        while not await self.layers.ping():
            if time.monotonic() > deadline:
                raise SystemExit(f"no image loader answers on {subjects.node_loader(self.node, '*')}: start "
                                 f"`corral image-loader --node {self.node}` (corral up does)")
            if not warned:
                logs.kv(log, logging.WARNING, "waiting for the node's image loader", node=self.node)
                warned = True
            await asyncio.sleep(0.2)

    async def _on_ping(self, msg: Msg) -> NodePingReply:
        hb = self.heartbeats
        return NodePingReply(node=self.node, sandboxes=len(self.table.sandboxes), incarnation=hb.incarnation, serving_s=hb.serving_s())
