"""A small, forgiving parser for the shell commands agents send, so rules look at argv instead of
raw strings.

`parse("cd /repo && git log --all | head > out.txt")` gives one `Simple` per simple command, with
its argv (wrappers such as `sudo`, `env`, `timeout`, `xargs` peeled off), the files it redirects
output to and input from, and the commands nested in `sh -c '...'`, `eval`, `$(...)` and backticks.
It never raises: unbalanced quotes fall back to a whitespace/operator split. Results are cached,
because agents repeat commands a lot."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

_OP_CHARS = set("();<>|&")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_SHELLS = {"sh", "bash", "dash", "ash", "zsh", "ksh", "mksh", "busybox-sh"}
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for", "in", "case", "esac",
             "{", "}", "!", "function", "select", "[[", "]]"}
# wrapper -> options that take a separate value
_WRAPPERS: dict[str, set[str]] = {
    "sudo": {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"},
    "doas": {"-u", "-C"},
    "env": {"-u", "-C", "-S", "--unset", "--chdir"},
    "nohup": set(),
    "nice": {"-n", "--adjustment"},
    "ionice": {"-c", "-n", "-p", "-t"},
    "timeout": {"-s", "-k", "--signal", "--kill-after"},
    "time": {"-f", "-o"},
    "command": set(),
    "builtin": set(),
    "exec": {"-a"},
    "stdbuf": {"-i", "-o", "-e"},
    "setsid": set(),
    "unbuffer": set(),
    "taskset": set(),
    "chrt": set(),
    "xargs": {"-I", "-n", "-P", "-L", "-s", "-d", "-E", "-a", "--max-args", "--max-procs", "--delimiter", "--arg-file"},
    "busybox": set(),
    "watch": {"-n", "-d", "--interval"},
    "strace": {"-o", "-e", "-s", "-p", "-u", "-E", "-a", "-b", "-I", "-O", "-S", "-X", "-P"},
    "ltrace": {"-o", "-e", "-s", "-p", "-u", "-a", "-n", "-l", "-x", "-L"},
}
# wrappers whose first positional is itself an argument, not the command
_POSITIONAL_FIRST = {"timeout": 1, "taskset": 1, "chrt": 1}


@dataclass(frozen=True, slots=True)
class Simple:
    """One simple command: `argv` after wrappers, output redirection targets, input sources."""

    argv: tuple[str, ...]
    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    assigns: tuple[str, ...] = ()  # NAME=value prefixes (and `export NAME=value`)
    heredoc: str = ""  # the body fed on stdin by `<<EOF`, if any

    @property
    def prog(self) -> str:
        return prog_name(self.argv[0]) if self.argv else ""

    @property
    def args(self) -> tuple[str, ...]:
        return self.argv[1:]


def prog_name(arg0: str) -> str:
    # /usr/bin/git -> git; `\rm` -> rm (python3.11 stays python3.11: rules match it with a regex)
    return arg0.rsplit("/", 1)[-1].strip().lstrip("\\")


@dataclass
class _Seg:
    words: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    heredoc: str = ""


def _strip_heredocs(cmd: str) -> tuple[str, list[str]]:
    """Remove here-document bodies (kept apart: they are data, not commands)."""
    if "<<" not in cmd:
        return cmd, []
    lines = cmd.split("\n")
    out: list[str] = []
    bodies: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        for m in _HEREDOC.finditer(line):
            if line[m.start():m.start() + 3] == "<<<":
                continue
            delim = m.group(2)
            body: list[str] = []
            while i < len(lines) and lines[i].strip() != delim:
                body.append(lines[i])
                i += 1
            i += 1  # the delimiter line
            bodies.append("\n".join(body))
    return "\n".join(out), bodies


def _newlines_to_separators(cmd: str) -> str:
    """Newlines and backticks outside quotes separate commands."""
    if "\n" not in cmd and "`" not in cmd:
        return cmd
    out = []
    quote = ""
    for ch in cmd:
        if quote:
            if ch == quote:
                quote = ""
            out.append(ch)
            continue
        if ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "\n" or ch == "`":
            out.append(" ; ")
        else:
            out.append(ch)
    return "".join(out)


# a word: unquoted characters, backslash escapes, '...' and "..." segments; or a run of operators
_TOKEN = re.compile(r"""((?:[^\s'"\\;&|()<>]|\\.|'[^']*'|"(?:[^"\\]|\\.)*")+)|([;&|()<>]+)""")
_SEGMENT = re.compile(r"""'([^']*)'|"((?:[^"\\]|\\.)*)"|\\(.)|([^'"\\]+)""")


def _unquote(word: str) -> str:
    if "'" not in word and '"' not in word and "\\" not in word:
        return word
    out = []
    for m in _SEGMENT.finditer(word):
        single, double, esc, plain = m.groups()
        if single is not None:
            out.append(single)
        elif double is not None:
            out.append(re.sub(r'\\([\\"$`])', r"\1", double))
        elif esc is not None:
            out.append(esc)
        else:
            out.append(plain or "")
    return "".join(out)


def _lex(cmd: str) -> list[tuple[str, bool]]:
    """(token, is_operator) pairs: shell words and operator runs (like shlex with
    punctuation_chars, much faster, and never raises: an unbalanced quote is dropped)."""
    return [(op, True) if op else (_unquote(w), False) for w, op in _TOKEN.findall(cmd)]


def _tokens(cmd: str) -> list[str]:
    return [t for t, _ in _lex(cmd)]


def _segments(cmd: str) -> list[_Seg]:
    cmd, bodies = _strip_heredocs(cmd)
    cmd = _newlines_to_separators(cmd)
    toks = _lex(cmd)
    segs: list[_Seg] = []
    cur = _Seg()
    i = 0
    n = len(toks)
    while i < n:
        t, is_op = toks[i]
        if not is_op:
            cur.words.append(t)
            i += 1
            continue
        nxt, nxt_op = toks[i + 1] if i + 1 < n else ("", True)
        if t in ("<<", "<<-"):  # heredoc: the next word is the delimiter
            if bodies:
                cur.heredoc = bodies.pop(0)
            i += 2
            continue
        if t == "<<<":  # here-string: the next word is data
            i += 2
            continue
        if ">" in t or "<" in t:
            # an fd number glued to the operator (`2>`) was split off as a word: drop it
            if cur.words and len(cur.words[-1]) == 1 and cur.words[-1].isdigit():
                cur.words.pop()
            if t.endswith("&") and (nxt.isdigit() or nxt == "-"):  # >&2, 2>&1, >&-
                i += 2
                continue
            if nxt and not nxt_op:
                (cur.writes if ">" in t else cur.reads).append(nxt)
                i += 2
            else:
                i += 1
            continue
        # control operator: ; & && || | ( ) and combinations like `|&`, `;;`, `()`
        segs.append(cur)
        cur = _Seg()
        i += 1
    segs.append(cur)
    return [s for s in segs if s.words or s.writes or s.reads]


def _unwrap(words: list[str]) -> tuple[list[str], list[str]]:
    """Peel leading assignments, shell keywords and wrappers (sudo, env, timeout, xargs, ...)."""
    assigns: list[str] = []
    w = list(words)
    changed = True
    while w and changed:
        changed = False
        while w and (w[0] in _KEYWORDS or _ASSIGN.match(w[0])):
            if _ASSIGN.match(w[0]):
                assigns.append(w[0])
            w.pop(0)
            changed = True
        if w and w[0] in ("export", "declare", "typeset", "local", "readonly"):
            assigns.extend(x for x in w[1:] if _ASSIGN.match(x))
            return [], assigns
        if not w:
            break
        name = prog_name(w[0])
        if name in ("strace", "ltrace") and not any(x in ("-p", "--attach") or x.startswith("-p") for x in w[1:]):
            # `strace CMD`: the traced command is what runs
            pass
        elif name in ("strace", "ltrace"):
            break
        if name in _WRAPPERS:
            takes = _WRAPPERS[name]
            j = 1
            while j < len(w):
                a = w[j]
                if a == "--":
                    j += 1
                    break
                if name == "env" and _ASSIGN.match(a):
                    assigns.append(a)
                    j += 1
                    continue
                if a.startswith("-") and len(a) > 1:
                    j += 2 if a in takes else 1
                    continue
                break
            j += _POSITIONAL_FIRST.get(name, 0)
            if j >= len(w):
                return [], assigns
            w = w[j:]
            changed = True
        elif name == "chroot" and len(w) > 2:
            w = w[2:]
            changed = True
    return w, assigns


@lru_cache(maxsize=65536)
def parse(cmd: str) -> tuple[Simple, ...]:
    """Every simple command in `cmd`, nested `sh -c`/`eval` strings included."""
    return tuple(_parse(cmd, 0))


def _parse(cmd: str, depth: int) -> list[Simple]:
    out: list[Simple] = []
    if depth > 4 or not cmd:
        return out
    for seg in _segments(cmd):
        argv, assigns = _unwrap(seg.words)
        out.append(Simple(tuple(argv), tuple(seg.writes), tuple(seg.reads), tuple(assigns), seg.heredoc))
        if not argv:
            continue
        name = prog_name(argv[0])
        if name in _SHELLS or name == "su":
            for k, a in enumerate(argv[1:], 1):
                if a == "-c" or (a.startswith("-") and not a.startswith("--") and a.endswith("c") and len(a) <= 4):
                    if k + 1 < len(argv):
                        out.extend(_parse(argv[k + 1], depth + 1))
                    break
            if seg.heredoc and name in _SHELLS:
                out.extend(_parse(seg.heredoc, depth + 1))
        elif name == "eval":
            out.extend(_parse(" ".join(argv[1:]), depth + 1))
    return out


def flags(argv: tuple[str, ...] | list[str]) -> set[str]:
    """Short flags (`-rf` -> {'r', 'f'}) and long flags (`--force` -> {'--force'}), up to `--`."""
    out: set[str] = set()
    for a in argv:
        if a == "--":
            break
        if a.startswith("--"):
            out.add(a.split("=", 1)[0])
        elif a.startswith("-") and len(a) > 1 and a[1:].isalpha():
            out.update(a[1:])
    return out


def positionals(argv: tuple[str, ...] | list[str], takes_value: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Non-option arguments (everything after `--` counts), skipping the values of `takes_value` options."""
    out: list[str] = []
    skip = False
    dashdash = False
    for a in argv:
        if dashdash:
            out.append(a)
            continue
        if skip:
            skip = False
            continue
        if a == "--":
            dashdash = True
            continue
        if a.startswith("-") and len(a) > 1:
            if a in takes_value:
                skip = True
            continue
        out.append(a)
    return out


def abspath(path: str, cwd: str) -> str:
    """Normalise `path` against the exec's cwd (no filesystem access)."""
    if not path:
        return path
    if path.startswith("~"):
        path = "/root" + path[1:]
    if not path.startswith("/"):
        path = os.path.join(cwd or "/", path)
    return os.path.normpath(path)


def inline_code(s: Simple) -> str:
    """The program text of `python -c CODE`, `perl -e CODE`, `node -e`, `ruby -e` (else "")."""
    name = s.prog
    if re.match(r"^(python[\d.]*|pypy[\d.]*)$", name):
        opt = ("-c",)
    elif name in ("perl", "ruby", "node", "nodejs", "php", "lua"):
        opt = ("-e", "-E", "-r")
    else:
        return ""
    for k, a in enumerate(s.argv[1:], 1):
        if a in opt and k + 1 < len(s.argv):
            return s.argv[k + 1]
        if any(a.startswith(o) and len(a) > 2 for o in opt) and not a.startswith("--"):
            return a[2:]
    # `python3 <<EOF ... EOF` and `python3 - <<EOF`: the program comes on stdin
    if name.startswith("python") and (len(s.argv) == 1 or s.argv[1:] == ("-",)):
        return s.heredoc
    return ""
