"""ClickHouse, through clickhouse-connect only: `chdb:///path` runs the real engine in this process
(the embedded default), `http://user:pass@host:8123` talks to a server.

Tables (created idempotently, MergeTree family, partitioned by day or month, with a TTL):
  audit_events    every audit event, all kinds            ReplacingMergeTree  ORDER BY (kind, sandbox, ts, id)
  exec_log        exec events, flattened for dashboards   ReplacingMergeTree  ORDER BY (job, sandbox, ts, id)
                  (filled by the materialized view exec_log_mv on every insert into audit_events)
  sandbox_events  lifecycle events from CORRAL_EVENTS     ReplacingMergeTree  ORDER BY (sandbox, ts, id)
  alerts          alerts the monitor raised               ReplacingMergeTree  ORDER BY (rule, sandbox, event_ts, id)

Exactly-once: every row has a unique `id` and every column of the sorting key is a deterministic
function of the event, so a row inserted twice (a crash between insert and JetStream ack) is
collapsed by ReplacingMergeTree (`FINAL` in queries). The consumer also checks redelivered ids
against the table before inserting, so duplicates do not even reach the table.

Rows go in as JSONEachRow encoded by msgspec (fast: ~100k rows in ~0.15 s embedded)."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

import msgspec

DEFAULT_TTL_DAYS = {"audit_events": 30, "exec_log": 30, "sandbox_events": 90, "alerts": 180}

def _table(name: str, columns: str, order_by: str, time_col: str = "ts", partition: str = "toYYYYMMDD") -> str:
    """The DDL every corral table shares around its own columns: a unique `id` and the event time
    `ts` first, `ingested_at` last, ReplacingMergeTree ordered by deterministic columns then time
    and id (what makes a re-inserted row collapse), partitioned and expired by `time_col`.
    `{db}` and `{ttl}` are filled in at creation."""
    return f"""
        CREATE TABLE IF NOT EXISTS {{db}}.{name} (
            id String,
            ts DateTime64(3, 'UTC'),
            {columns.strip()},
            ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
        ) ENGINE = ReplacingMergeTree
        PARTITION BY {partition}({time_col})
        ORDER BY ({order_by}, {time_col}, id)
        TTL toDateTime({time_col}) + INTERVAL {{ttl}} DAY
    """


SCHEMA: dict[str, str] = {
    "audit_events": _table("audit_events", """
            node LowCardinality(String), sandbox String, kind LowCardinality(String), job String DEFAULT '',
            labels Map(String, String), cmd String DEFAULT '', cwd String DEFAULT '', session String DEFAULT '',
            exit_code Nullable(Int32), duration_ms Float64 DEFAULT 0, stdout_bytes UInt64 DEFAULT 0,
            stderr_bytes UInt64 DEFAULT 0, timed_out Bool DEFAULT false, op LowCardinality(String) DEFAULT '',
            path String DEFAULT '', pid Int64 DEFAULT 0, comm String DEFAULT '', syscall LowCardinality(String) DEFAULT '',
            denied Bool DEFAULT false, target String DEFAULT '', detail Map(String, String)""",
                           order_by="kind, sandbox"),
    "exec_log": _table("exec_log", """
            node LowCardinality(String), sandbox String, job String, cmd String, cwd String, session String,
            exit_code Int32, duration_ms Float64, stdout_bytes UInt64, stderr_bytes UInt64, timed_out Bool,
            oom_killed Bool, labels Map(String, String)""",
                       order_by="job, sandbox"),
    "sandbox_events": _table("sandbox_events", """
            kind LowCardinality(String), sandbox String, node LowCardinality(String), job String, reason String,
            image String, substrate LowCardinality(String), state LowCardinality(String), cpu Float64,
            memory_mb UInt32, labels Map(String, String), subject String, detail String""",
                             order_by="sandbox"),
    "alerts": _table("alerts", """
            event_ts DateTime64(3, 'UTC'), rule LowCardinality(String), severity LowCardinality(String),
            sandbox String, node LowCardinality(String), job String, message String, evidence_ids Array(String),
            evidence String, paths Array(String) DEFAULT []""",
                     order_by="rule, sandbox", time_col="event_ts", partition="toYYYYMM"),
}
TABLES = tuple(SCHEMA)

# columns added after a table was first released: `CREATE TABLE IF NOT EXISTS` leaves an existing
# table as it is, so each is added here (idempotent) to tables made by an older monitor
MIGRATIONS: tuple[str, ...] = (
    "ALTER TABLE {db}.alerts ADD COLUMN IF NOT EXISTS paths Array(String) DEFAULT [] AFTER evidence",
)

# exec_log is filled by ClickHouse itself from every insert into audit_events (no second encode
# and insert from Python); the consumer inserts into exec_log directly only to repair rows missing
# after a crash (see consumer.AuditIngest)
VIEWS: dict[str, str] = {
    "exec_log_mv": """
        CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.exec_log_mv TO {db}.exec_log AS
        SELECT id, ts, node, sandbox, job, cmd, cwd, session, ifNull(exit_code, -1) AS exit_code, duration_ms,
               stdout_bytes, stderr_bytes, timed_out, detail['oom_killed'] = '1' AS oom_killed, labels
        FROM {db}.audit_events WHERE kind = 'exec'
    """,
}


INSERT_SETTINGS = {
    "input_format_skip_unknown_fields": 1,
    "date_time_input_format": "best_effort",
    # the part is on disk when the call returns (chdb defaults to async inserts, whose buffer a
    # crash right after "success" could lose, and the consumer acks right after this)
    "async_insert": 0,
    # ids are deduplicated by the consumer; skipping the Replacing merge of each block at insert
    # time makes inserts ~1.5x faster (FINAL still collapses any duplicate)
    "optimize_on_insert": 0,
}


class ExecRow(msgspec.Struct, kw_only=True):
    id: str
    ts: float
    node: str
    sandbox: str
    job: str
    cmd: str
    cwd: str
    session: str
    exit_code: int
    duration_ms: float
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool
    oom_killed: bool
    labels: dict[str, str]


class SandboxEventRow(msgspec.Struct, kw_only=True):
    id: str
    ts: float
    kind: str
    sandbox: str
    node: str
    job: str
    reason: str
    image: str
    substrate: str
    state: str
    cpu: float
    memory_mb: int
    labels: dict[str, str]
    subject: str
    detail: str


class AlertRow(msgspec.Struct, kw_only=True):
    id: str
    ts: float
    event_ts: float
    rule: str
    severity: str
    sandbox: str
    node: str
    job: str
    message: str
    evidence_ids: list[str]
    evidence: str
    paths: list[str] = []


class QueryResult(msgspec.Struct):
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]
    truncated: bool = False


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, (ipaddress.IPv4Address, ipaddress.IPv6Address, uuid.UUID)):
        return str(obj)
    if isinstance(obj, Decimal):
        return float(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


def json_value(v: Any) -> Any:
    """A query cell as something JSON can carry: datetimes become epoch seconds (UTC)."""
    if isinstance(v, dt.datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=dt.timezone.utc)
        return round(v.timestamp(), 6)
    if isinstance(v, dt.date):
        return v.isoformat()
    return v


class Store:
    def __init__(self, dsn: str, database: str = "default", ttl_days: dict[str, int] | None = None):
        self.dsn = dsn
        self.database = database
        self.ttl_days = {**DEFAULT_TTL_DAYS, **(ttl_days or {})}
        self.client: Any = None
        self.embedded = dsn.startswith("chdb:")
        self._lock = threading.Lock()  # clickhouse-connect's HTTP client is not meant for concurrent use

    # ------------------------------------------------------------------ set-up

    def connect(self) -> None:
        import clickhouse_connect

        if self.embedded:
            path = self.dsn[len("chdb://"):]
            if path and path not in (":memory:",):
                os.makedirs(os.path.dirname(path.rstrip("/")) or "/", exist_ok=True)
        self.client = clickhouse_connect.get_client(dsn=self.dsn)
        if self.database != "default":
            self.client.command(f"CREATE DATABASE IF NOT EXISTS {self.database}")

    def ensure_schema(self) -> None:
        for table, ddl in SCHEMA.items():
            self.command(ddl.format(db=self.database, ttl=int(self.ttl_days[table])))
        for ddl in MIGRATIONS:
            self.command(ddl.format(db=self.database))
        for ddl in VIEWS.values():
            self.command(ddl.format(db=self.database))

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # shutting down: nothing is left to do with a client that fails to close
                pass
            self.client = None

    # ------------------------------------------------------------------ writes

    def command(self, sql: str) -> Any:
        with self._lock:
            return self.client.command(sql)

    def insert(self, table: str, rows: Sequence[msgspec.Struct]) -> int:
        """Insert Structs as JSONEachRow (field names are column names; omitted fields take the
        column default). Returns the number of rows."""
        if not rows:
            return 0
        block = _encoder.encode_lines(rows)
        with self._lock:
            self.client.raw_insert(f"{self.database}.{table}", None, insert_block=block, fmt="JSONEachRow", settings=INSERT_SETTINGS)
        return len(rows)

    def existing_ids(self, table: str, ids: Iterable[str]) -> set[str]:
        """Which of `ids` are already in `table` (used for redelivered messages only)."""
        ids = list(dict.fromkeys(ids))
        found: set[str] = set()
        for i in range(0, len(ids), 5000):
            chunk = ids[i : i + 5000]
            with self._lock:
                r = self.client.query(f"SELECT id FROM {self.database}.{table} WHERE id IN {{ids:Array(String)}}",
                                      parameters={"ids": chunk})
            found.update(row[0] for row in r.result_rows)
        return found

    # ------------------------------------------------------------------ reads

    def query(self, sql: str, max_rows: int = 10_000, timeout_s: float = 10.0, readonly: bool = True,
              parameters: dict[str, Any] | None = None) -> QueryResult:
        """Run a SELECT. With `readonly`, ClickHouse itself refuses writes, DDL, settings changes
        and table functions (file(), url(), remote()...), whatever the SQL says."""
        settings: dict[str, Any] = {"max_execution_time": max(1, int(timeout_s))}
        if readonly:
            settings["readonly"] = 1  # last: after it, no other setting may change
        with self._lock:
            r = self.client.query(sql, settings=settings, parameters=parameters)
        rows = r.result_rows
        truncated = len(rows) > max_rows
        rows = rows[:max_rows]
        out = [[json_value(v) for v in row] for row in rows]
        types = [t.name for t in r.column_types] if getattr(r, "column_types", None) else []
        return QueryResult(columns=list(r.column_names), types=types, rows=out, truncated=truncated)

    def scalar(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        with self._lock:
            r = self.client.query(sql, parameters=parameters)
        return r.result_rows[0][0] if r.result_rows else None


def wait_connect(dsn: str, database: str = "default", timeout_s: float = 60.0, **kw: Any) -> Store:
    """Connect, retrying while a ClickHouse server is still starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        store = Store(dsn, database, **kw)
        try:
            store.connect()
            store.ensure_schema()
            return store
        except Exception:
            store.close()
            if store.embedded or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
