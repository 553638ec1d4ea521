"""Reading back what the CORRAL_AUDIT stream holds for one subject, as tests check it."""
from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext


async def stored(js: JetStreamContext, subject: str, idle_s: float = 1.0) -> list[Msg]:
    """Every message stored on `subject`, in stream order: an ordered consumer read until it has
    delivered nothing for `idle_s` (what is stored is delivered at once; the wait only ends it)."""
    sub = await js.subscribe(subject, ordered_consumer=True)
    out: list[Msg] = []
    try:
        while True:
            try:
                out.append(await sub.next_msg(timeout=idle_s))
            except Exception:  # nats' TimeoutError: nothing more is stored
                break
    finally:
        await sub.unsubscribe()
    return out
