"""Calling a Python function in a sandbox (`client.call(fn, *args)`, `sandbox.call(fn, *args)`).

What travels is the function's *source* (from `inspect.getsource`, decorators stripped), not a
pickle: pickling by reference needs the defining module importable inside the sandbox, which it
is not. The source becomes the `python3 -c` program, so the node's audit log records the code that
ran; the arguments go in on stdin as JSON; the return value comes back on stdout as JSON. While
the function runs, its own prints (and any subprocess output) go to stderr, so stdout carries
only the result.

Limits, checked where possible before anything is sent:

* a plain function defined with `def` or `async def` (an `async def` is run with `asyncio.run`);
  no lambdas, methods, builtins or callable objects; source must be available (not typed at a
  bare REPL prompt);
* only the function's own source is sent: module-level names it uses (imports, helpers,
  constants) do not exist remotely, so import inside the function; closures over enclosing
  variables are refused;
* arguments and the return value must be JSON: tuples arrive as lists, dict keys become strings,
  sets, bytes and objects are refused (TypeError locally, or a RemoteError from the sandbox for
  a return value);
* the image needs `python3` (`debian` has it, `busybox` does not);
* a remote exception comes back as `RemoteError` (its type name, message and the remote
  traceback), not as the original class; a call that runs out of time raises `Timeout`.
"""
from __future__ import annotations

import ast
import inspect
import json
import textwrap
from typing import Any

from corral_common.contract.errors import Timeout
from corral_common.contract.messages import ExecResult

MARK = "\x1ecorral-result:"
MAX_OUTPUT = 4 * 1024 * 1024

_MAIN = '''

def __corral_main__(fn, is_async):
    import json, os, sys, traceback
    payload = json.loads(sys.stdin.read() or "{}")
    out = os.dup(1)
    os.dup2(2, 1)  # the function's own output goes to stderr; stdout carries only the result
    try:
        value = fn(*payload.get("args", []), **payload.get("kwargs", {}))
        if is_async:
            import asyncio
            value = asyncio.run(value)
        try:
            data = json.dumps({"ok": True, "value": value})
        except (TypeError, ValueError) as e:
            data = json.dumps({"ok": False, "type": "TypeError", "message": "the return value is not JSON: %s" % e,
                               "traceback": ""})
    except BaseException as e:
        data = json.dumps({"ok": False, "type": type(e).__qualname__, "module": type(e).__module__,
                           "message": str(e), "traceback": traceback.format_exc()})
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(out, (__MARK__ + data).encode())
'''


class RemoteError(Exception):
    """The called function raised in the sandbox (or the sandbox could not run it)."""

    def __init__(self, type_name: str, message: str, traceback: str = "", result: ExecResult | None = None):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.remote_traceback = traceback
        self.result = result

    def __str__(self) -> str:
        s = f"{self.type_name}: {self.message}"
        if self.remote_traceback:
            s += "\n--- remote traceback ---\n" + self.remote_traceback.rstrip()
        return s


def function_source(fn: Any) -> tuple[str, str, bool]:
    """(source without decorators, def name, is async) of a plain function."""
    if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
        raise TypeError(f"call() needs a plain function defined with def (not a lambda, method, builtin or callable "
                        f"object); got {fn!r}")
    if fn.__code__.co_freevars:
        raise TypeError(f"{fn.__name__}() uses variables of an enclosing function ({', '.join(fn.__code__.co_freevars)}): "
                        "only its own source is sent; pass them as arguments")
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise TypeError(f"the source of {fn.__name__}() is not available ({e}); define it in a file") from None
    tree = ast.parse(src)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"could not find the definition of {fn.__name__}() in its source")
    node.decorator_list = []
    return ast.unparse(node), node.name, isinstance(node, ast.AsyncFunctionDef)


def encode_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], str]:
    """The argv (`python3 -c PROGRAM`) and stdin (JSON arguments) that call fn(*args, **kwargs)."""
    source, name, is_async = function_source(fn)
    try:
        stdin = json.dumps({"args": list(args), "kwargs": kwargs})
    except (TypeError, ValueError) as e:
        raise TypeError(f"arguments of {name}() must be JSON-serialisable: {e}") from None
    program = source + _MAIN.replace("__MARK__", repr(MARK)) + f"\n__corral_main__({name}, {is_async!r})\n"
    return ["python3", "-c", program], stdin


def decode_result(result: ExecResult, fn: Any) -> Any:
    name = getattr(fn, "__name__", "function")
    if result.timed_out:
        raise Timeout(f"{name}() did not return in time; the sandbox was killed. stderr: {result.stderr[-500:]}")
    i = result.stdout.rfind(MARK)
    if i < 0:
        if result.exit_code == 127 and "python3" in result.stderr:
            raise RemoteError("RuntimeError", "python3 is not in the sandbox's image (use an image with Python, e.g. debian)",
                              result=result)
        why = "out of memory" if result.oom_killed else (f"signal {result.signal}" if result.signal else f"exit code {result.exit_code}")
        raise RemoteError("RuntimeError", f"{name}() ended without a result ({why}); stderr: {result.stderr[-2000:]}",
                          result=result)
    try:
        payload = json.loads(result.stdout[i + len(MARK):])
    except ValueError:
        raise RemoteError("RuntimeError", f"the result of {name}() was cut off or malformed (truncated={result.truncated})",
                          result=result) from None
    if payload.get("ok"):
        return payload.get("value")
    raise RemoteError(payload.get("type", "Exception"), payload.get("message", ""), payload.get("traceback", ""), result)
