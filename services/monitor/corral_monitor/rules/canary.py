"""Decoy files: a sandbox may carry planted canaries (e.g. a leftover answers.json). Nothing
legitimate reads them, so any read is critical: node `canary` events, file events flagged
`detail.canary == "1"`, and exec commands naming a canary path from the label `corral.canaries`."""
from __future__ import annotations

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, commands, path_words, under
from .shell import abspath


@register
class CanaryRead(Rule):
    name = "canary_read"
    severity = "critical"
    description = "any read of a planted decoy (canary) file"
    kinds = frozenset({"canary", "file", "exec"})
    contextual = True

    def gate(self, ev: AuditEvent, words: frozenset[str]) -> bool:
        return self.ctx.has_canaries(ev)

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "canary":
            return f"canary {ev.path or ev.target or '?'} touched ({ev.op or 'read'}) by {ev.comm or 'pid'} {ev.pid}"
        if ev.kind == "file":
            if ev.detail.get("canary") == "1":
                return f"canary {ev.path} touched ({ev.op or 'read'}) by {ev.comm or 'pid'} {ev.pid}"
            for c in self.ctx.canaries(ev):
                if under(ev.path, c):
                    return f"canary {ev.path} touched ({ev.op or 'read'}) by {ev.comm or 'pid'} {ev.pid}"
            return None
        canaries = self.ctx.canaries(ev)
        if not canaries:
            return None
        for s in commands(ev):
            for w in path_words(s):
                full = abspath(w, ev.cwd)
                for c in canaries:
                    if under(full, c) or c in w:
                        return f"command names canary {c}: {ev.cmd[:200]}"
        return None
