"""Read-only SQL on `corral.v1.monitor.query`: in the embedded mode only the monitor process holds
the ClickHouse engine, so `corral report`, the dashboards' SQL and tests ask it.

    {"sql": "SELECT rule, count() FROM alerts GROUP BY rule"}
    -> {"ok": true, "columns": ["rule", "count()"], "types": [...], "rows": [["fork_bomb", 3]], "truncated": false}

Only a single SELECT (or WITH ... SELECT) is accepted; anything else is `invalid_request`. The
statement then runs with ClickHouse's `readonly=1`, which also refuses table functions (file(),
url(), remote()) and settings changes, so the check here is a first line, not the only one."""
from __future__ import annotations

import asyncio
import re
import time

from nats.aio.msg import Msg

from corral_common import bus
from corral_common.contract.audit import QueryReply, QueryRequest
from corral_common.contract.errors import InvalidRequest, Timeout, Unavailable

from .store import Store

_FORBIDDEN = re.compile(r"\b(INTO\s+OUTFILE|INSERT|ALTER|DROP|TRUNCATE|CREATE|ATTACH|DETACH|RENAME|OPTIMIZE|GRANT|REVOKE|KILL"
                        r"|SYSTEM(?!\s*\.)|SET|USE|DELETE|UPDATE|EXCHANGE|UNDROP|BACKUP|RESTORE)\b", re.I)


def strip_sql(sql: str) -> str:
    """The statement without comments, string literals and quoted identifiers (replaced by
    placeholders), for the shape checks below. Raises on unterminated strings or comments."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if sql.startswith("--", i) or c == "#":
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
            out.append(" ")
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            if j < 0:
                raise InvalidRequest("unterminated /* comment in sql")
            i = j + 2
            out.append(" ")
        elif c in "'\"`":
            j = i + 1
            while j < n:
                if sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:  # doubled quote
                        j += 2
                        continue
                    break
                j += 1
            if j >= n:
                raise InvalidRequest("unterminated quoted string in sql")
            out.append(" 'S' " if c == "'" else " ident ")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def validate(sql: str) -> str:
    """Return the statement to run (trailing `;` removed) or raise `invalid_request`."""
    bare = strip_sql(sql).strip()
    while bare.endswith(";"):
        bare = bare[:-1].rstrip()
    if ";" in bare:
        raise InvalidRequest("only one statement is allowed")
    head = bare.lstrip("( \t\r\n")
    first = head.split(None, 1)[0].upper() if head else ""
    if first not in ("SELECT", "WITH"):
        raise InvalidRequest(f"only SELECT (or WITH ... SELECT) queries are allowed, not {first or 'an empty statement'!r}")
    m = _FORBIDDEN.search(bare)
    if m:
        raise InvalidRequest(f"{m.group(1).upper()} is not allowed in a read-only query")
    stmt = sql.strip()
    while stmt.endswith(";"):
        stmt = stmt[:-1].rstrip()
    return stmt


class QueryService:
    def __init__(self, store: Store, ready: asyncio.Event):
        self.store = store
        self.ready = ready

    async def handle(self, msg: Msg) -> QueryReply:
        req = bus.decode(msg.data, QueryRequest)
        stmt = validate(req.sql)
        if not self.ready.is_set():
            raise Unavailable("the monitor is still starting", retry_after_s=0.5)
        t0 = time.perf_counter()
        try:
            res = await asyncio.to_thread(self.store.query, stmt, req.max_rows, req.timeout_s)
        except Exception as e:
            text = str(e)
            if "TIMEOUT_EXCEEDED" in text or "Timeout exceeded" in text:
                raise Timeout(f"query ran longer than {req.timeout_s:g}s") from None
            # syntax errors, unknown tables/columns, readonly refusals: the caller's to fix
            raise InvalidRequest(f"query failed: {_short(text)}") from None
        return QueryReply(columns=res.columns, types=res.types, rows=res.rows, truncated=res.truncated,
                          elapsed_ms=round((time.perf_counter() - t0) * 1000, 3))


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text)
    m = re.search(r"(Code: \d+\. DB::Exception: .*?)(\(version|$)", text)
    return (m.group(1) if m else text)[:500].strip()

