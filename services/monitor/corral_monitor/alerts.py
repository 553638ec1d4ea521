"""Alerts: deduplicated, published on `corral.alerts.<severity>.<rule>` (JetStream, stream
CORRAL_ALERTS) and stored in ClickHouse.

One misbehaviour must not become a flood: at most one alert per (rule, sandbox) per `window_s`
seconds of *event* time (so a replay after a restart decides the same way), further matches are
counted in `corral_monitor_alerts_suppressed_total`. The throttle state is restored from the
alerts table at start.

Alert ids are deterministic (rule + the first evidence event's id), which makes re-raising after
a crash harmless: JetStream drops a re-published alert by its `Nats-Msg-Id` within the stream's
duplicate window (a core NATS subscriber may see it twice, with the same id: the SDK drops it),
and the ClickHouse insert skips ids already stored.

Alerts are published as soon as the rules have run, before the batch's events are inserted, so
ClickHouse's insert time is not part of the alert latency; their rows are stored after the events."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from corral_common import metrics
from corral_common.contract import labels, subjects
from corral_common.contract.audit import Alert, AuditEvent, Finding, Severity

from .store import AlertRow, Store

log = logging.getLogger("corral.monitor.alerts")

ALERTS = metrics.counter("corral_monitor_alerts_total", "Alerts raised", ("rule", "severity"))
SUPPRESSED = metrics.counter("corral_monitor_alerts_suppressed_total", "Rule matches not alerted (same rule and sandbox within the window)", ("rule",))
PUBLISH_SECONDS = metrics.histogram("corral_monitor_alert_publish_seconds", "Time to publish and store a batch of alerts",
                                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
MAX_EVIDENCE = 10
encoder = msgspec.json.Encoder()


def alert_id(rule: str, key: str) -> str:
    return "al-" + hashlib.blake2b(f"{rule}|{key}".encode(), digest_size=12).hexdigest()


def alert_paths(a: Alert) -> list[str]:
    """The files an alert is about: its own `paths` (a finding's), else those its evidence names."""
    if a.paths:
        return a.paths
    return list(dict.fromkeys(e.path for e in a.evidence if e.path))


def finding_alert(f: Finding, sandbox: str, node: str = "", job: str = "") -> Alert:
    """A finding another service reached (the grader's) as an alert. Its id is a function of the
    sandbox and the finding alone, so a retried request stores and publishes it once."""
    key = "\0".join(["finding", sandbox, f.severity, f.message, *f.paths])
    return Alert(id=alert_id(f.rule, key), ts=time.time(), rule=f.rule, severity=f.severity, sandbox=sandbox, node=node,
                 job=job, message=f.message, paths=list(f.paths))


def alert_tenant(a: Alert) -> str:
    """The tenant whose sandbox an alert is about, from the label the node set on its events."""
    return next((e.labels[labels.TENANT] for e in a.evidence if labels.TENANT in e.labels), "")


class AlertManager:
    def __init__(self, js: JetStreamContext | None, store: Store, window_s: float = 30.0, nc: NATS | None = None):
        self.js = js
        self.nc = nc
        self.store = store
        self.window_s = window_s
        self.last: dict[tuple[str, str], float] = {}

    def restore(self) -> int:
        """Reload the throttle state (latest alert per rule and sandbox within the window)."""
        res = self.store.query(
            "SELECT rule, sandbox, toFloat64(max(event_ts)) FROM alerts FINAL "
            f"WHERE event_ts >= now64(3) - INTERVAL {max(1, int(self.window_s) + 1)} SECOND GROUP BY rule, sandbox",
            max_rows=1_000_000, readonly=False)
        for rule, sandbox, ts in res.rows:
            self.last[(rule, sandbox)] = float(ts)
        return len(res.rows)

    def consider(self, rule: str, severity: Severity, message: str, evidence: list[AuditEvent], *, sandbox: str = "",
                 key: str = "", event_ts: float | None = None) -> Alert | None:
        """An Alert for this match, or None when the same rule already alerted on this sandbox
        within the window."""
        first = evidence[0] if evidence else None
        sandbox = sandbox or (first.sandbox if first else "")
        ts = event_ts if event_ts is not None else (first.ts if first else time.time())
        k = (rule, sandbox)
        prev = self.last.get(k)
        if prev is not None and abs(ts - prev) < self.window_s:
            SUPPRESSED.labels(rule).inc()
            return None
        self.last[k] = ts if prev is None else max(ts, prev)
        if len(self.last) > 200_000:
            self._prune(ts)
        return Alert(
            id=alert_id(rule, key or (first.id if first else f"{sandbox}|{ts}")),
            ts=time.time(), rule=rule, severity=severity, sandbox=sandbox,
            node=first.node if first else "", job=first.job if first else "",
            message=message, evidence=evidence[:MAX_EVIDENCE],
        )

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_s
        self.last = {k: v for k, v in self.last.items() if v >= cutoff}

    async def publish(self, alerts: list[Alert], maybe_seen: bool = False) -> list[Alert]:
        """Publish on the bus (JetStream, deduplicated by `Nats-Msg-Id`). `maybe_seen` (the events
        were delivered before: a crash or an ack timeout): skip alerts already stored, they were
        published then. Returns the alerts published; raises if publishing fails (the caller does
        not ack, the batch comes back)."""
        if not alerts:
            return []
        t0 = time.perf_counter()
        if maybe_seen:
            seen = await asyncio.to_thread(self.store.existing_ids, "alerts", [a.id for a in alerts])
            alerts = [a for a in alerts if a.id not in seen]
            if not alerts:
                return []
        if self.js is not None:
            await asyncio.gather(*(self.js.publish(subjects.alert(a.severity, a.rule), encoder.encode(a),
                                                   headers={"Nats-Msg-Id": a.id}, timeout=5) for a in alerts))
        if self.nc is not None:
            for a in alerts:  # a tenant hears the alerts on its own sandboxes (live, core NATS)
                tenant = alert_tenant(a)
                if tenant:
                    await self.nc.publish(subjects.tenant_alert(tenant, a.severity, a.rule), encoder.encode(a))
        for a in alerts:
            ALERTS.labels(a.rule, a.severity).inc()
            log.info("alert", extra={"fields": {"rule": a.rule, "severity": a.severity, "sandbox": a.sandbox, "job": a.job,
                                                "alert": a.id, "message": a.message[:300]}})
        PUBLISH_SECONDS.observe(time.perf_counter() - t0)
        return alerts

    async def store_alerts(self, alerts: list[Alert]) -> None:
        if not alerts:
            return
        rows = [AlertRow(id=a.id, ts=a.ts, event_ts=a.evidence[0].ts if a.evidence else a.ts, rule=a.rule,
                         severity=a.severity, sandbox=a.sandbox, node=a.node, job=a.job, message=a.message,
                         evidence_ids=[e.id for e in a.evidence], evidence=encoder.encode(a.evidence).decode(),
                         paths=alert_paths(a))
                for a in alerts]
        await asyncio.to_thread(self.store.insert, "alerts", rows)

    async def emit(self, alerts: list[Alert], maybe_seen: bool = False) -> list[Alert]:
        """Publish, then store."""
        out = await self.publish(alerts, maybe_seen)
        await self.store_alerts(out)
        return out
