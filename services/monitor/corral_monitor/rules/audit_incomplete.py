"""Lost audit: a node-agent reports (`loss` events, detail `reason` and `count`) that events of a
sandbox never reached the stream (a full buffer, a publish that kept failing, a source that
stopped). Whatever the sandbox did in that gap was not seen by any rule, so its record cannot
clear it: a grader must not reward a rollout whose audit is incomplete."""
from __future__ import annotations

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule


@register
class AuditIncomplete(Rule):
    name = "audit_incomplete"
    severity = "high"
    description = "a node-agent reports audit events of the sandbox that never reached the monitor (kind loss)"
    kinds = frozenset({"loss"})

    def match(self, ev: AuditEvent) -> str | None:
        detail = ev.detail or {}
        reason = detail.get("reason") or "unknown reason"
        count = detail.get("count") or "?"
        return f"audit incomplete: {count} event(s) lost ({reason[:200]})"
