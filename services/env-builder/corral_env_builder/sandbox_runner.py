"""The trusted test runner, copied into verification and grading sandboxes (never into a rollout)
and run with the image's own interpreter: `python3 -I /opt/corral-grader/runner.py`.

Standard library only, and it must run on any Python 3 an image ships. Two processes:

- the parent never imports anything from the workdir. It reads its config (with a nonce) from
  stdin, makes itself non-dumpable (so same-uid processes cannot open its /proc fds or memory),
  starts the worker, reads the worker's per-test reports from a pipe as each test finishes, enforces
  the time limit, and prints ONE result line `CORRAL-RESULT <nonce> <json>` on its stdout. Code under
  test never sees the nonce, so a forged result line is recognised as forged.
- the worker imports the test framework (unittest, or pytest from the image) before the workdir is
  on the import path, puts the workdir after the standard library, runs the tests and writes one
  JSON line per test to the report pipe.

What the worker reports can still be forged by code that runs inside it (the code under test is
imported there): the parent only guarantees that a test which did not report is a failure, that
reports name tests that were asked for, and that the process exit status means nothing. Within the
worker, an audit hook (PEP 578: it cannot be removed once added) is installed before anything of
the solution is imported; it refuses and reports what solution code does to forge a pass at run
time: setting or deleting attributes of the test framework's classes, reading the test files, and
(from lines the solution added) frame walking, gc traversal, ctypes, tracing, spawning, signalling.
"""
import json
import os
import select
import signal
import subprocess
import sys
import time

RESULT_TAG = "CORRAL-RESULT"
RUNNER_MODULES = ("unittest", "pytest", "_pytest", "pluggy", "iniconfig", "py", "packaging", "sitecustomize",
                  "usercustomize", "site", "conftest")
OUTPUT_KEEP = 64 * 1024


# ---------------------------------------------------------------- parent

def _non_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass  # no ctypes in this image: the nonce still protects the result line


def _shadowing(carried, workdir):
    """Carried files that would stand in for a standard-library or test-runner module: a top-level
    module (its directory is not a package) named like one."""
    names = set(getattr(sys, "stdlib_module_names", ())) | set(RUNNER_MODULES)
    out = []
    for path in carried:
        if not path.endswith(".py"):
            continue
        d, base = os.path.split(path)
        if base == "__init__.py":
            d, base = os.path.split(d)
        else:
            base = base[:-3]
        if base in names and not os.path.exists(os.path.join(d, "__init__.py")):
            out.append(path)
    return out


def parent():
    cfg = json.loads(sys.stdin.readline())
    nonce = cfg.pop("nonce")
    _non_dumpable()
    result = {"results": {}, "collected": None, "errors": [], "violations": [],
              "shadowing": _shadowing(cfg.get("carried", []), cfg["workdir"])}
    rfd, wfd = os.pipe()
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "CORRAL_REPORT_FD": str(wfd)}
    t0 = time.monotonic()
    worker = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--worker"], cwd=cfg["workdir"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(wfd,),
                              env=env, start_new_session=True)
    os.close(wfd)
    worker.stdin.write(json.dumps(cfg).encode())
    worker.stdin.close()
    wanted = set(cfg.get("tests") or ())
    output, buf, done = bytearray(), b"", False
    streams = {rfd: "report", worker.stdout.fileno(): "output"}
    deadline = t0 + float(cfg.get("timeout_s", 120))
    timed_out = False
    while streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select(list(streams), [], [], min(left, 1.0))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del streams[fd]
                continue
            if streams[fd] == "output":
                output += chunk
                del output[:-OUTPUT_KEEP]
                continue
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                done = _take(line, result, wanted) or done
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except OSError:
        pass
    rc = worker.wait()
    os.close(rfd)
    if timed_out:
        result["errors"].append("the tests did not finish within %ss" % cfg.get("timeout_s"))
    elif not done:
        result["errors"].append("the test process ended before it finished (exit status %s)" % rc)
    result["worker_exit"] = rc
    result["seconds"] = round(time.monotonic() - t0, 3)
    result["output"] = output.decode("utf-8", "replace")
    sys.stdout.write("\n%s %s %s\n" % (RESULT_TAG, nonce, json.dumps(result)))
    sys.stdout.flush()


def _take(line, result, wanted):
    """One report line into the result; True for the worker's `done`."""
    try:
        msg = json.loads(line)
        kind = msg["t"]
    except Exception:
        result["errors"].append("unreadable report line %r" % line[:200])
        return False
    if kind == "done":
        return True
    if kind == "collected":
        result["collected"] = {str(k): str(v) for k, v in dict(msg["tests"]).items()}
    elif kind == "error":
        result["errors"].append(str(msg.get("message", ""))[:4000])
    elif kind == "violation":
        if len(result["violations"]) < 50:
            result["violations"].append({k: str(msg.get(k, ""))[:500] for k in ("event", "why", "path", "line")})
    elif kind == "result":
        tid = str(msg["id"])
        if wanted and tid not in wanted:
            return False  # not asked for: a forged or stray report
        outcome = msg.get("outcome")
        if outcome not in ("passed", "failed", "error", "skipped"):
            outcome = "error"
        old = result["results"].get(tid)
        if old is not None and old["outcome"] != outcome:
            outcome, msg["message"] = "error", "reported twice with different outcomes"
        result["results"][tid] = {"outcome": outcome, "seconds": float(msg.get("seconds", 0.0)),
                                  "message": str(msg.get("message", ""))[:2000]}
    return False


# ---------------------------------------------------------------- worker

class _Reporter:
    def __init__(self, fd):
        self.out = os.fdopen(fd, "w", buffering=1)

    def send(self, **msg):
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()


def _workdir_after_stdlib(paths):
    """The import path with `paths` after the standard library and before site-packages: the
    solution can be imported, but cannot stand in for a standard module."""
    at = len(sys.path)
    for i, p in enumerate(sys.path):
        if "site-packages" in p or "dist-packages" in p:
            at = i
            break
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(at, p)


def _unittest_ids(suite):
    import unittest

    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _unittest_ids(t)
        else:
            yield t


def _unittest_file(test):
    if type(test).__name__ in ("DocTestCase", "DocFileCase", "SkipDocTestCase"):
        return ""  # a doctest lives in the module it tests: that file is the solution's, not the grader's
    mod = sys.modules.get(type(test).__module__)
    return getattr(mod, "__file__", "") or ""


def run_unittest(cfg, rep, tripwire):
    import traceback
    import unittest

    class Result(unittest.TestResult):
        """A test counts as passed only when the framework called addSuccess for it and nothing
        failed, so a patched TestCase.run that skips the test body reports nothing."""

        def startTest(self, test):
            super().startTest(test)
            self._t0, self._state, self._msg = time.perf_counter(), None, ""

        def _bad(self, kind, err):
            if self._state not in ("failed", "error"):
                self._state, self._msg = kind, "".join(traceback.format_exception_only(err[0], err[1])).strip()

        def addSuccess(self, test):
            super().addSuccess(test)
            if self._state is None:
                self._state = "passed"

        def addError(self, test, err):
            super().addError(test, err)
            self._bad("error", err)

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._bad("failed", err)

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:
                self._bad("failed", err)

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            if self._state is None:
                self._state, self._msg = "skipped", str(reason)

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            if self._state is None:
                self._state, self._msg = "skipped", "expected failure"

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._bad("failed", (AssertionError, AssertionError("unexpected success"), None))

        def stopTest(self, test):
            super().stopTest(test)
            state, msg = self._state or "error", self._msg if self._state else "the test reported no outcome"
            changed = tripwire.changed() if tripwire is not None else []
            if changed:
                state, msg = "error", "the test framework was changed during the run: " + ", ".join(changed[:10])
                rep.send(t="violation", event="framework", why=msg, path="", line="")
            rep.send(t="result", id=test.id(), outcome=state, message=msg, seconds=round(time.perf_counter() - self._t0, 4))

    wd = cfg["workdir"]
    top = os.path.normpath(os.path.join(wd, cfg.get("top") or "."))
    _workdir_after_stdlib([top, wd] if top != wd else [wd])
    loader = unittest.TestLoader()
    # named or not, tests are found the way verification found them (discovery honours load_tests,
    # which is how doctests and generated tests get their ids); named runs keep only those ids
    if cfg.get("args"):  # `python3 -m unittest tests.test_a tests.test_b`
        found = loader.loadTestsFromNames(cfg["args"])
    else:
        start = os.path.join(wd, cfg.get("start") or ".")
        found = loader.discover(start, pattern=cfg.get("pattern") or "test*.py", top_level_dir=top)
    tests = {}
    everything = []
    for t in _unittest_ids(found):
        if type(t).__name__ == "_FailedTest":  # a test module that does not import
            rep.send(t="error", message="%s: %s" % (t.id(), getattr(t, "_exception", "")))
            continue
        tests[t.id()] = _unittest_file(t)
        everything.append(t)
    wanted = cfg.get("tests")
    if wanted:
        keep = set(wanted)
        suite = unittest.TestSuite(t for t in everything if t.id() in keep)
        for tid in sorted(keep - set(tests)):  # named, but not discovered: load it by name
            try:
                for t in _unittest_ids(loader.loadTestsFromName(tid)):
                    if t.id() == tid:  # a name that does not resolve loads a _FailedTest under another id
                        suite.addTest(t)
            except Exception as e:
                rep.send(t="error", message="cannot load %s: %s" % (tid, e))
    else:
        rep.send(t="collected", tests=tests)
        suite = unittest.TestSuite(everything)
    for err in loader.errors:
        rep.send(t="error", message=str(err)[-2000:])
    suite.run(Result())


def run_pytest(cfg, rep, tripwire):
    import pytest  # from the image, imported before the workdir is on the path

    wd = cfg["workdir"]
    _workdir_after_stdlib([wd])

    class Plugin:
        def __init__(self):
            self.state = {}
            self.tripwire = tripwire

        def pytest_collection_finish(self, session):
            if not cfg.get("tests"):
                rep.send(t="collected", tests={i.nodeid: str(i.path if hasattr(i, "path") else i.fspath) for i in session.items})

        def pytest_collectreport(self, report):
            if report.failed:
                rep.send(t="error", message="collecting %s failed: %s" % (report.nodeid, str(report.longrepr)[-2000:]))

        def pytest_runtest_logreport(self, report):
            st = self.state.setdefault(report.nodeid, {"outcome": None, "message": "", "seconds": 0.0})
            st["seconds"] += getattr(report, "duration", 0.0)
            if report.failed:
                if st["outcome"] not in ("failed", "error"):
                    st["outcome"] = "failed" if report.when == "call" else "error"
                    st["message"] = str(report.longrepr)[-2000:]
            elif report.skipped:
                if st["outcome"] is None:
                    st["outcome"], st["message"] = "skipped", "xfail" if hasattr(report, "wasxfail") else "skipped"
            elif report.when == "call" and st["outcome"] is None:
                st["outcome"] = "failed" if hasattr(report, "wasxfail") else "passed"
            if report.when == "teardown":
                outcome, msg = st["outcome"] or "error", st["message"] if st["outcome"] else "the test reported no outcome"
                changed = self.tripwire.changed() if self.tripwire is not None else []
                if changed:
                    outcome, msg = "error", "the test framework was changed during the run: " + ", ".join(changed[:10])
                    rep.send(t="violation", event="framework", why=msg, path="", line="")
                rep.send(t="result", id=report.nodeid, outcome=outcome, message=msg, seconds=round(st["seconds"], 4))

    args = list(cfg.get("tests") or cfg.get("args") or [])
    pytest.main(["-p", "no:cacheprovider", "--import-mode=append", "--rootdir", wd, "-q", *args], plugins=[Plugin()])


# ---------------------------------------------------------------- worker: the run-time guard

FRAMEWORK = ("unittest", "_pytest", "pytest", "pluggy", "doctest", "_unittest")
SENSITIVE = frozenset({"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "sys._getframemodulename",
                       "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen", "ctypes.dlsym",
                       "ctypes.cdata", "ctypes.call_function", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn",
                       "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "sys.addaudithook",
                       "socket.connect", "socket.__new__", "function.__new__", "code.__new__", "marshal.loads"})
READS = frozenset({"open", "os.listdir", "os.scandir", "glob.glob", "os.walk"})


def install_guard(cfg, rep):
    """The audit hook. `solution`: files the solution changed, with the lines it added; `tests`:
    files and directories that are the grader's (hidden tests, the named tests' files)."""
    solution = {p: set(lines) for p, lines in (cfg.get("added") or {}).items()}
    if not solution:
        return
    tests = tuple(cfg.get("protected") or ())
    getframe = sys._getframe
    state = {"busy": False, "reported": 0}

    def solution_frame(direct):
        f = getframe(2)
        while f is not None:
            if f.f_code.co_filename in solution:
                return f
            if direct:
                return None
            f = f.f_back
        return None

    def violate(event, why, f, block):
        if state["reported"] < 50:
            state["reported"] += 1
            rep.send(t="violation", event=event, why=why, path=f.f_code.co_filename, line=f.f_lineno)
        if block:
            raise RuntimeError("refused by the grader: " + why)

    def hook(event, args):
        if state["busy"]:
            return
        if event in READS:
            path = args[0] if args else None
            if isinstance(path, bytes):
                path = path.decode("utf-8", "replace")
            if not isinstance(path, str):
                return
            path = os.path.abspath(path)
            if not ((path + "/").startswith(tests) or path.startswith(("/proc/", "/dev/fd"))):
                return
            state["busy"] = True
            try:
                f = solution_frame(False)
            finally:
                state["busy"] = False
            if f is not None:
                violate(event, "reads %s" % path, f, True)
        elif event in SENSITIVE:
            state["busy"] = True
            try:
                f = solution_frame(True)
            finally:
                state["busy"] = False
            if f is not None and f.f_lineno in solution[f.f_code.co_filename]:
                violate(event, "calls %s" % event, f, False)

    sys.addaudithook(hook)


class Tripwire:
    """The framework's functions and classes (module globals and class attributes of unittest,
    pytest, pluggy) and the builtins, taken before anything of the workdir is imported and
    compared whenever a test reports. The framework changes itself as it runs (configuration,
    debugger hooks), so a change counts when the new value is code from the workdir: a function,
    method, lambda or class the solution defined, put where the framework or the builtins look."""

    def __init__(self, workdir):
        import builtins

        self.root = workdir.rstrip("/") + "/"
        self.seen = []  # (owner name, namespace, key, value): compared by identity at each report
        self._add("builtins", vars(builtins))
        for name, mod in list(sys.modules.items()):
            if mod is None or name.split(".")[0] not in FRAMEWORK:
                continue
            self._add(name, vars(mod))
            for k, v in list(vars(mod).items()):
                if isinstance(v, type) and getattr(v, "__module__", "") == name:
                    self._add(name + "." + k, vars(v))

    def _add(self, owner, ns):
        self.seen.extend((owner, ns, k, v) for k, v in list(ns.items()) if callable(v) or isinstance(v, (property, classmethod,
                                                                                                       staticmethod)))

    def _from_workdir(self, v):
        import functools
        import types

        if isinstance(v, (types.MethodType, classmethod, staticmethod)):
            v = v.__func__
        if isinstance(v, functools.partial):
            v = v.func
        if isinstance(v, property):
            v = v.fget
        if isinstance(v, types.FunctionType):
            return v.__code__.co_filename.startswith(self.root)
        if isinstance(v, type):
            mod = sys.modules.get(v.__module__) if isinstance(v.__module__, str) else None
            return str(getattr(mod, "__file__", "") or "").startswith(self.root)
        return False

    def changed(self):
        out = []
        for owner, ns, k, v in self.seen:
            now = ns.get(k, v)
            if now is not v and self._from_workdir(now):
                out.append(owner + "." + k)
        return out


def worker():
    cfg = json.loads(sys.stdin.read())
    rep = _Reporter(int(os.environ["CORRAL_REPORT_FD"]))
    os.chdir(cfg["workdir"])
    try:
        # the framework first (its own imports are not the solution's), then the guard, then tests
        import unittest  # noqa: F401
        if cfg["kind"] == "pytest":
            import pytest  # noqa: F401
        # taken before anything of the workdir is imported: what the framework is made of
        tripwire = Tripwire(cfg["workdir"]) if cfg.get("added") else None
        install_guard(cfg, rep)
        (run_pytest if cfg["kind"] == "pytest" else run_unittest)(cfg, rep, tripwire)
    except SystemExit:
        pass
    except BaseException as e:  # the runner itself broke: say how, the parent counts what reported
        rep.send(t="error", message="runner: %s: %s" % (type(e).__name__, e))
    rep.send(t="done")


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else parent()
