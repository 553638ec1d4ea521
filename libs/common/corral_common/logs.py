"""Structured logging: one JSON object per line on stderr, with the service and node attached."""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, static: dict[str, Any]):
        super().__init__()
        self.service = service
        self.static = static

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            **self.static,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(service: str, level: str = "INFO", **static: Any) -> logging.Logger:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter(service, static))
    root.addHandler(h)
    root.setLevel(level.upper())
    logging.getLogger("nats").setLevel("WARNING")
    return logging.getLogger(service)


def kv(log: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log `msg` with structured fields (they become top-level JSON keys)."""
    log.log(level, msg, extra={"fields": fields})


def now() -> float:
    return time.time()
