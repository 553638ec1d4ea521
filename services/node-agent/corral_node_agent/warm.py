"""The node's warm pool (warmpool.py), wired to its table, audit and catalog: grown only while
the node has room, claimed by creates whose spec a warm sandbox can serve."""
from __future__ import annotations

import logging
from collections.abc import Callable

from corral_common import logs
from corral_common.contract.errors import NotFound
from corral_common.contract.messages import SandboxInfo, SandboxSpec
from corral_common.layers import Catalog

from .audit.wiring import AuditWiring
from .substrates.base import Sandbox
from .substrates.container import ContainerSubstrate
from .table import SandboxTable
from .warmpool import PoolConfig, WarmPool

log = logging.getLogger("corral.node")


class Warm:
    def __init__(self, node: str, cfg: PoolConfig | None, table: SandboxTable, audit: AuditWiring, catalog: Catalog,
                 observed_mem_mb: Callable[[], int]):
        self.node = node
        self.cfg = cfg
        self.table = table
        self.audit = audit
        self.catalog = catalog
        self.observed_mem_mb = observed_mem_mb
        self.pool: WarmPool | None = None

    def start(self) -> None:
        cfg = self.cfg
        sub = self.table.substrates.get("container")
        if cfg is None or not (cfg.configured or cfg.learn):
            return
        if not isinstance(sub, ContainerSubstrate) or type(sub) is not ContainerSubstrate:
            logs.kv(log, logging.WARNING, "warm pools need the container substrate; not enabled", node=self.node)
            return
        self.pool = WarmPool(sub, self.node, cfg, self.audit.forget_warm, self._may_grow, self._image_exists)
        self.pool.start()
        logs.kv(log, logging.INFO, "warm pool on", configured=cfg.configured, learn=cfg.learn, max_total=cfg.max_total)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def count(self) -> int:
        return self.pool.count() if self.pool is not None else 0

    async def _image_exists(self, image: str) -> bool:
        try:
            await self.catalog.image(image)
            return True
        except NotFound:
            return False

    def _may_grow(self) -> bool:
        """Warm sandboxes only while the node has room: accepting, under its sandbox count, and
        observed memory under 80% of what it offers (their memory is real)."""
        cap = self.table.capacity
        return (self.table.accepting and self.table.held() + self.count() < cap.sandboxes
                and self.observed_mem_mb() < cap.memory_mb * 0.8)

    async def claim(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox | None:
        # protected paths are masked and canaries planted while a sandbox is built: a warm one
        # has neither, so such specs are always built cold
        if (self.pool is None or spec.substrate != "container" or spec.protected_paths or spec.canaries
                or spec.network != "none"):
            return None
        sb = await self.pool.claim(info, spec)
        if sb is not None:
            self.audit.claimed_warm(sb)
        return sb
