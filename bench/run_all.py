"""Run every benchmark module in bench/ in turn, each in its own process.

    .venv/bin/python -m bench.run_all [--out bench/results] [--only NAME] [--args NAME="ARGS"] [-- ARGS for every module]

A benchmark module is any `bench/<name>.py` (not starting with `_`, not `run_all`) that defines
`main(argv)`; each is run as `python -m bench.<name> --out OUT [ARGS]`, where ARGS are the ones after
`--` (given to every module, so only options they all take) followed by that module's own `--args`
(e.g. `--args sandbox_lifecycle="--n 30"`). Exits non-zero if any module does, or leaves no
`OUT/<name>.json` stamped by bench/_common.save (tree and goals).
"""
from __future__ import annotations

import argparse
import json
import os
import pkgutil
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def modules() -> list[str]:
    out = []
    for m in pkgutil.iter_modules([HERE]):
        if m.ispkg or m.name.startswith("_") or m.name == "run_all":
            continue
        with open(os.path.join(HERE, f"{m.name}.py")) as f:
            if "\ndef main(" in f.read():
                out.append(m.name)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="run every benchmark in bench/")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--only", action="append", default=[], help="run only this module (repeatable)")
    ap.add_argument("--args", action="append", default=[], metavar='NAME="ARGS"',
                    help="extra arguments for one module (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the benchmark modules and exit")
    args = ap.parse_args(argv)
    names = modules()
    per: dict[str, list[str]] = {}
    for spec in args.args:
        name, sep, rest = spec.partition("=")
        if not sep or name not in names:
            print(f"--args wants NAME=ARGS with NAME one of {', '.join(names)}; got {spec!r}", file=sys.stderr)
            return 2
        per.setdefault(name, []).extend(shlex.split(rest))
    if args.list:
        print("\n".join(names))
        return 0
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            print(f"unknown benchmark(s): {', '.join(sorted(unknown))}; have {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in args.only]
    status = {}
    for name in names:
        print(f"=== bench.{name}", flush=True)
        t0, started = time.monotonic(), time.time()
        rc = subprocess.call([sys.executable, "-m", f"bench.{name}", "--out", args.out, *extra, *per.get(name, [])], cwd=REPO)
        problem = f"exit {rc}" if rc else unstamped(os.path.join(args.out, f"{name}.json"), started)
        status[name] = (problem, time.monotonic() - t0)
    print("\n=== summary")
    for name, (problem, s) in status.items():
        print(f"  {name:<28} {f'FAILED ({problem})' if problem else 'ok':<40} {s:7.1f} s")
    return 0 if not any(p for p, _ in status.values()) else 1


def unstamped(path: str, since: float) -> str:
    """Why `path` is not a result this run wrote through bench/_common.save ("" if it is): the docs
    are generated from these files, so a module that skips the stamp fails the run."""
    try:
        if os.path.getmtime(path) < since:
            return f"{os.path.basename(path)} not rewritten"
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable {os.path.basename(path)}: {e}"
    if not isinstance(res.get("goals"), list) or "tree" not in res:
        return f"{os.path.basename(path)} has no tree/goals stamp"
    return ""


if __name__ == "__main__":
    sys.exit(main())
