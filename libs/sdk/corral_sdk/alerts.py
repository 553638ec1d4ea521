"""Alerts from the monitor, as an async iterator of `Alert` (libs/common/corral_common/contract/audit.py).

    async with client.alerts.subscribe(job="rollout-7") as alerts:     # subscribed on enter: nothing missed
        async for a in alerts:
            print(a.severity, a.rule, a.sandbox, a.message)

    async for a in client.alerts.subscribe(severity="critical"):       # subscribes on first iteration
        ...

Alerts travel on `corral.alerts.<severity>.<rule>` (JetStream stream CORRAL_ALERTS). By default
this is a core NATS subscription: alerts from now on. `since=<unix time>` replays the stream from
that time first (an ordered JetStream consumer), then continues live. Filters by job and sandbox
are applied here (they are not in the subject); by severity and rule in the subject."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec

from corral_common.contract import subjects
from corral_common.contract.audit import Alert

if TYPE_CHECKING:
    from .client import AsyncClient

ALERTS_PREFIX = subjects.ALERTS_PREFIX
SEVERITIES = ("info", "low", "medium", "high", "critical")
_decoder = msgspec.json.Decoder(type=Alert)


def _token(values: str | Iterable[str] | None) -> list[str]:
    if values is None:
        return ["*"]
    if isinstance(values, str):
        return [values]
    vals = list(values)
    return vals or ["*"]


class AlertSubscription:
    """An async iterator (and async context manager) over matching alerts."""

    def __init__(self, client: AsyncClient, job: str | None = None, severity: str | Iterable[str] | None = None,
                 rule: str | Iterable[str] | None = None, sandbox: str | None = None, since: float | None = None,
                 min_severity: str | None = None, tenant: str | None = None):
        if tenant is not None and since is not None:
            raise ValueError("a tenant's alerts are live only: `since` replays the operator's stream")
        self.client = client
        self.job = job
        self.sandbox = sandbox
        self.since = since
        sev = _token(severity)
        if min_severity is not None:
            if min_severity not in SEVERITIES:
                raise ValueError(f"min_severity must be one of {SEVERITIES}")
            sev = list(SEVERITIES[SEVERITIES.index(min_severity):])
        self.subjects = [subjects.alert(s, r) if tenant is None else subjects.tenant_alert(tenant, s, r)
                         for s in sev for r in _token(rule)]
        self._queue: asyncio.Queue[Alert | None] = asyncio.Queue()
        self._subs: list[Any] = []
        self._seen: set[str] = set()
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> AlertSubscription:
        if self._started:
            return self
        self._started = True
        nc = self.client.nc
        if self.since is not None:
            from nats.js.api import ConsumerConfig, DeliverPolicy

            start = datetime.fromtimestamp(self.since, tz=timezone.utc).isoformat().replace("+00:00", "Z")
            js = nc.jetstream()
            for subj in self.subjects:
                cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)  # type: ignore[arg-type]  # nats-py types it datetime, but its as_dict passes the value to json.dumps as is: the server wants the RFC 3339 string
                self._subs.append(await js.subscribe(subj, cb=self._on_msg, ordered_consumer=True, config=cfg))
        else:
            for subj in self.subjects:
                self._subs.append(await nc.subscribe(subj, cb=self._on_msg))
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._subs:
            try:
                await s.unsubscribe()
            except Exception:  # closing: a subscription whose connection already closed is gone anyway
                pass
        self._queue.put_nowait(None)

    async def __aenter__(self) -> AlertSubscription:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ delivery

    async def _on_msg(self, msg: Any) -> None:
        try:
            a = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if self.job is not None and a.job != self.job:
            return
        if self.sandbox is not None and a.sandbox != self.sandbox:
            return
        if a.id in self._seen:  # a replayed alert that was also delivered live
            return
        self._seen.add(a.id)
        if len(self._seen) > 100_000:
            self._seen.clear()
        self._queue.put_nowait(a)

    def __aiter__(self) -> AsyncIterator[Alert]:
        return self

    async def __anext__(self) -> Alert:
        if not self._started:
            await self.start()
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        a = await self._queue.get()
        if a is None:
            raise StopAsyncIteration
        return a

    async def next(self, timeout: float | None = None) -> Alert:
        """The next alert, or `TimeoutError` after `timeout` seconds."""
        return await asyncio.wait_for(self.__anext__(), timeout)

    def pending(self) -> list[Alert]:
        """Alerts received and not yet consumed (without waiting)."""
        out = []
        while not self._queue.empty():
            a = self._queue.get_nowait()
            if a is None:
                self._queue.put_nowait(None)
                break
            out.append(a)
        return out


class Alerts:
    """`client.alerts`: subscribe to the monitor's alerts."""

    def __init__(self, client: AsyncClient):
        self._client = client

    def subscribe(self, job: str | None = None, severity: str | Iterable[str] | None = None, *,
                  rule: str | Iterable[str] | None = None, sandbox: str | None = None, since: float | None = None,
                  min_severity: str | None = None, tenant: str | None = None) -> AlertSubscription:
        """`tenant="alice"`: alice's own alerts, on her subjects (what a tenant's connection may
        hear; live only, `since` is the operator's)."""
        return AlertSubscription(self._client, job=job, severity=severity, rule=rule, sandbox=sandbox, since=since,
                                 min_severity=min_severity, tenant=tenant)
