"""A batch's record in `corral_requests` (one per request_id), and the lease of the attempt that
is placing it.

An attempt writes the record when it starts (`done: false`), renews its lease (`alive_at`) while
it places, and writes it again when it ends, with the items it could not make. A repeat of the
batch (the SDK hedges a slow request; a caller retries after a timeout) that finds an attempt
still renewing its lease waits for that attempt's outcome instead of placing the same items
beside it: two attempts at once each take the other's half-made items for made, and answer for
sandboxes that are not there yet, or never will be. An attempt whose lease ran out (its replica
died mid-batch) is taken over. Leases compare wall clocks across replicas: LEASE_STALE_S is far
above any skew a deployment tolerates."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract.errors import Conflict, Unavailable
from corral_common.contract.messages import SandboxSpec

log = logging.getLogger("corral.scheduler")

LEASE_RENEW_S = 1.0
LEASE_STALE_S = 6.0  # a lease not renewed for this long: its attempt is gone
POLL_S = 0.2  # how often a repeat looks at the record of the attempt it waits for
WAIT_MAX_S = 20.0  # a repeat waits this long for another attempt, then answers `unavailable` (ask again)


class BatchRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An attempt's size, the digest of its spec, when it last said it was placing (`alive_at`,
    wall clock) and, once it is done, the items it could not make (every other item was made)."""

    count: int
    failed: list[int] = []
    digest: str = ""  # spec_digest of the batch's spec ("" in records written before digests)
    done: bool = True
    alive_at: float = 0.0  # 0: no lease (a record written before leases: never waited for)

    def placing(self, now: float) -> bool:
        """An attempt is placing this batch now (its lease is fresh)."""
        return not self.done and now - self.alive_at < LEASE_STALE_S


def describe(spec: SandboxSpec) -> str:
    b = msgspec.to_builtins(spec)
    b.pop("request_id", None)
    return json.dumps(b, sort_keys=True)[:300]


def check_same_batch(rid: str, record: BatchRecord, count: int, digest: str, spec: SandboxSpec) -> None:
    """A request_id names one batch: the same count and spec on every retry."""
    if record.count != count:
        raise Conflict(f"request_id {rid!r} was used for a batch of {record.count}, not {count}: "
                       f"use a new request_id for a different batch")
    if record.digest and record.digest != digest:
        raise Conflict(f"request_id {rid!r} was used for a batch of {record.count} with a different spec "
                       f"(this one: {describe(spec)}): a retry must send the same spec; "
                       f"use a new request_id for a different batch")


class Records:
    def __init__(self, kv: KeyValue):
        self.kv = kv

    async def get(self, key: str) -> BatchRecord | None:
        e = await bus.kv_get(self.kv, key, "the batch's record")
        if e is None or not e.value:
            return None
        try:
            return msgspec.json.decode(e.value, type=BatchRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def settled(self, key: str, rid: str, record: BatchRecord | None, count: int, digest: str,
                      spec: SandboxSpec) -> BatchRecord | None:
        """The record of a finished attempt, waiting up to WAIT_MAX_S for one that is still
        placing; None when there is none, or its attempt is gone (this one takes over).

        An attempt can outlast any caller's patience (nodes slow to make their shares, a round's
        timeout per node, three rounds): a repeat that waited on silently was answered after its
        caller had gone, and so was the next (a clean clone saw five repeats of 120 s each go
        unanswered after a host died). `unavailable` with a retry hint says what is going on; the
        SDK asks again while its timeout lasts (`settle`)."""
        t0 = time.time()
        while record is not None and record.placing(time.time()):
            if time.time() - t0 >= WAIT_MAX_S:
                logs.kv(log, logging.INFO, "batch repeat answered while another attempt places it", request_id=rid,
                        lease_age_s=round(time.time() - record.alive_at, 1))
                raise Unavailable(f"the batch of request_id {rid!r} is still being placed by another attempt "
                                  f"(for {time.time() - t0:.0f}s now); ask again: once it ends, a repeat is answered "
                                  f"from its record", retry_after_s=2.0)
            await asyncio.sleep(POLL_S)
            record = await self.get(key)
            if record is not None:
                check_same_batch(rid, record, count, digest, spec)
        return record if record is not None and record.done else None

    async def start(self, key: str, rid: str, count: int, digest: str, spec: SandboxSpec) -> None:
        """Note the batch's count and spec digest before anything is made, so that a concurrent
        attempt, or a retry after this replica died, with another spec is refused too."""
        data = msgspec.json.encode(BatchRecord(count=count, digest=digest, done=False, alive_at=time.time()))
        try:
            await self.kv.create(key, data)
            return
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:
            if "wrong last sequence" not in str(e).lower() and "key exists" not in str(e).lower():
                logs.kv(log, logging.WARNING, "batch record not written", request_id=rid, error=str(e))
                return
        other = await self.get(key)  # an earlier attempt's (taken over), or one written just before
        if other is not None:
            check_same_batch(rid, other, count, digest, spec)
        await self._put(key, data, rid)

    @contextlib.asynccontextmanager
    async def lease(self, key: str, rid: str, count: int, digest: str) -> AsyncIterator[None]:
        """Renew the attempt's lease while the block places; the renewals end before it returns
        (so none lands after the record that says the attempt is done)."""
        async def renew() -> None:
            while True:
                await asyncio.sleep(LEASE_RENEW_S)
                await self._put(key, msgspec.json.encode(BatchRecord(count=count, digest=digest, done=False, alive_at=time.time())), rid)

        task = asyncio.ensure_future(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def finish(self, key: str, rid: str, count: int, failed: list[int], digest: str) -> None:
        await self._put(key, msgspec.json.encode(BatchRecord(count=count, failed=failed, digest=digest)), rid)

    async def _put(self, key: str, data: bytes, rid: str) -> None:
        try:
            await self.kv.put(key, data)
        except Exception as e:  # the bus is failing over: the next renewal (or a retry) writes it
            logs.kv(log, logging.WARNING, "batch record not written", request_id=rid, error=str(e))
