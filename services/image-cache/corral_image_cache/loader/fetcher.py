"""Fetching chunks from the chunk store: a bounded pool of workers, single-flight per chunk hash,
demand before prefetch, a timeout per attempt, retries, and sha256 verification of every chunk.

Demand fetches may use every worker; prefetch and background fill leave `reserve` workers free
so that a sandbox's read never queues behind a long trace replay."""
from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import time

from corral_common import logs
from corral_common.contract.errors import NotFound
from corral_common.layers import ChunkBackend

log = logging.getLogger("corral.loader.fetch")

DEMAND, PREFETCH, FILL = 0, 1, 2
PRIO_NAMES = {DEMAND: "demand", PREFETCH: "prefetch", FILL: "fill"}


class ChunkError(Exception):
    """A chunk could not be fetched or failed verification; readers get EIO."""

    def __init__(self, h: str, reason: str, message: str):
        super().__init__(message)
        self.h = h
        self.reason = reason  # not_found | verify | timeout | error
        self.message = message


class _Fetch:
    __slots__ = ("h", "size", "prio", "future", "started", "seq")

    def __init__(self, h: str, size: int, prio: int, future: asyncio.Future, seq: int):
        self.h = h
        self.size = size
        self.prio = prio
        self.future = future
        self.started = False
        self.seq = seq


def verify(data: bytes, h: str, size: int) -> str | None:
    """None if `data` is the chunk `h` of `size` bytes, else what is wrong."""
    if len(data) != size:
        return f"got {len(data)} bytes, expected {size}"
    got = hashlib.sha256(data).hexdigest()
    if got != h:
        return f"content hashes to {got}"
    return None


class FetchPool:
    def __init__(self, backend: ChunkBackend, workers: int = 8, timeout_s: float = 10.0, retries: int = 2,
                 backoff_s: float = 0.2, observe=None):
        self.backend = backend
        self.workers = max(1, workers)
        self.reserve = max(1, self.workers // 4) if self.workers > 1 else 0
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.observe = observe  # callback(prio, seconds, nbytes, ok)
        self.inflight: dict[str, _Fetch] = {}
        self.queues = {DEMAND: collections.deque(), PREFETCH: collections.deque(), FILL: collections.deque()}
        self.background_running = 0
        self.cond: asyncio.Condition | None = None
        self.tasks: list[asyncio.Task] = []
        self.seq = itertools.count()

    def start(self) -> None:
        self.cond = asyncio.Condition()
        self.tasks = [asyncio.create_task(self._worker(), name=f"fetch-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for f in list(self.inflight.values()):
            if not f.future.done():
                f.future.set_exception(ChunkError(f.h, "error", "the loader is shutting down"))
                f.future.exception()
        self.inflight.clear()

    def drop_queued(self, prios: tuple[int, ...]) -> int:
        """Fail the fetches of these priorities that no worker has started (shutdown): their
        waiters get ChunkError at once instead of keeping the loader up to fetch them."""
        n = 0
        for p in prios:
            q = self.queues[p]
            while q:
                f = q.popleft()
                if f.started or f.prio != p or f.future.done():
                    continue  # running, or promoted to a higher priority (its entry there is live)
                if self.inflight.get(f.h) is f:
                    del self.inflight[f.h]
                f.future.set_exception(ChunkError(f.h, "error", "the loader is shutting down"))
                f.future.exception()
                n += 1
        return n

    def queued(self) -> dict[str, int]:
        return {PRIO_NAMES[p]: sum(1 for f in q if not f.started) for p, q in self.queues.items()}

    async def get(self, h: str, size: int, prio: int) -> bytes:
        """The verified bytes of chunk `h`; joins a fetch of the same hash already queued or running,
        raising its priority if this caller's is higher."""
        f = self.inflight.get(h)
        if f is None:
            fut = asyncio.get_running_loop().create_future()
            f = _Fetch(h, size, prio, fut, next(self.seq))
            self.inflight[h] = f
            self.queues[prio].append(f)
            async with self.cond:
                self.cond.notify()
        elif prio < f.prio and not f.started:
            f.prio = prio
            self.queues[prio].append(f)  # the stale entry in the lower queue is skipped
            async with self.cond:
                self.cond.notify()
        return await asyncio.shield(f.future)

    async def promote(self, h: str, prio: int) -> None:
        """A queued fetch is now wanted at a higher priority (a demand read joined a prefetch)."""
        f = self.inflight.get(h)
        if f is None or f.started or prio >= f.prio:
            return
        f.prio = prio
        self.queues[prio].append(f)
        async with self.cond:
            self.cond.notify()

    def _next(self) -> _Fetch | None:
        q = self.queues[DEMAND]
        while q:
            f = q.popleft()
            if not f.started:
                return f
        if self.background_running >= self.workers - self.reserve:
            return None
        for p in (PREFETCH, FILL):
            q = self.queues[p]
            while q:
                f = q.popleft()
                if not f.started:
                    return f
        return None

    async def _worker(self) -> None:
        while True:
            async with self.cond:
                while (f := self._next()) is None:
                    await self.cond.wait()
                f.started = True
                background = f.prio != DEMAND
                if background:
                    self.background_running += 1
            try:
                await self._run(f)
            finally:
                if self.inflight.get(f.h) is f:
                    del self.inflight[f.h]
                if not f.future.done():  # cancelled mid-fetch (shutdown): never leave a waiter hanging
                    f.future.set_exception(ChunkError(f.h, "error", "the loader is shutting down"))
                    f.future.exception()
                if background:
                    async with self.cond:
                        self.background_running -= 1
                        self.cond.notify_all()

    async def _run(self, f: _Fetch) -> None:
        t0 = time.perf_counter()
        err: ChunkError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)))
            try:
                data = await asyncio.wait_for(self.backend.get(f.h), self.timeout_s)
            except NotFound as e:
                err = ChunkError(f.h, "not_found", str(e.message))
                break  # the store answered: retrying will not make it appear
            except (TimeoutError, asyncio.TimeoutError):
                err = ChunkError(f.h, "timeout", f"fetching chunk {f.h} timed out after {self.timeout_s:g}s")
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = ChunkError(f.h, "error", f"fetching chunk {f.h} failed: {type(e).__name__}: {e}")
                continue
            bad = await asyncio.to_thread(verify, data, f.h, f.size)
            if bad is None:
                if self.observe:
                    self.observe(f.prio, time.perf_counter() - t0, len(data), True)
                if not f.future.done():
                    f.future.set_result(data)
                return
            err = ChunkError(f.h, "verify", f"chunk {f.h} from the store failed verification: {bad}")
            logs.kv(log, logging.WARNING, "chunk failed verification", chunk=f.h, attempt=attempt + 1, error=bad)
        if self.observe:
            self.observe(f.prio, time.perf_counter() - t0, 0, False)
        if not f.future.done():
            f.future.set_exception(err)
            f.future.exception()  # consumers are shielded; never "exception was never retrieved"
