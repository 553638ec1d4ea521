"""Waiting for room, first come first served.

A `capacity` answer means nothing ran: every node is full (a run holds its cpu and memory until it
ends). Retrying each refused request on a timer would have hundreds of requests polling the
scheduler and the luckiest, not the oldest, getting the next free room. Instead a refused request
queues here, and each run that ends (freeing room) wakes the oldest waiter to try again; a waiter
also tries again after the scheduler's retry hint when this gateway has nothing running (the room
is held by others). A request that finds others waiting queues behind them. After `wait_s` the
last `capacity` answer is the request's (HTTP 429)."""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from corral_common import metrics
from corral_common.contract.errors import Capacity

T = TypeVar("T")
WAITING = metrics.gauge("corral_gateway_waiting", "Runs waiting for room (their last attempt was answered `capacity`)", ())
IDLE_RETRY_S = 5.0  # with runs of ours in flight, one of them ending wakes a waiter; this is only a backstop


class Admission:
    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.running = 0

    def _wake(self) -> None:
        while self.waiters:
            f = self.waiters.popleft()
            if not f.done():
                f.set_result(None)
                return

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.wait_s
        refused: Capacity | None = None
        front = False
        if self.waiters:  # others wait for room already: behind them
            await self._wait(deadline, None, front)
        while True:
            self.running += 1
            try:
                out = await call()
            except Capacity as e:
                refused = e
                self.running -= 1
            except BaseException:
                self.running -= 1
                self._wake()
                raise
            else:
                self.running -= 1
                self._wake()  # a run ended and its room is free: the oldest waiter's turn
                return out
            if time.monotonic() >= deadline:
                raise refused
            await self._wait(deadline, refused, front)
            front = True  # refused again after its turn: it keeps its place at the front

    async def _wait(self, deadline: float, refused: Capacity | None, front: bool) -> None:
        """Until a run of ours ends and it is this waiter's turn, or the retry hint passes."""
        fut = asyncio.get_running_loop().create_future()
        (self.waiters.appendleft if front else self.waiters.append)(fut)
        hint = (refused.retry_after_s if refused and refused.retry_after_s else 0.5) if self.running == 0 else IDLE_RETRY_S
        WAITING.inc()
        try:
            await asyncio.wait_for(fut, max(0.01, min(hint, deadline - time.monotonic())))
        except TimeoutError:
            pass
        finally:
            WAITING.dec()
            if not fut.done():
                fut.cancel()
