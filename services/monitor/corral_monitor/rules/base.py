"""What every detection rule is, and the helpers they share.

A stream rule is one small class: `name`, `severity`, `description`, the audit `kinds` it looks at,
and `match(event) -> str | None` (the alert message, or None). `words`/`substrings` (or `gate()`)
are a cheap gate on exec commands that only skips work on the hot path: `match` alone is correct.

A window rule (`SqlRule`) is a query over the last `window_s` seconds of ClickHouse data, run every
`every_s` seconds; each row it returns is one (sandbox, message) alert."""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

from corral_common.contract import labels
from corral_common.contract.audit import AuditEvent, Severity

from . import shell
from .shell import Simple

# labels a SandboxSpec can carry to tell the monitor about the sandbox's secrets
LABEL_PROTECTED = labels.PROTECTED_PATHS
LABEL_CANARIES = labels.CANARIES

# hidden tests, answer keys and reference solutions, wherever a task harness leaves them
SECRET_PATH = re.compile(
    r"(?i)(hidden[_-]?tests?|(^|/)\.hidden(/|$)|(^|/)answers?([_-]?key)?\.(json|txt|ya?ml|md|csv|py)$|answer[_-]?key"
    r"|reference[_-]?(solution|answer|impl)|(^|/)gold(en)?[_-]?(patch|solution|answers?)|(^|/)solution\.(patch|diff)$"
    r"|(^|/)\.?grader(s)?(/|$)|(^|/)\.answers?(/|$)|(^|/)(eval|grading)[_-]?(tests?|data)(/|$)|(^|/)\.?expected[_-]?answers?)"
)
TEST_PATH = re.compile(
    r"(^|/)(tests?|testing)(/|$)|(^|/)test_[^/]*\.py$|[^/]_tests?\.py$|(^|/)conftest\.py$|(^|/)pytest\.ini$"
    r"|(^|/)(_pytest|pytest)(/|\.py$)|(^|/)bin/(pytest|py\.test)$|(^|/)unittest(/|$)"
)
SITE_PATH = re.compile(
    r"(site|dist)-packages(/|$)|/usr/(local/)?lib/python[\d.]*(/|$)|(^|/)(sitecustomize|usercustomize)\.py$|\.pth$"
)
# file events that change a file (node-agent audit/files.py ops); close_write is not one (opened for writing,
# perhaps unchanged), nor are caches Python writes by itself when it imports or runs tests
FILE_WRITE_OPS = frozenset({"write", "create", "unlink", "rename", "truncate", "chmod", "link", "open_write", "rmdir"})
CACHE_PATH = re.compile(r"/__pycache__/|\.py[co]$|(^|/)\.pytest_cache(/|$)|(^|/)\.mypy_cache(/|$)|(^|/)\.ruff_cache(/|$)")


def file_change(ev: AuditEvent, pattern: re.Pattern[str]) -> bool:
    """A file event that changes a path matching `pattern`, caches excluded. A rename counts for
    its source too (moving a test file away is tampering with it)."""
    if ev.op not in FILE_WRITE_OPS:
        return False
    paths = [ev.path, ev.detail.get("from", "")] if ev.op == "rename" else [ev.path]
    return any(p and pattern.search(p) and not CACHE_PATH.search(p) for p in paths)


NULL_SINKS = {"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "-"}
_PY = re.compile(r"^(python[\d.]*|pypy[\d.]*)$")
_PY_WRITE = re.compile(
    r"""open\(\s*(?:r|f)?['"]([^'"]+)['"]\s*,\s*['"][^'"]*[wax+]|Path\(\s*['"]([^'"]+)['"]\s*\)\s*\.\s*(?:write_text|write_bytes|unlink|rename|touch)"""
    r"""|os\.(?:remove|unlink|rmdir|rename|replace|truncate)\(\s*['"]([^'"]+)['"]|shutil\.(?:rmtree|move)\(\s*['"]([^'"]+)['"]"""
    r"""|shutil\.copy\w*\([^,]+,\s*['"]([^'"]+)['"]"""
)


class RuleContext:
    """What rules know beyond the event: protected paths and canaries per sandbox (from the
    sandbox's labels, lifecycle events, or the monitor's configuration)."""

    def __init__(self, protected: Iterable[str] = (), canaries: Iterable[str] = ()):
        self.protected_global = [p.rstrip("/") or "/" for p in protected]
        self.canaries_global = list(canaries)
        self.protected_by_sandbox: dict[str, list[str]] = {}
        self.canaries_by_sandbox: dict[str, list[str]] = {}

    @staticmethod
    def _split(value: str) -> list[str]:
        return [p.strip().rstrip("/") or "/" for p in re.split(r"[,:\n]", value) if p.strip()]

    def learn(self, sandbox: str, protected: Iterable[str] = (), canaries: Iterable[str] = ()) -> None:
        if protected:
            self.protected_by_sandbox[sandbox] = sorted(set(self.protected_by_sandbox.get(sandbox, [])) | set(protected))
        if canaries:
            self.canaries_by_sandbox[sandbox] = sorted(set(self.canaries_by_sandbox.get(sandbox, [])) | set(canaries))

    def forget(self, sandbox: str) -> None:
        self.protected_by_sandbox.pop(sandbox, None)
        self.canaries_by_sandbox.pop(sandbox, None)

    def has_protected(self, ev: AuditEvent) -> bool:
        return bool(self.protected_global) or ev.sandbox in self.protected_by_sandbox or LABEL_PROTECTED in ev.labels

    def has_canaries(self, ev: AuditEvent) -> bool:
        return bool(self.canaries_global) or ev.sandbox in self.canaries_by_sandbox or LABEL_CANARIES in ev.labels

    def has_context(self, ev: AuditEvent) -> bool:
        return self.has_protected(ev) or self.has_canaries(ev)

    def protected(self, ev: AuditEvent) -> list[str]:
        out = list(self.protected_global)
        out += self.protected_by_sandbox.get(ev.sandbox, ())
        if ev.labels and LABEL_PROTECTED in ev.labels:
            out += self._split(ev.labels[LABEL_PROTECTED])
        return out

    def canaries(self, ev: AuditEvent) -> list[str]:
        out = list(self.canaries_global)
        out += self.canaries_by_sandbox.get(ev.sandbox, ())
        if ev.labels and LABEL_CANARIES in ev.labels:
            out += self._split(ev.labels[LABEL_CANARIES])
        return out


# how a command is cut into words for the cheap gate: everything but letters and digits separates
# words, so `/usr/bin/curl -o x` gives {"usr", "bin", "curl", "o", "x"} and `tests/test_a.py`
# gives {"tests", "test", "a", "py"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+")


def words_of(cmd: str) -> frozenset[str]:
    return frozenset(_WORD_SPLIT.split(cmd))


class Rule:
    """A stream rule. `words` and `substrings` form a cheap gate for exec events (the rule only
    looks at commands containing one of those words or substrings; both empty: every command);
    `gate(ev)` can replace it. `match` must be correct on its own: the gate only saves time."""

    name: ClassVar[str]
    severity: ClassVar[Severity]
    description: ClassVar[str]
    kinds: ClassVar[frozenset[str]] = frozenset({"exec"})
    words: ClassVar[frozenset[str]] = frozenset()
    substrings: ClassVar[tuple[str, ...]] = ()
    contextual: ClassVar[bool] = False  # depends on more than the command (sandbox context, labels)

    def __init__(self, ctx: RuleContext | None = None):
        self.ctx = ctx or RuleContext()

    def gate(self, ev: AuditEvent, words: frozenset[str]) -> bool:
        if not self.words and not self.substrings:
            return True
        if self.words and not self.words.isdisjoint(words):
            return True
        cmd = ev.cmd
        return any(x in cmd for x in self.substrings)

    def applies(self, ev: AuditEvent, words: frozenset[str] | None = None) -> bool:
        """Cheap test before `match` (the kind, and the gate for exec events)."""
        if ev.kind not in self.kinds:
            return False
        if ev.kind == "exec":
            return self.gate(ev, words if words is not None else words_of(ev.cmd))
        return True

    def match(self, ev: AuditEvent) -> str | None:
        raise NotImplementedError


# what `{scope}` becomes in a window rule's SQL when it is run for one sandbox (`evaluate`); the
# sandbox id is a query parameter, never spliced into the text
SANDBOX_SCOPE = "AND sandbox = {sandbox:String}"


class SqlRule:
    """A windowed rule evaluated in ClickHouse. `sql` must return the columns
    sandbox, job, node, n, first_ts, last_ts, sample_ids (Array(String)); `{window_s}` and
    `{threshold}` are substituted, and `{scope}` (in every WHERE that reads audit_events) becomes
    nothing for the periodic pass over all sandboxes, or a filter on the parameter `sandbox` when
    the rule is run for one sandbox on request (so that pass reads only that sandbox's rows)."""

    name: ClassVar[str]
    severity: ClassVar[Severity]
    description: ClassVar[str]
    window_s: ClassVar[float] = 60.0
    every_s: ClassVar[float] = 5.0
    threshold: ClassVar[int] = 100
    sql: ClassVar[str]

    def query(self, one_sandbox: bool = False) -> str:
        """The SQL; with `one_sandbox`, restricted to the sandbox passed as parameter `sandbox`."""
        return self.sql.format(window_s=int(self.window_s), threshold=int(self.threshold),
                               scope=SANDBOX_SCOPE if one_sandbox else "")

    def message(self, n: int, window_s: float) -> str:
        raise NotImplementedError


# ----------------------------------------------------------------------------- helpers for rules


def commands(ev: AuditEvent) -> tuple[Simple, ...]:
    return shell.parse(ev.cmd) if ev.cmd else ()


def _clean(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if p and p not in NULL_SINKS and not p.startswith("&") and not p.startswith("/dev/fd/")]


def write_targets(s: Simple) -> list[str]:
    """Files a simple command creates, modifies or removes (as far as its argv tells)."""
    out = list(s.writes)
    p, a = s.prog, s.args
    if p == "tee":
        out += shell.positionals(a)
    elif p in ("sed", "gsed") and any(x == "-i" or x.startswith("-i") or x.startswith("--in-place") or
                                      (x.startswith("-") and not x.startswith("--") and "i" in x[1:]) for x in a):
        pos = shell.positionals(a, {"-e", "-f", "--expression", "--file", "-l"})
        has_script = any(x in ("-e", "-f", "--expression", "--file") or x.startswith("--expression=") for x in a)
        out += pos if has_script else pos[1:]
    elif p == "perl" and any(x.startswith("-") and "i" in x[1:] and not x.startswith("--") for x in a):
        out += shell.positionals(a, {"-e", "-E", "-M", "-I"})
    elif p in ("cp", "install", "ln", "rsync"):
        pos = shell.positionals(a, {"-t", "--target-directory", "-m", "--mode", "-o", "-g", "-S", "--suffix"})
        tdir = [a[k + 1] for k, x in enumerate(a[:-1]) if x in ("-t", "--target-directory")]
        out += tdir or pos[-1:] if len(pos) >= 2 or tdir else []
    elif p in ("mv", "rm", "unlink", "shred", "touch", "chmod", "chown", "chattr", "rmdir", "truncate", "patch"):
        pos = shell.positionals(a, {"-s", "--size", "-r", "--reference", "-n", "-u", "-m", "-i", "-o", "-p", "-d"}
                                if p in ("truncate", "patch", "touch") else frozenset())
        if p in ("chmod", "chown", "chattr") and pos:
            pos = pos[1:]
        out += pos
    elif p == "dd":
        out += [x[3:] for x in a if x.startswith("of=")]
    elif p == "git" and len(a) >= 1:
        sub = [x for x in a if not x.startswith("-")]
        if sub and sub[0] in ("rm", "mv"):
            out += sub[1:]
    elif p in ("vi", "vim", "nvim", "nano", "ed", "ex", "emacs") :
        out += shell.positionals(a, {"-c", "-s"})
    elif _PY.match(p) or p in ("perl", "ruby", "node"):
        code = shell.inline_code(s)
        if code:
            for m in _PY_WRITE.finditer(code):
                out += [g for g in m.groups() if g]
    return _clean(out)


def delete_targets(s: Simple) -> list[str]:
    p, a = s.prog, s.args
    if p in ("rm", "unlink", "shred", "rmdir"):
        return _clean(shell.positionals(a))
    if p == "mv":
        return _clean(shell.positionals(a)[:-1])
    if p == "git" and a:
        sub = [x for x in a if not x.startswith("-")]
        if sub and sub[0] == "rm":
            return _clean(sub[1:])
    return []


def path_words(s: Simple) -> list[str]:
    """Every argument that could name a file (plus redirections), for "does it touch X" rules."""
    out = [x for x in s.argv[1:] if x and not x.startswith("-")]
    out += [x.split("=", 1)[1] for x in s.argv[1:] if x.startswith("-") and "=" in x]
    out += list(s.writes) + list(s.reads)
    return out


def under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/") or prefix == "/"


LOOPBACK = re.compile(r"^(localhost|localhost\.localdomain|ip6-localhost|127(\.\d{1,3}){0,3}|0\.0\.0\.0|0|::1?|\[::1?\]|"
                      r"0:0:0:0:0:0:0:[01])$", re.I)


def host_of(target: str) -> str:
    """Host part of a URL, `host:port`, `user@host:path`, `[v6]:port` or bare host."""
    t = target.strip().strip("'\"")
    m = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://(?:[^@/]*@)?(\[[^\]]+\]|[^/:?#]*)", t)
    if m:
        return m.group(1).strip("[]")
    m = re.match(r"^\[([^\]]+)\](?::\d+)?$", t)
    if m:
        return m.group(1)
    if t.count(":") >= 2 and re.match(r"^[0-9a-fA-F:]+$", t):  # bare IPv6
        return t
    t = t.split("@", 1)[-1]
    return t.split(":", 1)[0].split("/", 1)[0]


def is_loopback(host: str) -> bool:
    return bool(LOOPBACK.match(host.strip().strip("[]")))


def looks_like_host(word: str) -> bool:
    w = word.strip()
    if not w or w.startswith("-") or w.startswith("/") or w.startswith("."):
        return False
    h = host_of(w)
    return bool(re.match(r"^(\d{1,3}(\.\d{1,3}){3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+|([A-Za-z0-9-]+\.)+[A-Za-z]{2,}|localhost)$", h))
