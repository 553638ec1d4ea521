"""The node's warm pools (warmpool.py), one per substrate that has them, wired to its table,
audit and catalog: grown only while the node has room, claimed by creates whose spec a warm
sandbox can serve (`Substrate.warm_serves`)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from corral_common import logs
from corral_common.contract.errors import NotFound
from corral_common.contract.messages import SandboxInfo, SandboxSpec
from corral_common.layers import Catalog

from .audit.wiring import AuditWiring
from .cgroups import Cgroups
from .substrates.base import Sandbox
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
        self.pools: dict[str, WarmPool] = {}  # substrate -> its pool

    def start(self) -> None:
        cfg = self.cfg
        if cfg is None or not (cfg.configured or cfg.learn):
            return
        per_substrate: dict[str, dict[str, int]] = {"container": {}} if cfg.learn else {}
        for key, n in cfg.configured.items():
            name, image = split_pool_key(key)
            per_substrate.setdefault(name, {})[image] = n
        for name, configured in per_substrate.items():
            sub = self.table.substrates.get(name)
            if sub is None or not sub.warm_serves(msgspec.structs.replace(WARM_PROBE, substrate=name)):
                logs.kv(log, logging.WARNING, "no warm pool: this node does not run the substrate, or it has none",
                        node=self.node, substrate=name)
                continue
            # learning is the container pool's: a guest's boot costs seconds of CPU, kept for
            # what an operator asked for
            pool_cfg = msgspec.structs.replace(cfg, configured=configured, learn=cfg.learn and name == "container")
            self.pools[name] = pool = WarmPool(sub, self.node, pool_cfg, self.audit.forget_warm, self._may_grow, self._image_exists)
            pool.start()
            logs.kv(log, logging.INFO, "warm pool on", substrate=name, configured=configured, learn=pool_cfg.learn,
                    max_total=cfg.max_total)

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools.values()))

    def count(self) -> int:
        return sum(pool.count() for pool in self.pools.values())

    def by_image(self) -> dict[str, int]:
        return {key: n for pool in self.pools.values() for key, n in pool.by_image().items()}

    def cgroups(self) -> dict[str, Cgroups]:
        return {sid: cg for pool in self.pools.values() for sid, cg in pool.cgroups().items()}

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
        pool = self.pools.get(spec.substrate)
        if pool is None or not pool.sub.warm_serves(spec):
            return None
        sb = await pool.claim(info, spec)
        if sb is not None and pool.sub.supports_seccomp_notify:
            self.audit.claimed_warm(sb)
        return sb


#: a spec any substrate with warm pools serves (start asks whether the substrate has pools at all)
WARM_PROBE = SandboxSpec(image="busybox")


def split_pool_key(key: str) -> tuple[str, str]:
    """`microvm:busybox` -> ("microvm", "busybox"); a bare image is the container substrate's."""
    name, sep, image = key.partition(":")
    return (name, image) if sep else ("container", key)
