"""Fault injection for the monitor's crash tests (`--fault`)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("corral.monitor.consumer")


class Fault:
    """Fault injection for tests: `crash-after-insert:N` exits (like kill -9) right after the N-th
    audit insert, before anything is acked."""

    def __init__(self, spec: str = ""):
        self.kind, _, n = spec.partition(":")
        self.n = int(n) if n else 0
        self.count = 0

    def hit(self, kind: str) -> None:
        if self.kind == kind:
            self.count += 1
            if self.count >= self.n:
                log.warning("fault injection: exiting", extra={"fields": {"fault": kind, "after": self.count}})
                logging.shutdown()
                os._exit(137)
