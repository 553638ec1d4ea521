"""Every NATS subject corral speaks is spelled only in corral_common/contract/subjects.py, every label key
only in corral_common/contract/labels.py.

Why: a subject spelled twice drifts (one side renamed, the other still listening on the old name,
and nothing fails until a request times out). With one module the contract can be read off it and
renamed in one edit.

What counts, decided on the string constants of the AST (so comments never count, and an f-string
counts by its literal parts, e.g. the `corral.node.` of f"corral.node.{node}.create"):

* A **subject** is a string containing `corral.<domain>.` for one of corral's subject domains
  (v1, node, events, audit, alerts, traj, internal, env, monitor) followed by a further dot, or a
  `$KV.`/`$JS.`/`$SRV.`/`$O.` subject. Every corral subject has at least three tokens, so the further
  dot is what separates a subject from the two other things spelled `corral.<word>`:
* a **label key** is exactly `corral.<word>` (one word, no further dot; `corral.label.` and a
  Docker filter's `corral.node=` included): a key of a sandbox's or container's labels dict.
  Label keys may appear only in labels.py (subjects.py may hold a bare prefix such as
  `corral.alerts` that its functions extend).
* a **logger name** (`logging.getLogger("corral.node.docker")`) is a dotted name of the logging
  hierarchy, not a subject: the first argument of a getLogger/get_logger call is skipped.

Docstrings are prose describing subjects (`corral.node.<node>.create`) and are skipped; any other
string (an error message, a CLI help text) builds its subject from subjects.py.

The contract tests in ALLOWED deliberately speak raw subjects and JSON as an outside client would:
they check that the documented names work, so they must not import them from the code under test.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("libs", "services", "bench", "tests", "scripts")
SUBJECTS = Path("libs/common/corral_common/contract/subjects.py")
LABELS = Path("libs/common/corral_common/contract/labels.py")
ALLOWED = {
    # an outside client's view: plain nats-py and the subject names the README documents
    Path("tests/integration/test_contract.py"): "speaks the documented JSON contract on raw subjects",
    Path("tests/integration/test_trajectory_raw.py"): "trajectory steps through the raw bus, no SDK",
    # this file: its self-check below feeds the scanner literal subjects
    Path("tests/unit/test_subjects_in_one_place.py"): "the scanner's own fixtures",
}

SUBJECT_RE = re.compile(r"corral\.(v1|node|events|audit|alerts|traj|internal|env|monitor)\.|\$(KV|JS|SRV|O)\.")
LABEL_RE = re.compile(r"corral\.[a-z_]+[.=]?")
LOGGER_CALLS = {"getLogger", "get_logger"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings of a module, class or function."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _logger_names(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that name a logger: the first argument of getLogger/get_logger."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in LOGGER_CALLS:
                out.add(id(node.args[0]))
    return out


def findings(source: str, rel: Path) -> list[str]:
    """`file:line: what` for each subject or label key spelled in `source` outside its module."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | _logger_names(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        if SUBJECT_RE.search(node.value):
            if rel != SUBJECTS:
                out.append(f"{rel}:{node.lineno}: subject {node.value!r} spelled outside {SUBJECTS}")
        elif LABEL_RE.fullmatch(node.value) and rel not in (LABELS, SUBJECTS):
            out.append(f"{rel}:{node.lineno}: label key {node.value!r} spelled outside {LABELS}")
    return out


def _sources() -> list[Path]:
    files = []
    for top in SCANNED:
        files += [p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts]
    return sorted(files)


def test_subjects_and_label_keys_are_spelled_in_one_place():
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        if rel in ALLOWED:
            continue
        found += findings(path.read_text(), rel)
    assert not found, "use corral_common.contract.subjects / corral_common.contract.labels instead:\n" + "\n".join(found)


def test_the_allowlist_names_files_that_exist():
    """A renamed contract test would silently drop out of the allowlist's reason."""
    assert all((ROOT / p).is_file() for p in ALLOWED)


def test_the_scanner_tells_subjects_labels_and_loggers_apart():
    src = '''"""Answers `corral.node.<node>.create`."""
import logging
log = logging.getLogger("corral.node.docker")
A = "corral.v1.sandbox.create"
B = f"corral.node.{node}.ping"
C = {"corral.env": 1}
D = f"$KV.{bucket}.{key}"
E = f"corral.node={node}"
F = "corral_sdk"
def f():
    """`corral.events.>` in prose."""
    raise ValueError("corral.audit.>: no such stream")
'''
    got = findings(src, Path("x.py"))
    assert [g.split(":")[1] for g in got] == ["4", "5", "6", "7", "8", "12"], got
    assert "subject 'corral.v1.sandbox.create'" in got[0] and "label key 'corral.env'" in got[2]
    assert findings(src.replace('C = {"corral.env": 1}\n', "").replace('E = f"corral.node={node}"\n', ""), SUBJECTS) == []
