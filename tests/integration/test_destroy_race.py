"""Requests racing the end of what serves them get an answer, never silence until the caller's
timeout: a request the server had already routed to a subscription when it was unsubscribed used
to be dropped with it (and, while unserve's round trip was `nc.flush()`, whose PING nats-py puts
on the wire ahead of the queued UNSUB, the server routed some after it: ~1 unserve in 50 under
this flood on a bare server, ~1 in 300 in the stack's), and a sandbox's subject went unserved for
the whole of its teardown (`info` polled while a gVisor sandbox was OOM-killed waited out its
30 s)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats
import pytest

from corral_common import bus
from corral_common.contract import envelope, subjects
from corral_common.contract.errors import NotFound
from corral_common.contract.replies import InfoReply

CALLERS = 32


async def _poll(nc, subject: str, stop: asyncio.Event, outcomes: list[str], decode=None) -> None:
    """Requests back to back until told to stop or nobody serves the subject; each outcome recorded."""
    while not stop.is_set():
        try:
            msg = await nc.request(subject, b"{}", timeout=20)
        except nats.errors.NoRespondersError:
            outcomes.append("gone")
            return
        except nats.errors.TimeoutError:
            outcomes.append("silence" if stop.is_set() or "ending" in outcomes else "silence before the end")
            return
        try:
            if decode is not None:
                decode(msg.data)
            outcomes.append("answer")
        except NotFound:
            outcomes.append("not_found")


async def _flood_until(nc, subject: str, outcomes: list[str], end, decode=None) -> None:
    """CALLERS pollers on `subject`, `end()` awaited once each has had an answer."""
    stop = asyncio.Event()
    pollers = [asyncio.create_task(_poll(nc, subject, stop, outcomes, decode)) for _ in range(CALLERS)]
    try:
        while outcomes.count("answer") < CALLERS and not all(p.done() for p in pollers):
            await asyncio.sleep(0.005)
        outcomes.append("ending")
        await end()
        await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*pollers)


async def _echo(msg) -> bytes:
    return msg.data


@contextlib.asynccontextmanager
async def _responder(url: str, service: str) -> AsyncIterator[tuple[bus.Responder, nats.NATS, nats.NATS]]:
    """A Responder of the test's own on one connection, and another connection for its callers."""
    nc = await nats.connect(url)
    callers = await nats.connect(url)
    try:
        yield bus.Responder(nc, service), nc, callers
    finally:
        await callers.close()
        await nc.close()


async def test_unserve_answers_every_request_already_routed(stack):
    async with _responder(stack.url, "unserve-test") as (r, _, callers):
        for i in range(40):
            subject = f"unserve-test.{i}"
            outcomes: list[str] = []
            await r.serve(subject, _echo, "echo", key=subject)
            await _flood_until(callers, subject, outcomes, lambda s=subject: r.unserve(s))
            assert not [o for o in outcomes if o.startswith("silence")], f"round {i}: requests unanswered: {sorted(set(outcomes))}"
            assert outcomes.count("gone") == CALLERS, outcomes  # and, once unserved, nothing answers
        await r.drain()


async def test_a_request_delivered_after_unserve_is_still_answered(stack):
    """A MSG the connection is handed for a subscription already unserved (what an unserve whose
    round trip was `nc.flush()` met ~1 in 35 under the flood above: that PING went out ahead of
    the UNSUB) is answered while the subscription lingers, and the subscription is forgotten
    after `LATE_S` (or at once when the responder drains). Replayed deterministically."""
    async with _responder(stack.url, "late-test") as (r, nc, callers):
        for i, drain in enumerate((False, True)):
            subject = f"late-test.{i}"
            await r.serve(subject, _echo, "echo", key=subject)
            assert await bus.barrier(nc)  # the SUB reaches the server before the request
            assert (await callers.request(subject, b"served", timeout=5)).data == b"served"
            sid = r.subs[subject]._id
            await r.unserve(subject)
            # replayed at once, while the subscription surely lingers (the probe below takes time)
            inbox = callers.new_inbox()
            replies = await callers.subscribe(inbox)
            assert await bus.barrier(callers)
            await nc._process_msg(sid, subject.encode(), inbox.encode(), b"late", b"")  # as the server sent it
            assert (await replies.next_msg(timeout=5)).data == b"late"
            with pytest.raises(nats.errors.NoRespondersError):  # unserve returned: the server has the UNSUB
                await callers.request(subject, b"again", timeout=5)
            if drain:
                t0 = time.monotonic()
                await r.drain()
                assert time.monotonic() - t0 < bus.LATE_S, "drain waits out the linger"
            else:
                await asyncio.sleep(bus.LATE_S + 0.5)
            assert sid not in nc._subs, "an unserved subscription is forgotten once it has lingered"


async def test_served_means_routed_and_unserved_means_not(stack):
    """Once `serve` and a `barrier` return, a request from another connection reaches the
    subscription; once `unserve` returns, nothing serves it. With `nc.flush()` as the barrier
    ~1 round in 125 met "no responders" here (nats-py writes the PING ahead of the queued SUB)."""
    async with _responder(stack.url, "order-test") as (r, nc, callers):
        for i in range(500):
            subject = f"order-test.{i}"
            await r.serve(subject, _echo, "echo", key=subject)
            assert await bus.barrier(nc)
            assert (await callers.request(subject, b"%d" % i, timeout=5)).data == b"%d" % i, f"round {i}"
            await r.unserve(subject)
            with pytest.raises(nats.errors.NoRespondersError):
                await callers.request(subject, b"late", timeout=5)
        await r.drain()


async def test_calls_during_a_destroy_are_answered(client, nc):
    for _ in range(4):
        sb = await client.create(image="busybox")
        outcomes: list[str] = []
        await _flood_until(nc, subjects.sandbox_op(sb.id, "info"), outcomes, sb.destroy,
                           lambda data: envelope.decode_reply(data, InfoReply))
        assert not [o for o in outcomes if o.startswith("silence")], f"a request to {sb.id} went unanswered as it was destroyed: {sorted(set(outcomes))}"
        assert outcomes.count("not_found") >= CALLERS, outcomes  # every caller heard the sandbox go
