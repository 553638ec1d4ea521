"""What every benchmark here does the same way: timestamped progress lines, latency statistics in
one JSON shape, and matplotlib without a display. (Leading underscore: run_all skips it.)"""
from __future__ import annotations

import time
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
