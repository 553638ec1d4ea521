"""Bus responders that misbehave the way failing services do, for the clients' retry paths."""
from __future__ import annotations

import time

import nats
import pytest

from corral_common import auth, bus
from corral_common.contract.errors import Timeout
from corral_common.contract.replies import NodePingReply
from corral_sdk import AsyncClient


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
    assert await bus.barrier(responder)
    return responder, heard


async def check_hedged_once(url: str, subject: str, clustered: bool) -> None:
    """Against a responder that drops the first asking: a request safe to repeat is asked once
    more after `hedge_after_s` (not at its timeout) and gets the repeat's answer; one that is not
    safe to repeat is asked once and times out."""
    responder, heard = await responder_dropping_first_asking(url, subject)
    c = await AsyncClient.connect(url)
    c.hedge_after_s = 1.0
    try:
        assert c._clustered() == clustered
        t0 = time.monotonic()
        r = await c.request(subject, b"{}", NodePingReply, timeout=30, resend=True)
        assert r.node == "n" and len(heard) == 2 and 0.9 < heard[1] - heard[0], heard
        assert time.monotonic() - t0 < 20, "asked again after hedge_after_s, not at the timeout"
        heard.clear()
        with pytest.raises(Timeout):
            await c.request(subject, b"{}", NodePingReply, timeout=3)
        assert len(heard) == 1, heard
    finally:
        await c.close()
        await responder.close()
