"""Memory bombs: an exec killed by the OOM killer (the node marks it `detail.oom_killed == "1"`)
and `oom` events."""
from __future__ import annotations

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule


@register
class MemoryBomb(Rule):
    name = "memory_bomb"
    severity = "high"
    description = "a command killed by the out-of-memory killer (exec with oom_killed, or an oom event)"
    kinds = frozenset({"exec", "oom"})

    def gate(self, ev: AuditEvent, words: frozenset[str]) -> bool:
        return ev.detail.get("oom_killed") == "1"

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "oom":
            return f"out of memory: {ev.comm or 'a process'} {ev.pid or ''} killed".replace("  ", " ")
        if ev.detail.get("oom_killed") == "1":
            return f"command exhausted the sandbox's memory and was OOM-killed: {ev.cmd[:200]}"
        return None
