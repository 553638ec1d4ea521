"""Bus responders that misbehave the way failing services do, for the clients' retry paths."""
from __future__ import annotations

import time

import nats

from corral_common import auth


async def responder_dropping_first_asking(url: str, subject: str) -> tuple[nats.NATS, list[float]]:
    """A responder on `subject` that hears every asking (their times, in the list it returns) and
    answers all but the first, as a failover that lost the first asking would."""
    responder = await nats.connect(auth.servers(url), **auth.connect_options(url))
    heard: list[float] = []

    async def answer(m) -> None:
        heard.append(time.monotonic())
        if len(heard) > 1:
            await m.respond(b'{"ok": true, "node": "n", "sandboxes": 0}')

    await responder.subscribe(subject, cb=answer)
    await responder.flush()
    return responder, heard
