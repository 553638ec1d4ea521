"""Audit events (node-agent → monitor) and alerts (monitor → users), the schema both sides share.

Audit events are published in batches on `corral.audit.<node>.<sandbox>` (stream CORRAL_AUDIT);
each event carries a globally unique `id`, which the monitor uses to insert exactly once."""
from __future__ import annotations

import secrets
import time
from typing import Literal

from msgspec import Struct

AuditKind = Literal["exec", "file", "syscall", "net", "signal", "oom", "pids", "lifecycle", "canary", "error"]
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


def event_id() -> str:
    """Sortable-ish unique id: milliseconds then 64 random bits."""
    return f"{int(time.time() * 1000):013x}{secrets.token_hex(8)}"
