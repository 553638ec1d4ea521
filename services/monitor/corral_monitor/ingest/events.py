"""CORRAL_EVENTS into ClickHouse: sandbox lifecycle and node events become `sandbox_events` rows
whose ids hash subject and payload, so a redelivered or re-published event is stored once."""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from ..deadletters import DeadLetters
from ..pull import Staged
from ..store import SandboxEventRow, Store
from .common import DUPLICATES, EVENTS, INSERT_SECONDS, MAX_TS, MIN_TS, ROWS, RecentIds


class _Info(msgspec.Struct, kw_only=True):
    id: str = ""
    node: str = ""
    state: str = ""
    substrate: str = ""
    image: str = ""
    job: str = ""
    labels: dict[str, str] = {}
    cpu: float = 0.0
    memory_mb: int = 0


class _Event(msgspec.Struct, kw_only=True):
    kind: str = ""
    ts: float = 0.0
    sandbox_id: str = ""
    node: str = ""
    job: str = ""
    reason: str = ""
    info: _Info | None = None
    detail: dict[str, Any] = {}


_lifecycle_decoder = msgspec.json.Decoder(type=_Event)
_json = msgspec.json.Encoder()

OnLifecycle = Callable[[list[SandboxEventRow], list[_Event]], None]


class _EventPending:
    __slots__ = ("rows", "ids")

    def __init__(self) -> None:
        self.rows: list[SandboxEventRow] = []
        self.ids: list[str] = []


class EventIngest(Staged):
    """Handler for CORRAL_EVENTS: sandbox lifecycle (`corral.events.sandbox.<id>.<kind>`) and node
    events (`corral.events.node.<node>.<kind>`). Ids are a hash of subject and payload.
    `on_lifecycle` sees each fetch when it is staged; the rows are inserted at the commit."""

    stream = "CORRAL_EVENTS"

    def __init__(self, store: Store, dead: DeadLetters, on_lifecycle: OnLifecycle | None = None):
        self.store = store
        self.dead = dead
        self.on_lifecycle = on_lifecycle
        self.recent = RecentIds(100_000)
        self.inflight: set[str] = set()

    def new_pending(self) -> _EventPending:
        return _EventPending()

    async def stage(self, msgs: list[Msg], pending: _EventPending) -> None:
        rows: list[SandboxEventRow] = []
        evs: list[_Event] = []
        maybe_seen: set[str] = set()
        for m in msgs:
            parts = m.subject.split(".")
            if len(parts) < 5 or parts[2] not in ("sandbox", "node"):
                await self.dead.put(self.stream, m, m.data, "subject", f"unexpected subject {m.subject}")
                continue
            try:
                ev = _lifecycle_decoder.decode(m.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self.dead.put(self.stream, m, m.data, "event", str(e))
                continue
            rid = "ev-" + hashlib.blake2b(m.subject.encode() + b"\0" + m.data, digest_size=12).hexdigest()
            ts = ev.ts if MIN_TS <= ev.ts <= MAX_TS else m.metadata.timestamp
            info = ev.info or _Info()
            if parts[2] == "sandbox":
                sandbox, node, kind = parts[3], ev.node or info.node, ev.kind or parts[4]
            else:
                sandbox, node, kind = "", parts[3], ev.kind or parts[4]
            detail = {k: v for k, v in ev.detail.items()} if ev.detail else {}
            if parts[2] == "node" and not ev.detail:
                try:
                    detail = msgspec.json.decode(m.data)
                except Exception:
                    detail = {}
            rows.append(SandboxEventRow(
                id=rid, ts=ts, kind=kind, sandbox=sandbox, node=node, job=ev.job or info.job, reason=ev.reason,
                image=info.image, substrate=info.substrate, state=info.state, cpu=info.cpu, memory_mb=max(0, info.memory_mb),
                labels=info.labels, subject=m.subject, detail=_json.encode(detail).decode() if detail else "",
            ))
            evs.append(ev)
            if m.metadata.num_delivered and m.metadata.num_delivered > 1:
                maybe_seen.add(rid)
        seen: set[str] = set()
        fresh: list[SandboxEventRow] = []
        for r in rows:
            if r.id not in seen and r.id not in self.recent and r.id not in self.inflight:
                seen.add(r.id)
                fresh.append(r)
        if maybe_seen and fresh:
            have = await asyncio.to_thread(self.store.existing_ids, "sandbox_events", [r.id for r in fresh if r.id in maybe_seen])
            fresh = [r for r in fresh if r.id not in have]
        if self.on_lifecycle is not None and rows:
            self.on_lifecycle(rows, evs)
        if len(fresh) < len(rows):
            DUPLICATES.labels(self.stream).inc(len(rows) - len(fresh))
        ids = list(seen)
        pending.rows.extend(fresh)
        pending.ids.extend(ids)
        self.inflight.update(ids)

    async def commit(self, pending: _EventPending) -> None:
        if pending.rows:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.store.insert, "sandbox_events", pending.rows)
            INSERT_SECONDS.labels("sandbox_events").observe(time.perf_counter() - t0)
            ROWS.labels("sandbox_events").inc(len(pending.rows))
            EVENTS.labels(self.stream).inc(len(pending.rows))
        self.recent.add_all(pending.ids)
        self.inflight.difference_update(pending.ids)

    def abandon(self, pending: _EventPending) -> None:
        self.inflight.difference_update(pending.ids)
