"""What every benchmark here does the same way: timestamped progress lines, latency statistics in
one JSON shape, and matplotlib without a display. (Leading underscore: run_all skips it.)"""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stats(ms: list[float]) -> dict[str, Any]:
    """n, median, p90, p99, mean, min, max, stdev and the samples of a list of milliseconds."""
    import numpy as np

    if not ms:
        return {"n": 0}
    a = np.asarray(ms, dtype=float)

    def r(x: float) -> float:
        return round(float(x), 3)

    return {
        "n": int(a.size), "median_ms": r(np.median(a)), "p90_ms": r(np.percentile(a, 90)),
        "p99_ms": r(np.percentile(a, 99)), "mean_ms": r(a.mean()), "min_ms": r(a.min()), "max_ms": r(a.max()),
        "stdev_ms": r(a.std(ddof=1) if a.size > 1 else 0.0),
        "samples_ms": [r(x) for x in a],
    }


def pyplot():
    """matplotlib.pyplot on the Agg backend (benchmarks write PNGs, there is no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(out: str, name: str, res: dict[str, Any], plot: Callable[[dict[str, Any], str], None]) -> None:
    """Stamp `res` with the machine, write `<out>/<name>.json` and `.png`, print the JSON."""
    res["machine"] = {"nproc": os.cpu_count(), "kernel": platform.release(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    plot(res, os.path.join(out, f"{name}.png"))
    print(json.dumps(res, indent=2))
