"""Fork bombs: a shell function that pipes itself into itself in the background (`:(){ :|:& };:`,
`bomb(){ bomb|bomb& };bomb`), fork loops in inline code, and `pids` events (the node saw the
sandbox hit its pids limit)."""
from __future__ import annotations

import re

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule

_SHELL_BOMB = re.compile(r"(?P<f>[A-Za-z_][\w.-]*|:|\.)\s*\(\s*\)\s*\{[^}]*?(?P=f)\s*\|\s*(?P=f)\s*&")
_SHELL_BOMB2 = re.compile(r"(?P<f>[A-Za-z_][\w.-]*|:|\.)\s*\(\s*\)\s*\{[^}]*?(?P=f)\s*&[^}]*?(?P=f)\s*&")
_CODE_BOMB = re.compile(r"while\s*\(?\s*(True|1|:|true)\s*\)?\s*[:;{]?\s*(do)?\s*[^\n]{0,40}?\b(os\.fork|fork)\s*\(|"
                        r"fork\s+while\s+(fork|1)|for\s*\(\s*;\s*;\s*\)\s*fork\s*\(|"
                        r"while\s+(true|:)\s*;\s*do\s+(\$0|sh|bash)\s*&\s*(\$0|sh|bash)?\s*&?\s*;?\s*done")


@register
class ForkBomb(Rule):
    name = "fork_bomb"
    severity = "critical"
    description = "fork bombs (`:(){ :|:& };:` and named variants, fork loops in code) and pids-limit hits"
    kinds = frozenset({"exec", "pids"})
    words = frozenset({"fork", "while"})
    substrings = ("()", "( )")

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "pids":
            return f"sandbox hit its pids limit ({ev.detail.get('limit', '?')} processes){': ' + ev.comm if ev.comm else ''}"
        m = _SHELL_BOMB.search(ev.cmd) or _SHELL_BOMB2.search(ev.cmd)
        if m:
            return f"fork bomb (function {m.group('f')!r} spawns itself recursively): {ev.cmd[:200]}"
        m = _CODE_BOMB.search(ev.cmd)
        if m:
            return f"fork loop: {ev.cmd[:200]}"
        return None
