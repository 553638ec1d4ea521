"""Expands the grafana-clickhouse-datasource macros the way the plugin does (pkg/macros), so the
dashboards' SQL can be run and tested outside Grafana (tests, `corral report`):

    $__timeFilter(col)     col >= toDateTime(FROM) AND col <= toDateTime(TO)
    $__timeFilter_ms(col)  same with fromUnixTimestamp64Milli
    $__dateFilter(col)     col >= toDate('YYYY-MM-DD') AND col <= toDate(...)
    $__timeInterval(col)   toStartOfInterval(toDateTime(col), INTERVAL N second)
    $__timeInterval_ms(col), $__interval_s, $__fromTime, $__toTime, $__fromTime_ms, $__toTime_ms
"""
from __future__ import annotations

import re
import time

_NAME = re.compile(r"\$__(timeFilter_ms|timeFilter|dateFilter|timeInterval_ms|timeInterval|interval_s|fromTime_ms|toTime_ms|fromTime|toTime)\b")


def _args(sql: str, start: int) -> tuple[list[str], int]:
    """Comma-separated arguments of the call whose '(' is at `start`; returns (args, index after ')')."""
    depth, i, cur, out = 0, start, [], []
    while i < len(sql):
        c = sql[i]
        if c == "(":
            depth += 1
            if depth > 1:
                cur.append(c)
        elif c == ")":
            depth -= 1
            if depth == 0:
                out.append("".join(cur).strip())
                return [a for a in out if a], i + 1
            cur.append(c)
        elif c == "," and depth == 1:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    raise ValueError(f"unbalanced parentheses in macro call at {start}")


def expand(sql: str, t_from: float, t_to: float, interval_s: float = 1.0) -> str:
    secs = max(int(interval_s), 1)
    ms = max(int(interval_s * 1000), 1)
    f, t = int(t_from), int(t_to)
    fms, tms = int(t_from * 1000), int(t_to * 1000)
    out, pos = [], 0
    for m in list(_NAME.finditer(sql)):
        if m.start() < pos:
            continue
        out.append(sql[pos:m.start()])
        name = m.group(1)
        end = m.end()
        args: list[str] = []
        if name in ("timeFilter", "timeFilter_ms", "dateFilter", "timeInterval", "timeInterval_ms"):
            j = end
            while j < len(sql) and sql[j] == " ":
                j += 1
            if j >= len(sql) or sql[j] != "(":
                raise ValueError(f"$__{name} needs an argument")
            args, end = _args(sql, j)
            if len(args) != 1:
                raise ValueError(f"$__{name} expects 1 argument, got {len(args)}")
        col = args[0] if args else ""
        if name == "timeFilter":
            rep = f"{col} >= toDateTime({f}) AND {col} <= toDateTime({t})"
        elif name == "timeFilter_ms":
            rep = f"{col} >= fromUnixTimestamp64Milli({fms}) AND {col} <= fromUnixTimestamp64Milli({tms})"
        elif name == "dateFilter":
            df, dt = time.strftime("%Y-%m-%d", time.gmtime(f)), time.strftime("%Y-%m-%d", time.gmtime(t))
            rep = f"{col} >= toDate('{df}') AND {col} <= toDate('{dt}')"
        elif name == "timeInterval":
            rep = f"toStartOfInterval(toDateTime({col}), INTERVAL {secs} second)"
        elif name == "timeInterval_ms":
            rep = f"toStartOfInterval(toDateTime64({col}, 3), INTERVAL {ms} millisecond)"
        elif name == "interval_s":
            rep = str(secs)
        elif name == "fromTime":
            rep = f"toDateTime({f})"
        elif name == "toTime":
            rep = f"toDateTime({t})"
        elif name == "fromTime_ms":
            rep = f"fromUnixTimestamp64Milli({fms})"
        else:
            rep = f"fromUnixTimestamp64Milli({tms})"
        out.append(rep)
        pos = end
    out.append(sql[pos:])
    return "".join(out)


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, rawSql) for every ClickHouse target of a dashboard JSON."""
    out = []
    for p in dashboard.get("panels", []):
        for sub in [p, *p.get("panels", [])]:
            for t in sub.get("targets", []) or []:
                if t.get("rawSql"):
                    out.append((sub.get("title", ""), t["rawSql"]))
    return out
