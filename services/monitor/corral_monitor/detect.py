"""Evaluates the rule registry: stream rules on every ingested event (before the batch is acked),
window rules (`SqlRule`) periodically in ClickHouse."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

import msgspec

from corral_common import metrics
from corral_common.contract import labels
from corral_common.contract.audit import Alert, AuditEvent

from .alerts import AlertManager, alert_id
from .rules import Rule, RuleContext, SqlRule
from .rules.base import words_of
from .store import SandboxEventRow, Store

log = logging.getLogger("corral.monitor.detect")

RULE_ERRORS = metrics.counter("corral_monitor_rule_errors_total", "Rule evaluations that raised (the event is kept)", ("rule",))
RULE_SECONDS = metrics.histogram("corral_monitor_rules_seconds", "Time to evaluate the stream rules on one batch",
                                 buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1))
WINDOW_RUNS = metrics.counter("corral_monitor_window_runs_total", "Window (SQL) rule runs: over every sandbox (periodic) "
                              "or over one sandbox (evaluate)", ("rule", "scope"))
CACHE = metrics.counter("corral_monitor_rule_cache_total", "Exec verdicts served from the per-command cache", ("result",))
CACHE_SIZE = 100_000
EVIDENCE_COLUMNS = ("id", "ts", "node", "sandbox", "kind", "job", "cmd", "cwd", "op", "path", "pid", "comm", "syscall", "denied", "target")


class Detector:
    def __init__(self, rules: list[Rule], sql_rules: list[SqlRule], alerts: AlertManager, store: Store, ctx: RuleContext,
                 every_s: float = 0.0):
        self.rules = rules
        # the periodic pass runs each window rule this often (0: the rule's own `every_s`)
        self.every_s = every_s
        self.sql_rules = sql_rules
        self.alerts = alerts
        self.store = store
        self.ctx = ctx
        self.by_kind: dict[str, list[Rule]] = defaultdict(list)
        for r in rules:
            for k in r.kinds:
                self.by_kind[k].append(r)
        # the first periodic pass one period after start (the window looks back far further)
        self.sql_due: dict[str, float] = {r.name: time.monotonic() + (every_s or r.every_s) for r in sql_rules}
        # one run of a window rule at a time (the periodic pass, or one sandbox's on request): a
        # run sees the alerts of the one before stored, and their throttle state, so the same
        # burst is not alerted twice and an evaluate never misses an alert still being stored
        self.sql_locks: dict[str, asyncio.Lock] = {r.name: asyncio.Lock() for r in sql_rules}
        self.cache: dict[tuple[str, str, str], list[tuple[Rule, str]]] = {}
        self._build_gates()

    def _build_gates(self) -> None:
        """Which exec rules' gates open for a command, computed once for all rules: a word index
        and a list of gate substrings."""
        execs = [r for r in self.rules if "exec" in r.kinds]
        self.exec_rules = execs
        self.custom_gate = [(i, r) for i, r in enumerate(execs) if type(r).gate is not Rule.gate]
        custom = {i for i, _ in self.custom_gate}
        self.always = frozenset(i for i, r in enumerate(execs) if i not in custom and not r.words and not r.substrings)
        by_word: dict[str, set[int]] = defaultdict(set)
        subs: dict[str, set[int]] = defaultdict(set)
        for i, r in enumerate(execs):
            if i in custom:
                continue
            for w in r.words:
                by_word[w].add(i)
            for x in r.substrings:
                subs[x].add(i)
        self.by_word = {w: tuple(v) for w, v in by_word.items()}
        self.word_keys = frozenset(self.by_word)
        # `x in cmd` per substring is faster than any regex alternation for these few literals
        self.sub_items = tuple((x, tuple(ids)) for x, ids in subs.items())

    def _candidates(self, ev: AuditEvent) -> list[Rule]:
        cmd = ev.cmd
        hit = set(self.always)
        ws = words_of(cmd)
        for w in self.word_keys & ws:
            hit.update(self.by_word[w])
        for x, ids in self.sub_items:
            if x in cmd:
                hit.update(ids)
        for i, r in self.custom_gate:
            if i not in hit and r.gate(ev, ws):
                hit.add(i)
        execs = self.exec_rules
        return [execs[i] for i in sorted(hit)]

    def _matches(self, ev: AuditEvent) -> list[tuple[Rule, str]]:
        out: list[tuple[Rule, str]] = []
        rules = self._candidates(ev) if ev.kind == "exec" else self.by_kind.get(ev.kind, ())
        for r in rules:
            try:
                msg = r.match(ev)
            except Exception:
                RULE_ERRORS.labels(r.name).inc()
                log.exception("rule raised", extra={"fields": {"rule": r.name, "event": ev.id}})
                continue
            if msg:
                out.append((r, msg))
        return out

    def evaluate(self, events: list[AuditEvent]) -> list[Alert]:
        out: list[Alert] = []
        t0 = time.perf_counter()
        cache = self.cache
        hits = misses = 0
        for ev in events:
            if ev.kind == "exec" and not self.ctx.has_context(ev):
                # the verdict depends only on the command (agents repeat themselves a lot)
                key = (ev.cmd, ev.cwd, ev.detail.get("oom_killed", "") if ev.detail else "")
                hit = cache.get(key)
                if hit is None:
                    hit = [(r, msg) for r, msg in self._matches(ev)]
                    if len(cache) >= CACHE_SIZE:
                        cache.clear()
                    cache[key] = hit
                    misses += 1
                else:
                    hits += 1
                matches = hit
            else:
                matches = self._matches(ev)
            for r, msg in matches:
                a = self.alerts.consider(r.name, r.severity, msg, [ev])
                if a is not None:
                    out.append(a)
        if hits:
            CACHE.labels("hit").inc(hits)
        if misses:
            CACHE.labels("miss").inc(misses)
        RULE_SECONDS.observe(time.perf_counter() - t0)
        return out

    async def on_events(self, events: list[AuditEvent], maybe_seen: bool) -> list[Alert]:
        """Run the rules and publish their alerts (before the events are inserted); returns
        what to store once they are (`store_alerts`)."""
        alerts = self.evaluate(events)
        if not alerts:
            return []
        return await self.alerts.publish(alerts, maybe_seen=maybe_seen)

    async def store_alerts(self, alerts: list[Alert]) -> None:
        await self.alerts.store_alerts(alerts)

    def on_lifecycle(self, rows: list[SandboxEventRow], events: list[Any]) -> None:
        """Learn each sandbox's protected paths and canaries when its lifecycle events carry them
        (`detail.protected_paths` / `detail.canaries`, or the labels of `info`)."""
        for row, ev in zip(rows, events):
            if not row.sandbox:
                continue
            detail = getattr(ev, "detail", {}) or {}
            prot = _as_list(detail.get("protected_paths")) + _split(row.labels.get(labels.PROTECTED_PATHS, ""))
            can = _as_list(detail.get("canaries")) + _split(row.labels.get(labels.CANARIES, ""))
            if prot or can:
                self.ctx.learn(row.sandbox, prot, can)
        if len(self.ctx.protected_by_sandbox) > 100_000:
            for k in list(self.ctx.protected_by_sandbox)[:50_000]:
                self.ctx.forget(k)

    # ------------------------------------------------------------------ window rules

    async def sql_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            for r in self.sql_rules:
                if now < self.sql_due[r.name]:
                    continue
                self.sql_due[r.name] = now + (self.every_s or r.every_s)
                try:
                    await self.run_sql_rule(r)
                except Exception:
                    RULE_ERRORS.labels(r.name).inc()
                    log.exception("window rule failed", extra={"fields": {"rule": r.name}})
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    async def run_sql_rule(self, r: SqlRule, sandbox: str | None = None) -> list[Alert]:
        """Run one window rule over every sandbox (the periodic pass) or over `sandbox` alone (on
        request); publish and store its new alerts; returns them."""
        async with self.sql_locks.setdefault(r.name, asyncio.Lock()):
            return await self._run_sql_rule(r, sandbox)

    async def run_sql_rules_for(self, sandbox: str) -> list[Alert]:
        """Every window rule over one sandbox, now (not at the next periodic pass). A rule that
        fails is counted, logged and raised: an answer without it could clear a cheat."""
        out: list[Alert] = []
        for r in self.sql_rules:
            try:
                out += await self.run_sql_rule(r, sandbox)
            except Exception:
                RULE_ERRORS.labels(r.name).inc()
                log.exception("window rule failed", extra={"fields": {"rule": r.name, "sandbox": sandbox}})
                raise
        return out

    async def _run_sql_rule(self, r: SqlRule, sandbox: str | None) -> list[Alert]:
        params = {"sandbox": sandbox} if sandbox is not None else None
        WINDOW_RUNS.labels(r.name, "all" if sandbox is None else "sandbox").inc()
        res = await asyncio.to_thread(self.store.query, r.query(sandbox is not None), 10_000, 30.0, False, params)
        col = {c: i for i, c in enumerate(res.columns)}
        alerts: list[Alert] = []
        for row in res.rows:
            sandbox, n, first_ts = row[col["sandbox"]], int(row[col["n"]]), float(row[col["first_ts"]])
            ids = list(row[col["sample_ids"]]) if "sample_ids" in col else []
            evidence = await asyncio.to_thread(self._evidence, ids)
            # one alert per (rule, sandbox, window): the key is the window the burst started in
            bucket = int(first_ts // r.window_s)
            a = self.alerts.consider(r.name, r.severity, f"{r.message(n, r.window_s)} in sandbox {sandbox}", evidence,
                                     sandbox=sandbox, key=f"{sandbox}|{bucket}", event_ts=first_ts)
            if a is not None:
                a.job = a.job or row[col["job"]]
                a.node = a.node or row[col["node"]]
                alerts.append(a)
        if alerts:
            await self.alerts.emit(alerts, maybe_seen=True)
        return alerts

    def _evidence(self, ids: list[str]) -> list[AuditEvent]:
        if not ids:
            return []
        res = self.store.query(f"SELECT {', '.join(EVIDENCE_COLUMNS)} FROM audit_events WHERE id IN {{ids:Array(String)}} ORDER BY ts",
                               max_rows=20, readonly=False, parameters={"ids": ids})
        out = []
        for row in res.rows:
            d = dict(zip(res.columns, row))
            try:
                out.append(msgspec.convert({k: v for k, v in d.items() if v not in (None, "")}, AuditEvent))
            except msgspec.ValidationError:
                continue
        return out


def _as_list(v: Any) -> list[str]:
    if not v:
        return []
    if isinstance(v, str):
        return _split(v)
    if isinstance(v, list):
        return [str(x) for x in v if x]
    return []


def _split(v: str) -> list[str]:
    return [p.strip() for p in v.replace("\n", ",").replace(":", ",").split(",") if p.strip()]


__all__ = ["Detector", "alert_id"]
