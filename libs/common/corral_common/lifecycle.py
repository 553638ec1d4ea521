"""How a service process runs: until SIGINT or SIGTERM, then a clean stop.

Every service's `run(stop)` drains on its own once `stop` is set (finish in-flight requests,
ack what was stored, say `stopping` in a last heartbeat); the signal only sets it."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def run_until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `run(stop)` on a fresh event loop; SIGINT and SIGTERM set `stop`."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        await run(stop)

    asyncio.run(main())
