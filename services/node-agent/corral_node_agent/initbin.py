"""Builds the node's in-sandbox helpers from their C sources once per node, statically linked
because images such as busybox carry no libc: corral-init (a container sandbox's PID 1) and
corral-exec (installs a function call's precompiled seccomp filter, then execs the command).

The sources ship inside the package (package data, see pyproject.toml) and are only read; the
binaries go to the node's state dir (`<state-dir>/bin`, /var/lib/corral by default), never next to
the sources, because an installed package's directory (site-packages) may be read-only."""
from __future__ import annotations

import os
import shutil
import subprocess

from corral_common.contract.errors import Unavailable

INIT_DIR = os.path.join(os.path.dirname(__file__), "init")
SOURCE = os.path.join(INIT_DIR, "corral-init.c")


def ensure_init_binary(bin_dir: str) -> str:
    return ensure_binary(bin_dir, "corral-init")


def ensure_binary(bin_dir: str, name: str) -> str:
    """`<bin_dir>/<name>`, built from `init/<name>.c` unless a build newer than the source is there."""
    source = os.path.join(INIT_DIR, f"{name}.c")
    os.makedirs(bin_dir, exist_ok=True)
    dest = f"{bin_dir}/{name}"
    if not os.path.exists(source):  # a package built without its package data
        raise Unavailable(f"the {name} source is missing from the installed package ({source}); "
                          "reinstall corral from a wheel or checkout that includes it")
    if os.path.exists(dest) and os.path.getmtime(dest) >= os.path.getmtime(source):
        return dest
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Unavailable(f"a C compiler is needed once to build {name} (apt-get install gcc libc6-dev)")
    tmp = f"{dest}.{os.getpid()}.tmp"
    p = subprocess.run([cc, "-static", "-O2", "-Wall", "-o", tmp, source], capture_output=True, text=True)
    if p.returncode != 0:
        raise Unavailable(f"building {name} failed: {p.stderr.strip()[-2000:]}")
    os.replace(tmp, dest)
    return dest
