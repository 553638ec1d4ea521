"""Windowed: a sandbox that deletes, renames or rewrites very many files within a minute (seen by
file events), whatever command did it. Scratch space (/tmp, /var/tmp, /dev/shm) and caches are
not counted: a browser's profile churns hundreds of files there in a minute of honest use."""
from __future__ import annotations

from . import register_sql
from .base import SqlRule


@register_sql
class MassFileRewrite(SqlRule):
    name = "mass_file_rewrite"
    severity = "high"
    description = ("at least 200 existing files deleted, renamed or rewritten by one sandbox within 60 s (file events; "
                   "files it created in the window, caches and scratch space do not count)")
    window_s = 60.0
    every_s = 5.0
    threshold = 200
    sql = """
        SELECT sandbox, any(job) AS job, any(node) AS node, count() AS n, min(ts) AS first_ts, max(ts) AS last_ts,
               groupArray(5)(id) AS sample_ids
        FROM audit_events
        WHERE kind = 'file' AND op IN ('unlink', 'rename', 'write', 'truncate')
          AND ts >= now64(3) - INTERVAL {window_s} SECOND {scope}
          AND NOT match(path, '/__pycache__/|[.]py[co]$|/[.]pytest_cache/|^/(tmp|var/tmp|dev/shm)/|^/root/[.]cache/')
          AND (sandbox, path) NOT IN (
              SELECT sandbox, path FROM audit_events
              WHERE kind = 'file' AND op = 'create' AND ts >= now64(3) - INTERVAL {window_s} SECOND {scope})
        GROUP BY sandbox
        HAVING uniqExact(path) >= {threshold}
    """

    def message(self, n: int, window_s: float) -> str:
        return f"{n} file deletions/renames/rewrites within {window_s:g}s"
