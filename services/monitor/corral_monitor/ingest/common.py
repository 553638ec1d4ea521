"""What the audit and lifecycle ingests share: the row and event counters, the range of a
plausible timestamp, and the ids stored lately (a publisher's duplicate is dropped without a query)."""
from __future__ import annotations

from corral_common import metrics

ROWS = metrics.counter("corral_monitor_rows_inserted_total", "Rows inserted into ClickHouse", ("table",))
EVENTS = metrics.counter("corral_monitor_events_ingested_total", "Events ingested (new, stored)", ("stream",))
DUPLICATES = metrics.counter("corral_monitor_duplicates_total", "Events dropped as already stored", ("stream",))
INSERT_SECONDS = metrics.histogram("corral_monitor_insert_seconds", "ClickHouse insert time", ("table",),
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
LAG = metrics.gauge("corral_monitor_lag_seconds", "Age of the newest event in the last batch when it was stored", ("stream",))

MIN_TS, MAX_TS = 946_684_800.0, 4_102_444_800.0  # 2000-01-01 .. 2100-01-01


class RecentIds:
    """Ids stored by this process lately (two generations, bounded): catches a publisher's duplicate
    (the same event in two messages) without a query."""

    def __init__(self, size: int = 500_000):
        self.size = size
        self.cur: set[str] = set()
        self.old: set[str] = set()

    def __contains__(self, k: str) -> bool:
        return k in self.cur or k in self.old

    def add_all(self, ks: list[str]) -> None:
        self.cur.update(ks)
        if len(self.cur) > self.size:
            self.old, self.cur = self.cur, set()
