#!/usr/bin/env python3
"""Download the pinned sdists the real-package environments are made from (bench/hacks/pypi_envs.py)
into $CORRAL_SDIST_DIR (default /var/lib/corral/sdists), so tests and demos after set-up run offline.
Already cached files are reused; run by `make setup` (and so by `make test` and `make demo`)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.hacks.pypi_envs import PACKAGES  # noqa: E402
from corral_sdk.pypi_env import fetch_sdist, sdist_dir  # noqa: E402


def main() -> int:
    for pkg in PACKAGES:
        try:
            path = fetch_sdist(pkg.name, pkg.version)
        except Exception as e:  # noqa: BLE001 - a set-up step reports every failure the same way
            print(f"fetch-sdists: {e}", file=sys.stderr)
            return 1
        print(f"{pkg.name}=={pkg.version}: {path}")
    print(f"sdists ready in {sdist_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
