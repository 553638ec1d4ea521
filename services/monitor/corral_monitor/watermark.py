"""How far the monitor has *stored* a stream: the highest stream sequence S such that every message
with sequence <= S has been committed to ClickHouse (or dead-lettered) by this process.

The pull consumer's workers commit fetches out of order (several workers; a nak'ed message comes
back after later ones), so the mark advances only contiguously: sequences done beyond it wait in
`ahead` until the gap before them closes. It starts at the durable consumer's ack floor (every
message up to it was stored before, by this or an earlier process). With several monitor replicas
on one durable, this process never sees the others' messages and its own mark stalls at the first
of them; `raise_to(ack_floor)` then lifts it to the consumer's ack floor, which JetStream keeps
contiguous across every replica (and messages are acked only after their commit)."""
from __future__ import annotations

import asyncio

MAX_AHEAD = 200_000  # beyond this many sequences waiting for a gap, forget the oldest (the ack floor covers them)


class Watermark:
    def __init__(self, through: int = 0):
        self.through = through
        self.ahead: set[int] = set()
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def done(self, seqs: list[int]) -> None:
        """These sequences are stored."""
        t = self.through
        ahead = self.ahead
        for s in seqs:
            if s > t:
                ahead.add(s)
        while t + 1 in ahead:
            t += 1
            ahead.discard(t)
        if len(ahead) > MAX_AHEAD:
            # a gap that never closes here (another replica holds it): keep memory bounded; the
            # ack floor is the way past it
            ahead.difference_update(sorted(ahead)[: len(ahead) - MAX_AHEAD // 2])
        self._advance(t)

    def raise_to(self, floor: int) -> None:
        """Every sequence <= `floor` is stored (the durable's ack floor says so)."""
        if floor <= self.through:
            return
        t = floor
        self.ahead = {s for s in self.ahead if s > t}
        while t + 1 in self.ahead:
            t += 1
            self.ahead.discard(t)
        self._advance(t)

    def _advance(self, t: int) -> None:
        if t == self.through:
            return
        self.through = t
        if self._waiters:
            keep = []
            for seq, fut in self._waiters:
                if seq <= t:
                    if not fut.done():
                        fut.set_result(None)
                elif not fut.done():
                    keep.append((seq, fut))
            self._waiters = keep

    async def wait(self, seq: int, timeout: float) -> bool:
        """Until everything through `seq` is stored here, or `timeout` seconds: whether it is."""
        if seq <= self.through:
            return True
        if timeout <= 0:
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            pass
        finally:
            if not fut.done():
                fut.cancel()
                self._waiters = [(s, f) for s, f in self._waiters if f is not fut]
        return seq <= self.through
