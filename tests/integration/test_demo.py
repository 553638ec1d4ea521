"""`corral demo`, the main job, end to end on the debian image (debootstrapped once per machine)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from ..conftest import IMAGE_DIR
from ..leaks import assert_clean


def test_demo_runs_python_in_every_sandbox():
    data = tempfile.mkdtemp(prefix="crl-demo-", dir="/tmp")
    report = os.path.join(data, "report.json")
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    p = subprocess.run([corral, "demo", "--count", "6", "--data-dir", data, "--report", report],
                       env={**os.environ, "CORRAL_IMAGE_DIR": IMAGE_DIR}, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(report) as f:
        rep = json.load(f)
    assert rep["summary"]["ok"] == 6 and rep["summary"]["left_behind"] == 0
    assert all(r["ok"] and r["primes"] > 300 for r in rep["rows"])
    assert "6/6 sandboxes ok" in p.stdout
    assert_clean(data, "node-1")
    shutil.rmtree(data, ignore_errors=True)
