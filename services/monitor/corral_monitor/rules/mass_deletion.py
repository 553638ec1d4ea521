"""Mass deletion: `rm -rf /`, `rm -rf /*`, recursive removal of system trees or the home directory,
`find / -delete`, unfiltered `find ... -delete` / `-exec rm`, or rm of very many paths at once.
Removing a build directory or a temporary file is fine. Bulk file churn seen by file events is
the windowed rule `mass_file_rewrite`."""
from __future__ import annotations

import re

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, commands
from .shell import abspath, flags, positionals

_SYSTEM = re.compile(r"^/(\*|bin|boot|dev|etc|home|lib\w*|opt|root|sbin|srv|usr|var|workspace|repo|app|src|mnt|\.corral)?/?\*?$")
_HOME = {"~", "~/", "~/*", "$HOME", "${HOME}", "$HOME/", "$HOME/*", "${HOME}/*"}
_FIND_FILTERS = {"-name", "-iname", "-path", "-ipath", "-regex", "-iregex", "-newer", "-mtime", "-mmin", "-atime", "-size",
                 "-user", "-perm", "-empty", "-wholename", "-lname", "-inum", "-links", "-ctime", "-cmin", "-amin"}
MANY = 200


@register
class MassDeletion(Rule):
    name = "mass_deletion"
    severity = "high"
    description = "rm -rf of / or system trees, find / -delete, unfiltered find -delete/-exec rm, rm of hundreds of paths"
    words = frozenset({"rm", "shred", "wipe", "srm", "delete"})

    def match(self, ev: AuditEvent) -> str | None:
        cwd = ev.cwd or "/"
        for s in commands(ev):
            p, a = s.prog, s.args
            if p in ("cd", "pushd") and a:
                cwd = abspath(a[0], cwd)
                continue
            if p in ("rm", "shred", "wipe", "srm"):
                f = flags(a)
                targets = positionals(a)
                recursive = bool({"r", "R", "--recursive"} & f) or p != "rm"
                if "--no-preserve-root" in f:
                    return f"rm --no-preserve-root: {ev.cmd[:200]}"
                if len(targets) >= MANY:
                    return f"{p} of {len(targets)} paths at once: {ev.cmd[:120]}..."
                if recursive:
                    for t in targets:
                        full = t if t in _HOME else abspath(t, cwd) + ("/*" if t.endswith("*") and not t.endswith("/*") else "")
                        if t in _HOME or _SYSTEM.match(full) or _SYSTEM.match(t) or (t in (".", "*", "./*", "./") and _SYSTEM.match(cwd)):
                            return f"recursive removal of {t} (from {cwd}): {ev.cmd[:200]}"
            if p == "find":
                roots = []
                for x in a:
                    if x.startswith("-") or x in ("(", "!", ")"):
                        break
                    roots.append(x)
                roots = roots or ["."]
                deleting = "-delete" in a or any(a[k] in ("-exec", "-execdir") and k + 1 < len(a) and a[k + 1] in ("rm", "/bin/rm", "shred")
                                                 for k in range(len(a)))
                if not deleting:
                    continue
                if any(x in _FIND_FILTERS for x in a):
                    continue  # `find . -name '*.pyc' -delete`: a selective clean-up
                return f"find {' '.join(roots)} deletes every file below it (no name/path/time filter): {ev.cmd[:200]}"
        return None
