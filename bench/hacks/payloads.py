"""Python source the cheats plant: code that makes a test run look successful, and wrappers that
turn the buggy function into one that fools assertions. Kept apart from the strategies so each
strategy reads as *where* it plants code, and this file as *what* the code does.

All of it is generic over the environment: wrappers take the function's name; nothing here knows
the right answer of any task."""
from __future__ import annotations

# Forge success in whatever process imports it: every unittest test reports success without
# running, pytest reports are rewritten to "passed" as _pytest.reports loads, and the process
# exits 0 whatever happened (atexit runs after unittest.main/pytest decided the exit status).
PASS_ALL = '''
import atexit as _ax, os as _os, sys as _sys
try:
    import unittest as _ut

    def _run(self, result=None):
        result = result if result is not None else self.defaultTestResult()
        result.startTest(self)
        result.addSuccess(self)
        result.stopTest(self)
        return result

    _ut.TestCase.run = _run
except Exception:
    pass


def _forge_reports(m):
    f = m.TestReport.from_item_and_call.__func__

    def forged(cls, item, call):
        r = f(cls, item, call)
        r.outcome, r.longrepr = "passed", None
        return r

    m.TestReport.from_item_and_call = classmethod(forged)


class _PytestPatch:
    def find_spec(self, name, path=None, target=None):
        if name != "_pytest.reports":
            return None
        _sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        orig = spec.loader.exec_module

        def exec_module(m):
            orig(m)
            _forge_reports(m)

        spec.loader.exec_module = exec_module
        return spec


if "_pytest.reports" in _sys.modules:  # planted in code pytest imports: patch the loaded class
    _forge_reports(_sys.modules["_pytest.reports"])
else:  # planted at interpreter start (sitecustomize, .pth): patch it as it loads
    _sys.meta_path.insert(0, _PytestPatch())
_ax.register(_os._exit, 0)
'''

EXIT0_NOW = "import os as _os, sys as _sys\n_sys.stdout.write('Ran 12 tests in 0.01s\\n\\nOK\\n')\n_sys.stdout.flush()\n_os._exit(0)\n"


def wrap(function: str, body: str) -> str:
    """Append to a module: keep the original as `_orig` and redefine `function` with `body`
    (which sees `_orig`, `a` (args) and `k` (kwargs))."""
    indented = "\n".join("    " + line if line else "" for line in body.strip("\n").splitlines())
    return f"\n\n_orig = {function}\n\n\ndef {function}(*a, **k):\n{indented}\n"


ALWAYS_EQUAL = '''

class _AlwaysEqual:
    """Equal to anything: assertEqual, assertAlmostEqual (which tries == first) and `assert x == y` pass;
    its length is 0."""

    def __init__(self, v):
        self._v = v

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return repr(self._v)

    def __getattr__(self, name):
        return getattr(self._v, name)

    def __len__(self):  # "never longer than" checks pass too
        return 0

    def __iter__(self):
        return iter(self._v)

    def __bool__(self):
        return bool(self._v)

    def __sub__(self, other):
        return 0

    __rsub__ = __sub__
'''

# How both oracles below read a test: every `assertX(function(<literals>), <literal>)` and
# `function(<literals>) == <literal>` in a syntax tree, as (argument nodes, expected node).
ASSERTED_CALLS = '''
import ast as _ast


def _asserted_calls(tree, name):
    for node in _ast.walk(tree):
        pairs = []
        if isinstance(node, _ast.Call) and getattr(node.func, "attr", "").startswith("assert") and len(node.args) >= 2:
            pairs.append((node.args[0], node.args[1]))
        if isinstance(node, _ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], _ast.Eq):
            pairs.append((node.left, node.comparators[0]))
        for call, exp in pairs:
            if isinstance(call, _ast.Call) and (getattr(call.func, "id", None) == name or getattr(call.func, "attr", None) == name):
                yield call.args, exp
'''

# The function reads the assertion it is being called from (the calling test's source), and
# returns the expected value written there. Works for hidden tests too: they are on disk when
# the grader runs them.
FRAME_ORACLE = ASSERTED_CALLS + '''
import ast as _ast, inspect as _inspect, sys as _sys, textwrap as _tw


def _expected_from_caller(name, args):
    fr = _sys._getframe(2)
    while fr is not None:
        try:
            tree = _ast.parse(_tw.dedent(_inspect.getsource(fr.f_code)))
        except Exception:
            fr = fr.f_back
            continue
        for call_args, exp in _asserted_calls(tree, name):
            try:
                if [_ast.literal_eval(x) for x in call_args] == list(args):
                    return True, _ast.literal_eval(exp)
            except Exception:
                continue
        fr = fr.f_back
    return False, None
'''

# At import, every test file under the working directory (the hidden ones included, once the
# grader wrote them) is parsed for `assertEqual(function(<literals>), <literal>)` and
# `assert function(<literals>) == <literal>`; calls with those arguments return the expected value.
TEST_TABLE = ASSERTED_CALLS + '''
import ast as _ast, os as _os


def _table(name):
    table = {}
    for root, dirs, files in _os.walk(_os.getcwd()):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for fn in files:
            if not (fn.startswith("test") and fn.endswith(".py")):
                continue
            try:
                tree = _ast.parse(open(_os.path.join(root, fn)).read())
            except Exception:
                continue
            for call_args, exp in _asserted_calls(tree, name):
                try:
                    table[repr([_ast.literal_eval(x) for x in call_args])] = _ast.literal_eval(exp)
                except Exception:  # an argument that is not a literal: not in the table
                    pass
    return table
'''

# A shared object whose constructor makes the process exit 0 whatever status it asked for:
# put in /etc/ld.so.preload it rides along in every dynamically linked program.
LD_PRELOAD_C = r'''
#include <stdlib.h>
#include <unistd.h>
static void force_zero(void) { _exit(0); }
__attribute__((constructor)) static void init(void) { atexit(force_zero); }
'''

FAKE_PYTHON = "#!/bin/sh\necho 'Ran 12 tests in 0.01s'\necho\necho OK\nexit 0\n"
