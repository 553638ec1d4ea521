"""`python -m corral_monitor`: run the monitor (the CLI's `corral monitor` execs this).

    python -m corral_monitor --nats nats://127.0.0.1:4222 --clickhouse chdb:///var/lib/corral/monitor.db --metrics-port 9103
    python -m corral_monitor --clickhouse http://corral:secret@clickhouse:8123
"""
from __future__ import annotations

import gc
import os

import typer

from corral_common import config, logs
from corral_common.lifecycle import run_until_signalled

from .service import Monitor, MonitorConfig

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    clickhouse: str = typer.Option(None, help="ClickHouse DSN: chdb:///path (embedded, default chdb://<state-dir>/monitor.db) "
                                              "or http://user:pass@host:8123 (default $CORRAL_CLICKHOUSE)"),
    state_dir: str = typer.Option(None, help="state directory (default $CORRAL_STATE_DIR or /var/lib/corral)"),
    database: str = typer.Option(config.env_str("CORRAL_CLICKHOUSE_DATABASE", "default")),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    workers: int = typer.Option(1, min=1, max=64, help="concurrent fetch/insert loops on the audit stream"),
    batch: int = typer.Option(256, min=1, max=10_000, help="messages per fetch"),
    ack_wait_s: float = typer.Option(30.0, help="redeliver a batch not acked within this time (e.g. after a crash); "
                                                "at least 4 x commit interval + 3 s"),
    commit_ms: float = typer.Option(1000.0, min=0, help="store what was fetched into ClickHouse (and ack it) once per this many ms "
                                                        "per worker; rules and alerts do not wait for it (0: every fetch)"),
    commit_mb: float = typer.Option(8.0, min=0.001, help="... or sooner, once this many MB of events are staged (smaller: a backlog "
                                                         "is stored in more, shorter inserts that overlap with fetching)"),
    alert_window_s: float = typer.Option(30.0, help="at most one alert per (rule, sandbox) per this many seconds"),
    window_every_s: float = typer.Option(0.0, min=0, help="run the window (SQL) rules over every sandbox this often "
                                                          "(0: each rule's own period, 5 s); evaluate runs them for one sandbox at once"),
    protected_path: list[str] = typer.Option([], help="paths protected in every sandbox (alert on any access)"),
    canary: list[str] = typer.Option([], help="decoy paths in every sandbox (alert on any read)"),
    ttl_days: int = typer.Option(0, help="retention of every table in days (0: 30 for events, 180 for alerts)"),
    rule: list[str] = typer.Option([], help="enable only these rules (default: all)"),
    fault: str = typer.Option(os.environ.get("CORRAL_MONITOR_FAULT", ""), hidden=True, help="fault injection for tests"),
    log_level: str = typer.Option("INFO"),
) -> None:
    logs.setup("monitor", log_level)
    # the hot path allocates many short-lived containers (events, verdicts): collect young objects
    # less often (a full collection of the caches at default thresholds costs ~30% of rule time)
    gc.set_threshold(50_000, 20, 100)
    dsn = clickhouse or os.environ.get("CORRAL_CLICKHOUSE") or f"chdb://{os.path.abspath(config.state_dir(state_dir))}/monitor.db"
    cfg = MonitorConfig(nats_url=config.nats_url(nats), clickhouse=dsn, database=database, metrics_host=metrics_host,
                        metrics_port=metrics_port, workers=workers, batch=batch, ack_wait_s=ack_wait_s, commit_ms=commit_ms, commit_mb=commit_mb,
                        alert_window_s=alert_window_s, window_every_s=window_every_s,
                        protected_paths=protected_path, canaries=canary, ttl_days=ttl_days, rules=rule, fault=fault)

    run_until_signalled(lambda stop: Monitor(cfg).run(stop))  # built inside the loop


if __name__ == "__main__":
    app()
