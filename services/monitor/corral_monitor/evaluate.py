"""`corral.v1.monitor.evaluate`: one sandbox's verdict, now, for a grader.

    {"sandbox": "sb-1", "after_seq": 1234, "findings": [{"rule": "grader_tampering", "severity": "high", "message": "..."}]}
    -> {"alerts": [{"rule": "mass_file_rewrite", "severity": "high", "message": "..."}], "complete": true, "stored_seq": 1240}

Without it a grader waits for the durable consumer's ack floor and then a whole period of the
window rules (seconds) before it can trust the alerts table, and still races the periodic pass.
Here the monitor (1) waits until everything on CORRAL_AUDIT through `after_seq` is stored (its
own contiguous watermark, or the durable's ack floor when other replicas share the stream; the
stream rules ran on those events and their alerts were stored in the same commit), (2) runs the
window rules over this sandbox alone at once (the same code, throttle and alert ids as the
periodic pass, one run of a rule at a time, so the pass after it does not alert the same burst
again), (3) stores and publishes the caller's findings as alerts with ids derived from their
content (a retry records nothing new), and (4) answers every alert the sandbox has and how many
of its audit events a node reported lost.

The work runs in the request's own task (the Responder's), never in the consumer's loop; the
ClickHouse calls go through worker threads like every other query."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from corral_common import bus, metrics
from corral_common.contract.audit import AlertSummary, EvaluateReply, EvaluateRequest
from corral_common.contract.errors import Unavailable

from .alerts import AlertManager, finding_alert
from .detect import Detector
from .store import Store
from .watermark import Watermark

log = logging.getLogger("corral.monitor.evaluate")

EVALUATE_SECONDS = metrics.histogram("corral_monitor_evaluate_seconds", "Time to answer an evaluate request", ("complete",),
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
MAX_ALERTS = 500  # alerts in one reply (distinct rule, severity, message, paths; oldest first)
FLOOR_POLL_S = 0.2  # how often the durable's ack floor is asked while this process's own mark lags

ALERTS_SQL = """
    SELECT rule, severity, message, paths FROM alerts FINAL
    WHERE sandbox = {sandbox:String}
    ORDER BY event_ts, id
    LIMIT 1 BY rule, severity, message, paths
    LIMIT %d
""" % MAX_ALERTS
# `loss` events say how many events never reached the stream; FINAL: a re-inserted row counts once
LOST_SQL = """
    SELECT sum(toUInt64OrZero(detail['count'])) FROM audit_events FINAL
    WHERE kind = 'loss' AND sandbox = {sandbox:String}
"""


class Evaluator:
    def __init__(self, store: Store, detector: Detector, alerts: AlertManager, watermark: Watermark,
                 ack_floor: Callable[[], Awaitable[int]], ready: asyncio.Event):
        self.store = store
        self.detector = detector
        self.alerts = alerts
        self.watermark = watermark
        self.ack_floor = ack_floor
        self.ready = ready
        # findings are checked against the table and then stored: one sandbox's at a time, so
        # two identical requests at once do not both find them new
        self.locks: dict[str, asyncio.Lock] = {}

    async def handle(self, msg: Msg) -> EvaluateReply:
        req = bus.decode(msg.data, EvaluateRequest)
        if not self.ready.is_set():
            raise Unavailable("the monitor is starting; retry")
        t0 = time.perf_counter()
        complete, stored = await self.wait_stored(req.after_seq, req.wait_s)
        await self.detector.run_sql_rules_for(req.sandbox)
        await self.record(req)
        alerts, lost = await asyncio.to_thread(self._answer, req.sandbox)
        EVALUATE_SECONDS.labels("true" if complete else "false").observe(time.perf_counter() - t0)
        return EvaluateReply(alerts=alerts, complete=complete, stored_seq=stored, lost=lost)

    async def wait_stored(self, seq: int, wait_s: float) -> tuple[bool, int]:
        """Wait until every audit message through stream sequence `seq` is stored (at most
        `wait_s`): (whether it is, how far it is). This process's watermark moves on its own
        commits; the durable's ack floor, asked every FLOOR_POLL_S while waiting, covers
        messages other replicas stored."""
        wm = self.watermark
        if seq <= wm.through:
            return True, wm.through
        deadline = time.monotonic() + wait_s
        while True:
            try:
                wm.raise_to(await asyncio.wait_for(self.ack_floor(), max(0.1, deadline - time.monotonic())))
            except Exception as e:  # JetStream busy or reconnecting: the local mark still counts
                log.debug("ack floor unavailable", extra={"fields": {"error": repr(e)}})
            left = deadline - time.monotonic()
            if seq <= wm.through or left <= 0:
                return seq <= wm.through, wm.through
            if await wm.wait(seq, min(FLOOR_POLL_S, left)):
                return True, wm.through

    async def record(self, req: EvaluateRequest) -> None:
        """Store and publish the request's findings as alerts of the sandbox, each once."""
        if not req.findings:
            return
        alerts = list({a.id: a for a in (finding_alert(f, req.sandbox, req.node, req.job) for f in req.findings)}.values())
        if len(self.locks) > 10_000:  # forget the locks of sandboxes nobody is evaluating
            self.locks = {k: v for k, v in self.locks.items() if v.locked()}
        async with self.locks.setdefault(req.sandbox, asyncio.Lock()):
            await self.alerts.emit(alerts, maybe_seen=True)

    def _answer(self, sandbox: str) -> tuple[list[AlertSummary], int]:
        params = {"sandbox": sandbox}
        res = self.store.query(ALERTS_SQL, max_rows=MAX_ALERTS, readonly=False, parameters=params)
        alerts = [AlertSummary(rule=str(r[0]), severity=str(r[1]), message=str(r[2]), paths=[str(p) for p in (r[3] or [])])
                  for r in res.rows]
        lost = self.store.scalar(LOST_SQL, parameters=params)
        return alerts, int(lost or 0)
