"""Windowed: a sandbox whose processes keep hitting the seccomp wall (many denied syscalls within
a minute): systematic probing rather than one unlucky library call."""
from __future__ import annotations

from . import register_sql
from .base import SqlRule


@register_sql
class DenialBurst(SqlRule):
    name = "denial_burst"
    severity = "high"
    description = "at least 20 denied syscalls in one sandbox within 60 s"
    window_s = 60.0
    every_s = 5.0
    threshold = 20
    sql = """
        SELECT sandbox, any(job) AS job, any(node) AS node, count() AS n, min(ts) AS first_ts, max(ts) AS last_ts,
               groupArray(5)(id) AS sample_ids
        FROM audit_events
        WHERE kind = 'syscall' AND denied AND ts >= now64(3) - INTERVAL {window_s} SECOND {scope}
        GROUP BY sandbox
        HAVING n >= {threshold}
    """

    def message(self, n: int, window_s: float) -> str:
        return f"{n} denied syscalls within {window_s:g}s"
