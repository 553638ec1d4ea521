"""Audit events (node-agent → monitor) and alerts (monitor → users), the schema both sides share.

Audit events are published in batches on `corral.audit.<node>.<sandbox>` (stream CORRAL_AUDIT);
each event carries a globally unique `id`, which the monitor uses to insert exactly once."""
from __future__ import annotations

import os
import random
import time
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from .envelope import Reply
from .messages import Request

# loss: events of this sandbox that never reached the stream (detail: reason, count); the record is incomplete
# access: a tenant tried an operation on another tenant's sandbox (refused; detail: tenant, op)
AuditKind = Literal["exec", "file", "syscall", "net", "signal", "oom", "pids", "lifecycle", "canary", "error", "loss", "access"]
Severity = Literal["info", "low", "medium", "high", "critical"]


class AuditEvent(Struct, kw_only=True, omit_defaults=True):
    id: str
    ts: float
    node: str
    sandbox: str
    kind: AuditKind
    job: str = ""
    labels: dict[str, str] = {}
    # exec: the command as the agent sent it, where it ran and how it ended
    cmd: str = ""
    cwd: str = ""
    session: str = ""
    exit_code: int | None = None
    duration_ms: float = 0.0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    timed_out: bool = False
    # file / syscall / net / signal: what was touched, by which process
    op: str = ""  # open, read, write, create, unlink, rename, exec, connect, kill, ...
    path: str = ""
    pid: int = 0
    comm: str = ""
    syscall: str = ""
    denied: bool = False
    target: str = ""  # connect address, signalled pid, ...
    detail: dict[str, str] = {}


class AuditBatch(Struct, kw_only=True):
    events: list[AuditEvent]


class Alert(Struct, kw_only=True, omit_defaults=True):
    id: str
    ts: float
    rule: str
    severity: Severity
    sandbox: str
    node: str = ""
    job: str = ""
    message: str
    evidence: list[AuditEvent] = []
    paths: list[str] = []  # the files it is about (a grader's finding names them; else those of the evidence)


#: event ids' random bits: not secret, so a generator of our own (seeded from the OS, again in a
#: forked child; no library's seed() reaches it) rather than a getrandom(2) per event
_ID_BITS = random.Random()
os.register_at_fork(after_in_child=_ID_BITS.seed)


def event_id() -> str:
    """Sortable-ish unique id: milliseconds then 64 random bits."""
    return f"{int(time.time() * 1000):013x}{_ID_BITS.getrandbits(64):016x}"


class AlertSummary(Struct, kw_only=True, omit_defaults=True):
    rule: str
    severity: str
    message: str
    paths: list[str] = []


class Finding(Struct, kw_only=True, omit_defaults=True):
    """A verdict another service reached about a sandbox (the grader: tampering with the grading
    environment, module shadowing); the monitor stores and publishes it as an alert like its own."""

    rule: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]
    severity: Severity
    message: Annotated[str, Meta(max_length=4096)]
    paths: Annotated[list[str], Meta(max_length=256)] = []


class EvaluateRequest(Request, kw_only=True):
    """`corral.v1.monitor.evaluate`: wait until the monitor has stored this sandbox's audit events
    up to stream sequence `after_seq`, run the window rules for this sandbox at once, record
    `findings` as alerts, and answer every alert the sandbox has."""

    sandbox: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
    after_seq: Annotated[int, Meta(ge=0)] = 0
    node: Annotated[str, Meta(max_length=128)] = ""
    job: Annotated[str, Meta(max_length=128)] = ""
    findings: Annotated[list[Finding], Meta(max_length=64)] = []
    wait_s: Annotated[float, Meta(ge=0, le=120)] = 10.0


class EvaluateReply(Reply, kw_only=True):
    alerts: list[AlertSummary] = []
    complete: bool = True  # the events through after_seq were stored before the rules ran (False: wait_s ran out)
    stored_seq: int = 0  # how far (stream sequence) the monitor has stored contiguously
    lost: int = 0  # `loss` events recorded for this sandbox: audit that never arrived


# ----- corral.v1.monitor.* -----


class QueryRequest(Request, kw_only=True):
    sql: Annotated[str, Meta(min_length=1, max_length=100_000)]
    max_rows: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000
    timeout_s: Annotated[float, Meta(gt=0, le=60)] = 10.0


class QueryReply(Reply, kw_only=True):
    columns: list[str] = []
    types: list[str] = []  # ClickHouse type names, one per column
    rows: list[list[Any]] = []
    truncated: bool = False  # more rows than max_rows: the rest were left out
    elapsed_ms: float = 0.0


class RuleInfo(Struct, kw_only=True):
    name: str
    severity: str
    kind: Literal["stream", "window"]  # per event as it arrives, or a SQL query over a window
    description: str


class RulesReply(Reply, kw_only=True):
    rules: list[RuleInfo] = []
