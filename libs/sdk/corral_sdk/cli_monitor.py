"""CLI for the monitor: `corral alerts tail|ls`, `corral report --job J`, `corral monitor ...`.

`corral report` reads ClickHouse through the monitor's read-only `corral.v1.monitor.query`
(embedded mode), or directly with `--clickhouse http://user:pass@host:8123` (a server), prints
tables with rich and writes `report.json` and `report.png` (matplotlib) into `--out`."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from corral_common import auth, config, extras
from corral_common.contract import subjects
from corral_common.contract.audit import QueryReply, QueryRequest
from corral_common.contract.envelope import decode_reply
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import encoder

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client as ClickHouseClient
    from nats.aio.client import Client as NATS

QUERY_SUBJECT = subjects.MONITOR_QUERY
alerts_app = typer.Typer(no_args_is_help=True, help="follow and list the monitor's alerts")
console = Console(stderr=True)
out = Console()
SEV_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}


def register(app: typer.Typer, passthrough: dict[str, Any] | None = None) -> None:
    """Add `alerts`, `report` and `monitor` to the main `corral` app."""
    app.add_typer(alerts_app, name="alerts")
    app.command("report")(report)
    app.command("monitor", context_settings=passthrough or {"allow_extra_args": True, "ignore_unknown_options": True,
                                                             "help_option_names": []})(monitor)


def monitor(ctx: typer.Context) -> None:
    """Run the monitor (`corral monitor --help` for its options)."""
    os.execv(sys.executable, [sys.executable, "-m", "corral_monitor", *ctx.args])


# ----------------------------------------------------------------------------- helpers


def sql_str(v: str) -> str:
    """A ClickHouse string literal."""
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def parse_since(s: str | None) -> float | None:
    """`90s`, `30m`, `24h`, `7d` or a unix time -> unix time."""
    if not s:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", s)
    if not m:
        raise typer.BadParameter(f"--since {s!r}: use 90s, 30m, 24h, 7d or a unix time")
    v, unit = float(m.group(1)), m.group(2)
    if not unit and v > 1e9:
        return v
    return time.time() - v * {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 1}[unit]


class Querier:
    """Runs read-only SQL through the monitor (bus) or a ClickHouse server (clickhouse-connect)."""

    def __init__(self, nats_url: str | None = None, clickhouse: str | None = None):
        self.nats_url = config.nats_url(nats_url)
        self.clickhouse = clickhouse
        self._nc: NATS | None = None
        self._ch: ClickHouseClient | None = None

    async def __aenter__(self) -> Querier:
        if self.clickhouse:
            clickhouse_connect = extras.require("clickhouse_connect", "services", "querying ClickHouse directly (--clickhouse)")
            self._ch = await asyncio.to_thread(clickhouse_connect.get_client, dsn=self.clickhouse)
        else:
            import nats

            try:
                self._nc = await nats.connect(auth.servers(self.nats_url), connect_timeout=5, max_reconnect_attempts=1,
                                             **auth.connect_options(self.nats_url))
            except Exception as e:
                raise CorralError(f"cannot connect to NATS at {self.nats_url}: {e}") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()
        if self._ch is not None:
            self._ch.close()

    async def query(self, sql: str, timeout: float = 30.0) -> tuple[list[str], list[list[Any]]]:
        if self._ch is not None:
            res = await asyncio.to_thread(self._ch.query, sql, settings={"readonly": 1})
            rows = [[v.timestamp() if hasattr(v, "timestamp") else v for v in row] for row in res.result_rows]
            return list(res.column_names), rows
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        assert self._nc is not None
        try:
            msg = await self._nc.request(QUERY_SUBJECT, encoder.encode(QueryRequest(sql=sql, timeout_s=min(60, timeout))), timeout=timeout + 5)
        except NoRespondersError:
            raise CorralError(f"no monitor answers {QUERY_SUBJECT}: is the corral stack (with its monitor) running?") from None
        except NatsTimeout:
            raise CorralError(f"the monitor did not answer within {timeout + 5:g}s") from None
        r = decode_reply(msg.data, QueryReply)
        return r.columns, r.rows

    async def records(self, sql: str) -> list[dict[str, Any]]:
        cols, rows = await self.query(sql)
        return [dict(zip(cols, row)) for row in rows]


def _fmt_ts(ts: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
    except (TypeError, ValueError):
        return str(ts)


# ----------------------------------------------------------------------------- alerts


@alerts_app.command("tail")
def alerts_tail(
    job: str = typer.Option(None, help="only this job"),
    severity: list[str] = typer.Option([], help="only these severities (repeatable)"),
    min_severity: str = typer.Option(None, help="this severity and above (info < low < medium < high < critical)"),
    rule: list[str] = typer.Option([], help="only these rules (repeatable)"),
    sandbox: str = typer.Option(None, help="only this sandbox"),
    since: str = typer.Option(None, help="replay alerts from this long ago first (e.g. 10m, 24h)"),
    count: int = typer.Option(0, help="exit after this many alerts (0: follow until Ctrl-C)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """Follow alerts as they are raised."""
    import msgspec

    from .client import AsyncClient

    async def run() -> int:
        c = await AsyncClient.connect(config.nats_url(None))
        n = 0
        try:
            sub = c.alerts.subscribe(job=job, severity=severity or None, rule=rule or None, sandbox=sandbox,
                                     since=parse_since(since), min_severity=min_severity)
            async with sub:
                if not as_json:
                    console.print(f"following alerts{' of job ' + job if job else ''} (Ctrl-C to stop)")
                async for a in sub:
                    if as_json:
                        print(msgspec.json.encode(a).decode(), flush=True)
                    else:
                        style = SEV_STYLE.get(a.severity, "")
                        out.print(f"{_fmt_ts(a.ts)} [{style}]{a.severity:<8}[/{style}] {a.rule:<26} {a.sandbox} "
                                  f"{'job=' + a.job + ' ' if a.job else ''}{a.message}", highlight=False, soft_wrap=True)
                    n += 1
                    if count and n >= count:
                        break
        finally:
            await c.close()
        return 0

    try:
        raise typer.Exit(asyncio.run(run()))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except CorralError as e:
        console.print(f"[red]{e.code.value}[/red]: {e.message}")
        raise typer.Exit(1) from None


@alerts_app.command("ls")
def alerts_ls(
    job: str = typer.Option(None), rule: str = typer.Option(None), limit: int = typer.Option(50),
    since: str = typer.Option(None, help="e.g. 1h, 7d"), clickhouse: str = typer.Option(None, help="query this ClickHouse server directly"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List stored alerts, newest first."""
    where = ["1"]
    if job is not None:
        where.append(f"job = {sql_str(job)}")
    if rule is not None:
        where.append(f"rule = {sql_str(rule)}")
    if (since_ts := parse_since(since)) is not None:
        where.append(f"ts >= toDateTime64({since_ts:.3f}, 3)")
    sql = (f"SELECT ts, severity, rule, sandbox, job, message FROM alerts FINAL WHERE {' AND '.join(where)} "
           f"ORDER BY ts DESC LIMIT {int(limit)}")

    async def run() -> list[dict[str, Any]]:
        async with Querier(clickhouse=clickhouse) as q:
            return await q.records(sql)

    try:
        recs = asyncio.run(run())
    except CorralError as e:
        console.print(f"[red]{e.code.value}[/red]: {e.message}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(recs))
        return
    t = Table("time", "severity", "rule", "sandbox", "job", "message")
    for r in recs:
        style = SEV_STYLE.get(r["severity"], "")
        t.add_row(_fmt_ts(r["ts"]), f"[{style}]{r['severity']}[/{style}]", r["rule"], r["sandbox"], r["job"], r["message"][:120])
    out.print(t)


# ----------------------------------------------------------------------------- report


def report_queries(job: str, since: float | None = None) -> dict[str, str]:
    """The SQL behind `corral report` (also used by tests)."""
    j = sql_str(job)
    ts = f" AND ts >= toDateTime64({since:.3f}, 3)" if since else ""
    return {
        "summary": f"""
            SELECT
              (SELECT uniqExact(sandbox) FROM sandbox_events FINAL WHERE job = {j}{ts}) AS sandboxes_seen,
              (SELECT countIf(kind = 'created') FROM sandbox_events FINAL WHERE job = {j}{ts}) AS sandboxes_created,
              count() AS execs,
              uniqExact(sandbox) AS sandboxes_with_execs,
              countIf(exit_code != 0) AS failed,
              countIf(timed_out) AS timed_out,
              countIf(oom_killed) AS oom_killed,
              round(avg(duration_ms), 3) AS mean_ms,
              round(quantile(0.5)(duration_ms), 3) AS p50_ms,
              round(quantile(0.95)(duration_ms), 3) AS p95_ms,
              toFloat64(min(ts)) AS first_ts,
              toFloat64(max(ts)) AS last_ts,
              (SELECT count() FROM alerts FINAL WHERE job = {j}{ts}) AS alerts
            FROM exec_log FINAL WHERE job = {j}{ts}""",
        "alerts_by_rule": f"""
            SELECT rule, any(severity) AS severity, count() AS alerts, uniqExact(sandbox) AS sandboxes,
                   toFloat64(min(event_ts)) AS first_ts, toFloat64(max(event_ts)) AS last_ts
            FROM alerts FINAL WHERE job = {j}{ts} GROUP BY rule ORDER BY alerts DESC, rule""",
        "top_sandboxes": f"""
            SELECT sandbox, count() AS alerts, groupUniqArray(rule) AS rules, any(node) AS node
            FROM alerts FINAL WHERE job = {j}{ts} GROUP BY sandbox ORDER BY alerts DESC, sandbox LIMIT 15""",
        "recent_alerts": f"""
            SELECT toFloat64(ts) AS ts, severity, rule, sandbox, message
            FROM alerts FINAL WHERE job = {j}{ts} ORDER BY ts DESC LIMIT 20""",
        "exec_series": f"""
            SELECT toFloat64(toStartOfInterval(ts, INTERVAL {{bucket}} SECOND)) AS t, count() AS execs,
                   countIf(exit_code != 0) AS failed, round(quantile(0.5)(duration_ms), 3) AS p50_ms
            FROM exec_log FINAL WHERE job = {j}{ts} GROUP BY t ORDER BY t""",
        "alert_series": f"""
            SELECT toFloat64(toStartOfInterval(event_ts, INTERVAL {{bucket}} SECOND)) AS t, rule, count() AS alerts
            FROM alerts FINAL WHERE job = {j}{ts} GROUP BY t, rule ORDER BY t, rule""",
        "top_commands": f"""
            SELECT replaceRegexpAll(substring(cmd, 1, 60), '\\\\s+', ' ') AS command, count() AS n,
                   round(avg(duration_ms), 2) AS mean_ms, countIf(exit_code != 0) AS failed
            FROM exec_log FINAL WHERE job = {j}{ts} GROUP BY command ORDER BY n DESC LIMIT 10""",
    }


async def build_report(q: Querier, job: str, since: float | None = None) -> dict[str, Any]:
    qs = report_queries(job, since)
    data: dict[str, Any] = {"job": job, "generated_at": time.time()}
    summary = await q.records(qs["summary"])
    data["summary"] = summary[0] if summary else {}
    s = data["summary"]
    span = max(1.0, float(s.get("last_ts") or 0) - float(s.get("first_ts") or 0)) if s.get("execs") else 60.0
    bucket = max(1, int(span / 60))
    data["bucket_s"] = bucket
    for k in ("alerts_by_rule", "top_sandboxes", "recent_alerts", "top_commands"):
        data[k] = await q.records(qs[k])
    data["exec_series"] = await q.records(qs["exec_series"].replace("{bucket}", str(bucket)))
    data["alert_series"] = await q.records(qs["alert_series"].replace("{bucket}", str(bucket)))
    return data


def plot_report(data: dict[str, Any], path: str) -> None:
    matplotlib = extras.require("matplotlib", "bench", "the report's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    t0 = min([r["t"] for r in data["exec_series"]] + [r["t"] for r in data["alert_series"]] or [0])
    b = data.get("bucket_s", 1)
    xs = [r["t"] - t0 for r in data["exec_series"]]
    ax1.bar(xs, [r["execs"] / b for r in data["exec_series"]], width=b * 0.9, align="edge", label="execs/s", color="#4c72b0")
    ax1.bar(xs, [r["failed"] / b for r in data["exec_series"]], width=b * 0.9, align="edge", label="failed/s", color="#dd8452")
    ax1.set_ylabel("execs per second")
    ax1.legend(loc="upper right")
    ax1.set_title(f"corral report: job {data['job']!r}  ({data['summary'].get('execs', 0)} execs, "
                  f"{data['summary'].get('alerts', 0)} alerts)")
    rules = sorted({r["rule"] for r in data["alert_series"]})
    bottom: dict[float, float] = {}
    for i, rule in enumerate(rules):
        pts = [r for r in data["alert_series"] if r["rule"] == rule]
        x = [p["t"] - t0 for p in pts]
        y = [p["alerts"] for p in pts]
        ax2.bar(x, y, width=b * 0.9, align="edge", bottom=[bottom.get(v, 0) for v in x], label=rule, color=plt.cm.tab20(i % 20))
        for v, h in zip(x, y):
            bottom[v] = bottom.get(v, 0) + h
    if not rules:
        ax2.text(0.5, 0.5, "no alerts", transform=ax2.transAxes, ha="center", va="center", color="green")
    ax2.set_ylabel(f"alerts per {b}s")
    ax2.set_xlabel("seconds since the job's first activity")
    if rules:
        ax2.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(data: dict[str, Any]) -> None:
    s = data["summary"]
    t = Table(title=f"job {data['job']}", show_header=False)
    for k in ("sandboxes_created", "sandboxes_with_execs", "execs", "failed", "timed_out", "oom_killed", "mean_ms", "p50_ms",
              "p95_ms", "alerts"):
        if k in s:
            t.add_row(k, str(s[k]))
    if s.get("execs"):
        t.add_row("first exec", _fmt_ts(s["first_ts"]))
        t.add_row("last exec", _fmt_ts(s["last_ts"]))
    out.print(t)
    t = Table("rule", "severity", "alerts", "sandboxes", title="alerts by rule")
    for r in data["alerts_by_rule"]:
        style = SEV_STYLE.get(r["severity"], "")
        t.add_row(r["rule"], f"[{style}]{r['severity']}[/{style}]", str(r["alerts"]), str(r["sandboxes"]))
    out.print(t)
    t = Table("sandbox", "alerts", "rules", "node", title="sandboxes with the most alerts")
    for r in data["top_sandboxes"]:
        t.add_row(r["sandbox"], str(r["alerts"]), ", ".join(sorted(r["rules"])), r["node"])
    out.print(t)
    t = Table("time", "severity", "rule", "sandbox", "message", title="latest alerts")
    for r in data["recent_alerts"]:
        style = SEV_STYLE.get(r["severity"], "")
        t.add_row(_fmt_ts(r["ts"]), f"[{style}]{r['severity']}[/{style}]", r["rule"], r["sandbox"], r["message"][:100])
    out.print(t)
    t = Table("command", "runs", "mean ms", "failed", title="most frequent commands")
    for r in data["top_commands"]:
        t.add_row(r["command"], str(r["n"]), str(r["mean_ms"]), str(r["failed"]))
    out.print(t)


def report(
    job: str = typer.Option(..., help="the job to report on"),
    out_dir: str = typer.Option(None, "--out", help="write report.json and report.png here (default ./corral-report-<job>)"),
    since: str = typer.Option(None, help="only the last 30m, 24h, 7d, ..."),
    clickhouse: str = typer.Option(None, help="query this ClickHouse server directly instead of the monitor"),
    plot: bool = typer.Option(True, help="write report.png"),
) -> None:
    """Summarise a job from ClickHouse: execs, failures, alerts by rule and sandbox; tables and a PNG plot."""

    async def run() -> dict[str, Any]:
        async with Querier(clickhouse=clickhouse) as q:
            return await build_report(q, job, parse_since(since))

    try:
        data = asyncio.run(run())
    except CorralError as e:
        console.print(f"[red]{e.code.value}[/red]: {e.message}")
        raise typer.Exit(1) from None
    print_report(data)
    d = out_dir or f"corral-report-{re.sub(r'[^A-Za-z0-9_.-]', '_', job) or 'job'}"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "report.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    if plot:
        plot_report(data, os.path.join(d, "report.png"))
    console.print(f"wrote {d}/report.json" + (f" and {d}/report.png" if plot else ""))
