"""The monitor service: consumes CORRAL_AUDIT and CORRAL_EVENTS durably into ClickHouse, runs the
detection rules, publishes alerts, and answers read-only SQL on `corral.v1.monitor.query`, the
rule list on `corral.v1.monitor.rules` and a grader's per-sandbox verdict on
`corral.v1.monitor.evaluate`."""
from __future__ import annotations

import asyncio
import gc
import logging

import msgspec
from nats.aio.msg import Msg

from corral_common import bus, logs, metrics, tenancy
from corral_common.contract import subjects
from corral_common.contract.audit import RulesReply

from . import rules as rulereg
from .alerts import AlertManager
from .deadletters import DeadLetters
from .detect import Detector
from .evaluate import Evaluator
from .ingest import AuditIngest, EventIngest, Fault
from .pull import PullConsumer
from .query import QueryService
from .store import DEFAULT_TTL_DAYS, Store, wait_connect
from .watermark import Watermark

log = logging.getLogger("corral.monitor")

QUERY_SUBJECT = subjects.MONITOR_QUERY
RULES_SUBJECT = subjects.MONITOR_RULES
QUEUE = "corral-monitor"
AUDIT_DURABLE = "corral-monitor-audit"
EVENTS_DURABLE = "corral-monitor-events"


class MonitorConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    clickhouse: str
    database: str = "default"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    workers: int = 1
    batch: int = 256
    ack_wait_s: float = 30.0
    commit_ms: float = 1000.0
    commit_mb: float = 8.0
    alert_window_s: float = 30.0
    window_every_s: float = 0.0  # the periodic pass runs each window rule this often (0: the rule's own period)
    protected_paths: list[str] = []
    canaries: list[str] = []
    ttl_days: int = 0  # 0: per-table defaults
    rules: list[str] = []  # only these rules (default all)
    fault: str = ""


class Monitor:
    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self.ready = asyncio.Event()
        self.store: Store | None = None
        self.tasks: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        self.metrics_url = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        self.nc = await bus.connect(cfg.nats_url, name="corral-monitor")
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        ttl = {t: cfg.ttl_days for t in DEFAULT_TTL_DAYS} if cfg.ttl_days else None
        self.store = store = await asyncio.to_thread(wait_connect, cfg.clickhouse, cfg.database, ttl_days=ttl)
        self.responder = bus.Responder(self.nc, "monitor", package="corral_monitor")
        query = QueryService(store, self.ready)
        # SQL over every tenant's audit, and the grader's evaluation: the operator's and corral's own
        await self.responder.serve(QUERY_SUBJECT, tenancy.for_operator(query.handle, "querying the audit store"), "query", queue=QUEUE)
        await self.responder.serve(RULES_SUBJECT, self._on_rules, "rules", queue=QUEUE)

        dead = DeadLetters(self.js)
        await dead.ensure()
        alerts = AlertManager(self.js, store, cfg.alert_window_s, nc=self.nc)
        restored = await asyncio.to_thread(alerts.restore)
        ctx = rulereg.RuleContext(cfg.protected_paths, cfg.canaries)
        detector = Detector(rulereg.build(ctx, cfg.rules or None), rulereg.build_sql(cfg.rules or None), alerts, store, ctx,
                            every_s=cfg.window_every_s)
        stored = Watermark()  # how far CORRAL_AUDIT is stored (evaluate waits on it)
        commit_s = max(0.0, cfg.commit_ms / 1000)
        ack_wait_s = max(cfg.ack_wait_s, min_ack_wait(commit_s))
        if ack_wait_s > cfg.ack_wait_s:
            logs.kv(log, logging.WARNING, "ack wait raised above the commit interval", ack_wait_s=ack_wait_s, commit_ms=cfg.commit_ms)
        audit = PullConsumer(self.js, "CORRAL_AUDIT", AUDIT_DURABLE, subjects.AUDIT_ALL,
                             AuditIngest(store, dead, detector.on_events, Fault(cfg.fault), detector.store_alerts),
                             batch=cfg.batch, workers=cfg.workers, ack_wait_s=ack_wait_s, commit_s=commit_s,
                             commit_bytes=int(cfg.commit_mb * 1024 * 1024), watermark=stored,
                             on_poison=lambda m, err: dead.put("CORRAL_AUDIT", m, m.data, "unprocessable", err))
        events = PullConsumer(self.js, "CORRAL_EVENTS", EVENTS_DURABLE, subjects.EVENTS_ALL,
                              EventIngest(store, dead, detector.on_lifecycle), batch=cfg.batch, workers=1,
                              ack_wait_s=ack_wait_s, commit_s=commit_s,
                              on_poison=lambda m, err: dead.put("CORRAL_EVENTS", m, m.data, "unprocessable", err))
        await audit.setup()
        await events.setup()
        evaluator = Evaluator(store, detector, alerts, stored, audit.stored_floor, self.ready)
        await self.responder.serve(subjects.MONITOR_EVALUATE, tenancy.for_operator(evaluator.handle, "evaluating rollouts"),
                                   "evaluate", queue=QUEUE)
        self.ready.set()
        gc.freeze()  # what start-up allocated (modules, rules, ClickHouse client) is never collected
        metrics.UP.labels("monitor").set(1)
        await bus.ready(self.nc, log, "monitor ready", metrics=self.metrics_url, clickhouse=_safe_dsn(cfg.clickhouse),
                workers=cfg.workers, rules=[r.name for r in detector.rules] + [r.name for r in detector.sql_rules],
                throttle_restored=restored)
        consume_stop = asyncio.Event()
        runners = [asyncio.create_task(audit.run(consume_stop)), asyncio.create_task(events.run(consume_stop)),
                   asyncio.create_task(detector.sql_loop(consume_stop))]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *runners], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopper and t.exception() is not None:
                log.error("a monitor loop died", exc_info=t.exception())
        # stop fetching, let the batches in flight finish (and ack), then go
        consume_stop.set()
        await asyncio.wait(runners, timeout=15)
        for t in runners:
            t.cancel()
        stopper.cancel()
        await self.responder.drain(timeout=5)
        await audit.close()
        await events.close()
        try:
            await self.nc.drain()
        except Exception:  # shutting down: a connection already closed has nothing to drain
            pass
        await asyncio.to_thread(store.close)
        metrics.UP.labels("monitor").set(0)
        logs.kv(log, logging.INFO, "monitor stopped")

    async def _on_rules(self, msg: Msg) -> RulesReply:
        return RulesReply(rules=rulereg.describe())


def min_ack_wait(commit_s: float) -> float:
    """A message waits up to `commit_s` for its commit, then for the insert itself (seconds on a
    loaded node): JetStream must not redeliver it meanwhile."""
    return 4 * commit_s + 3.0


def _safe_dsn(dsn: str) -> str:
    """The DSN without a password, for logs."""
    if "@" in dsn and "://" in dsn:
        scheme, rest = dsn.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return dsn
