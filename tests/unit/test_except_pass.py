"""A broad `except ...: pass` (bare `except:`, `except Exception`/`BaseException`, or a tuple
holding one of them) in libs/, services/, bench/ or scripts/ carries a comment saying why swallowing
every error is right there, on the except line or the pass line.

Why: a silent broad handler hides the bug it catches; one that says why ("shutting down: a closed
connection has nothing to drain") can be checked by a reader. Narrow handlers (`except
FileNotFoundError: pass`) name what they expect and need no comment. A bare `except:` is held to the
same rule whatever its body, since it also swallows KeyboardInterrupt and cancellation.
Comments are found with tokenize, so a `#` inside a string does not count.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("libs", "services", "bench", "scripts")
BROAD = {"Exception", "BaseException"}


def _broad(t: ast.expr | None) -> bool:
    if t is None:
        return True
    if isinstance(t, ast.Tuple):
        return any(_broad(e) for e in t.elts)
    name = t.attr if isinstance(t, ast.Attribute) else t.id if isinstance(t, ast.Name) else ""
    return name in BROAD


def findings(source: str, rel: Path) -> list[str]:
    """`file:line` of each broad handler that swallows silently without a comment."""
    commented = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler) or not _broad(node.type):
            continue
        swallows = len(node.body) == 1 and isinstance(node.body[0], ast.Pass)
        if (swallows or node.type is None) and not {node.lineno, node.body[0].lineno} & commented:
            what = "bare except" if node.type is None else f"except {ast.unparse(node.type)}: pass"
            out.append(f"{rel}:{node.lineno}: {what} without a comment saying why")
    return out


def test_broad_silent_handlers_say_why():
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += findings(path.read_text(), path.relative_to(ROOT))
    assert not found, "narrow it, log it, or say why swallowing is right:\n" + "\n".join(found)


def test_the_scanner_finds_silent_broad_handlers_only():
    src = '''
try:
    f()
except Exception:
    pass
try:
    f()
except (OSError, Exception):  # stopping: nothing to clean
    pass
try:
    f()
except BaseException:
    pass  # says why on the pass line
try:
    f()
except FileNotFoundError:
    pass
try:
    f()
except:
    g()
try:
    f()
except Exception:
    s = "# not a comment"
try:
    f()
except asyncio.CancelledError:
    pass
try:
    f()
except (RuntimeError, builtins.Exception):
    x = "#"; pass
'''
    got = findings(src, Path("x.py"))
    assert [g.split(":")[1] for g in got] == ["4", "20"], got
    assert "bare except" in got[1]
