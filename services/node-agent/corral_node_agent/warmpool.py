"""Warm pools: pre-created, paused sandboxes for hot images, claimed by creates.

A create for an image with a warm sandbox ready skips the build (for a container: layers, mounts,
`runc run`, init start, ~100 ms on this machine; for a microvm or vm guest: the boot, seconds) and
claims one instead: the substrate renames it to the claimed id everywhere and applies the
request's limits (`Substrate.claim_warm`). One pool per substrate that has one (warm.py). A warm sandbox
never ran anything but its init, and is never given to a second user (destroyed sandboxes are
never returned to the pool), so a claim is as fresh as a cold create.

Which images get a pool, and how big:
- configured (`--warm-pool busybox=4`): that many are kept ready at all times (the floor);
- learned (`--warm-pool-learn`): an image created at least `learn_min` times in the last
  `window_s` seconds gets a pool sized to the create rate (over the span of those creates, at
  least 1 s, so a burst counts fully) times the time one warm build takes (x2, +1), up to
  `max_per_image`. When an image sees no create for `idle_s`, its pool shrinks
  back to the configured floor (0 if none): the frozen sandboxes are destroyed and their memory
  given back.
At most `max_total` warm sandboxes exist on the node. One background task builds and trims,
one sandbox at a time, so refills never starve user creates of CPU.

Warm sandboxes are not user sandboxes: not listed, not in quotas or requested totals, no
events, no placements; their memory does count in the node's observed use."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec

from corral_common import logs, metrics
from corral_common.contract.errors import NotFound
from corral_common.contract.messages import SUBSTRATES, SandboxInfo, SandboxSpec

from .cgroups import Cgroups
from .substrates.base import Sandbox, Substrate

log = logging.getLogger("corral.node.warmpool")

POOL_SIZE = metrics.gauge("corral_warm_pool_size", "Warm (pre-created, frozen) sandboxes ready", ("node", "image"))
POOL_TARGET = metrics.gauge("corral_warm_pool_target", "Warm sandboxes the pool aims to keep", ("node", "image"))
HITS = metrics.counter("corral_warm_pool_hits_total", "Creates served by claiming a warm sandbox", ("node", "image"))
MISSES = metrics.counter("corral_warm_pool_misses_total", "Creates that found no warm sandbox", ("node", "image"))
BUILT = metrics.counter("corral_warm_pool_built_total", "Warm sandboxes built", ("node", "image"))
TRIMMED = metrics.counter("corral_warm_pool_trimmed_total", "Warm sandboxes destroyed unclaimed (demand dropped)", ("node", "image"))
BUILD_SECONDS = metrics.histogram("corral_warm_pool_build_seconds", "Time to build and freeze one warm sandbox", ("node",),
                                  buckets=(0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5))
CLAIM_SECONDS = metrics.histogram("corral_warm_pool_claim_seconds", "Time to claim a warm sandbox (rename, limits, thaw)", ("node",),
                                  buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1))


REFILL_DELAY_S = 0.1
IMAGE_CHECK_S = 5.0


class PoolConfig(msgspec.Struct, kw_only=True):
    configured: dict[str, int] = {}  # image -> warm sandboxes always kept
    learn: bool = False
    learn_min: int = 3  # creates within window_s that make an image hot
    window_s: float = 60.0
    idle_s: float = 60.0  # no create for this long: back to the configured floor
    max_per_image: int = 8
    max_total: int = 32


def parse_pools(items: list[str]) -> dict[str, int]:
    """`["busybox=4", "debian", "microvm:busybox=2"]` -> {"busybox": 4, "debian": 1,
    "microvm:busybox": 2} (a bare image is the container substrate's), with a clear error otherwise."""
    out: dict[str, int] = {}
    for item in items:
        name, _, n = item.partition("=")
        try:
            count = int(n) if n else 1
        except ValueError:
            raise ValueError(f"--warm-pool {item!r}: expected [SUBSTRATE:]IMAGE=COUNT, e.g. busybox=4 or microvm:busybox=2") from None
        substrate, sep, image = name.rpartition(":")
        if not image or count < 0 or (sep and substrate not in SUBSTRATES):
            raise ValueError(f"--warm-pool {item!r}: expected [SUBSTRATE:]IMAGE=COUNT with COUNT >= 0 and SUBSTRATE one of "
                             f"{', '.join(SUBSTRATES)}")
        out[name] = count
    return out


class WarmPool:
    def __init__(self, sub: Substrate, node: str, cfg: PoolConfig,
                 on_gone: Callable[[str], None], may_grow: Callable[[], bool],
                 image_exists: Callable[[str], Awaitable[bool]]):
        self.sub = sub
        self.node = node
        self.prefix = "" if sub.name == "container" else f"{sub.name}:"  # in metrics and heartbeats: microvm:busybox
        self.cfg = cfg
        self.on_gone = on_gone  # a warm sandbox went away unclaimed (audit sources forget its id)
        self.may_grow = may_grow  # the node has room (accepting, not near its limits)
        self.image_exists = image_exists  # the image is still in the catalog (claims skip that check)
        self.checked_at = 0.0
        self.ready: dict[str, deque[Sandbox]] = {}
        self.demand: dict[str, deque[float]] = {}
        self.failed_until: dict[str, float] = {}
        self.build_s = 0.15  # moving average of one warm build
        self.targets: dict[str, int] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.hits = 0
        self.misses = 0
        self.refill_timer: asyncio.TimerHandle | None = None

    # ---- what the agent asks

    def count(self) -> int:
        return sum(len(q) for q in self.ready.values())

    def by_image(self) -> dict[str, int]:
        return {self.prefix + image: len(q) for image, q in self.ready.items() if q}

    def cgroups(self) -> dict[str, Cgroups]:
        return {sb.id: sb.cg for q in self.ready.values() for sb in q if sb.cg is not None}

    async def claim(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox | None:
        """A warm sandbox of `spec.image` turned into `info.id`, or None (build a cold one)."""
        image = spec.image
        self.demand.setdefault(image, deque()).append(time.monotonic())
        q = self.ready.get(image)
        if not q:
            self.misses += 1
            MISSES.labels(self.node, self.prefix + image).inc()
            self._refill_soon()
            return None
        warm = q.popleft()
        POOL_SIZE.labels(self.node, self.prefix + image).set(len(q))
        self._refill_soon()
        t0 = time.perf_counter()
        try:
            sb = await self.sub.claim_warm(warm, info, spec)
        except Exception as e:
            self.on_gone(warm.id)
            self.misses += 1
            MISSES.labels(self.node, self.prefix + image).inc()
            logs.kv(log, logging.WARNING, "warm sandbox could not be claimed; building a cold one", warm=warm.id,
                    sandbox=info.id, error=str(e))
            return None
        CLAIM_SECONDS.labels(self.node).observe(time.perf_counter() - t0)
        self.hits += 1
        HITS.labels(self.node, self.prefix + image).inc()
        return sb

    def _refill_soon(self) -> None:
        """Refill in the background, a moment after the create that needs it has answered: a
        warm build (runc run) takes ~100 ms of CPU and would otherwise compete with the claim."""
        if self.refill_timer is None or self.refill_timer.cancelled():
            def fire() -> None:
                self.refill_timer = None
                self.wake.set()

            self.refill_timer = asyncio.get_running_loop().call_later(REFILL_DELAY_S, fire)

    # ---- sizing

    def target(self, image: str, now: float) -> int:
        floor = self.cfg.configured.get(image, 0)
        d = self.demand.get(image)
        if d is None or not self.cfg.learn:
            return floor
        while d and now - d[0] > self.cfg.window_s:
            d.popleft()
        if not d or now - d[-1] > self.cfg.idle_s or len(d) < self.cfg.learn_min:
            return floor
        rate = len(d) / max(now - d[0], 1.0)  # over the span of recent creates: bursts count fully
        learned = min(self.cfg.max_per_image, math.ceil(rate * self.build_s * 2) + 1)
        return max(floor, learned)

    def _targets(self, now: float) -> dict[str, int]:
        images = set(self.cfg.configured) | set(self.demand) | {i for i, q in self.ready.items() if q}
        targets = {i: self.target(i, now) for i in images}
        # over the node's total: the images with most demand keep theirs
        total = 0
        for image in sorted(targets, key=lambda i: (-len(self.demand.get(i, ())), i)):
            targets[image] = min(targets[image], max(0, self.cfg.max_total - total))
            total += targets[image]
        for image, n in targets.items():
            POOL_TARGET.labels(self.node, self.prefix + image).set(n)
        for image in [i for i, d in self.demand.items() if not d and not targets.get(i)]:
            del self.demand[image]  # forget images nobody asks for any more
        return targets

    # ---- background work

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), 1.0)
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                if await self._step():
                    self.wake.set()  # more to do: go on without waiting
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("warm pool step failed")
                await asyncio.sleep(1)

    async def _step(self) -> bool:
        """Trim every pool over its target, then build one sandbox for the neediest pool.
        Returns whether another build is due."""
        now = time.monotonic()
        if now - self.checked_at > IMAGE_CHECK_S:
            # images deleted from the catalog since their warm sandboxes were built: drop them
            # (claims skip the catalog look-up to stay fast; this bounds how stale they can be)
            self.checked_at = now
            for image in [i for i, q in self.ready.items() if q]:
                if not await self.image_exists(image):
                    self.failed_until[image] = now + 30
                    self.demand.pop(image, None)
                    q = self.ready[image]
                    while q:
                        TRIMMED.labels(self.node, self.prefix + image).inc()
                        await self._destroy(q.pop())
                    POOL_SIZE.labels(self.node, self.prefix + image).set(0)
        self.targets = targets = self._targets(now)
        for image, q in self.ready.items():
            while len(q) > targets.get(image, 0):
                sb = q.pop()  # the newest: the oldest stay first in line
                POOL_SIZE.labels(self.node, self.prefix + image).set(len(q))
                TRIMMED.labels(self.node, self.prefix + image).inc()
                await self._destroy(sb)
        needy = [(targets[i] - len(self.ready.get(i, ())), i) for i in targets
                 if targets[i] > len(self.ready.get(i, ())) and self.failed_until.get(i, 0) <= now]
        if not needy or not self.may_grow():
            return False
        _, image = max(needy)
        t0 = time.perf_counter()
        build = asyncio.ensure_future(self.sub.create_warm(image))
        try:
            sb = await asyncio.shield(build)
        except asyncio.CancelledError:
            # the pool is closing mid-build: the build ends, then goes (a build cut off half-way
            # left its sandbox dir and runc state behind)
            with contextlib.suppress(Exception):
                await self._destroy(await build)
            raise
        except NotFound as e:
            self.failed_until[image] = now + 30
            logs.kv(log, logging.WARNING, "warm pool image not found; retrying in 30 s", image=image, error=str(e))
            return len(needy) > 1
        except Exception as e:
            self.failed_until[image] = now + 5
            logs.kv(log, logging.WARNING, "warm sandbox build failed", image=image, error=str(e))
            return len(needy) > 1
        dt = time.perf_counter() - t0
        self.build_s = 0.8 * self.build_s + 0.2 * dt
        BUILD_SECONDS.labels(self.node).observe(dt)
        BUILT.labels(self.node, self.prefix + image).inc()
        q = self.ready.setdefault(image, deque())
        q.append(sb)
        POOL_SIZE.labels(self.node, self.prefix + image).set(len(q))
        return True

    async def _destroy(self, sb: Sandbox) -> None:
        self.on_gone(sb.id)
        try:
            await self.sub.destroy(sb)
        except Exception:
            log.exception("could not destroy a warm sandbox", extra={"fields": {"warm": sb.id}})

    async def close(self) -> None:
        if self.refill_timer is not None:
            self.refill_timer.cancel()
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):  # stopping: how the cancelled refill task ended no longer matters
                pass
        for image, q in self.ready.items():
            while q:
                await self._destroy(q.pop())
            POOL_SIZE.labels(self.node, self.prefix + image).set(0)
