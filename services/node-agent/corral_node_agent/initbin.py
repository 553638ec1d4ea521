"""Builds corral-init (the sandbox's PID 1) from its C source once per node, statically linked
because images such as busybox carry no libc.

The source ships inside the package (package data, see pyproject.toml) and is only read; the
binary goes to the node's state dir (`<state-dir>/bin`, /var/lib/corral by default), never next to
the source, because an installed package's directory (site-packages) may be read-only."""
from __future__ import annotations

import os
import shutil
import subprocess

from corral_common.contract.errors import Unavailable

SOURCE = os.path.join(os.path.dirname(__file__), "init", "corral-init.c")


def ensure_init_binary(bin_dir: str) -> str:
    os.makedirs(bin_dir, exist_ok=True)
    dest = f"{bin_dir}/corral-init"
    if not os.path.exists(SOURCE):  # a package built without its package data
        raise Unavailable(f"the corral-init source is missing from the installed package ({SOURCE}); "
                          "reinstall corral from a wheel or checkout that includes it")
    if os.path.exists(dest) and os.path.getmtime(dest) >= os.path.getmtime(SOURCE):
        return dest
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Unavailable("a C compiler is needed once to build corral-init (apt-get install gcc libc6-dev)")
    tmp = f"{dest}.{os.getpid()}.tmp"
    p = subprocess.run([cc, "-static", "-O2", "-Wall", "-o", tmp, SOURCE], capture_output=True, text=True)
    if p.returncode != 0:
        raise Unavailable(f"building corral-init failed: {p.stderr.strip()[-2000:]}")
    os.replace(tmp, dest)
    return dest
