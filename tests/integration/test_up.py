"""`corral up` as a user runs it: one ready line, a working stack, a clean stop on SIGTERM."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

from corral_sdk import Client
from corral_sdk.stack import free_port

from ..conftest import IMAGE_DIR
from ..leaks import assert_clean, inits_of_node, processes_with


def test_corral_up_ready_line_and_clean_shutdown():
    data = tempfile.mkdtemp(prefix="crl-up-", dir="/tmp")
    port = free_port()
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    p = subprocess.Popen([corral, "up", "--data-dir", data, "--nats-port", str(port), "--nodes", "2", "--image-dir", IMAGE_DIR],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line == f"corral ready nats://127.0.0.1:{port}\n", (line, p.stderr.read() if p.poll() is not None else "")
        with Client(f"nats://127.0.0.1:{port}") as c:
            sbs = c.create_batch(4, image="busybox", cpu=0.1, memory_mb=32)
            assert {s.info.node for s in sbs} == {"node-1", "node-2"}  # spread over both nodes
            for s in sbs:
                s.exec("sleep 600 &")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        rest = p.stdout.read()
        assert "corral ready" not in rest  # exactly one ready line
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert processes_with(data) == []
    for node in ("node-1", "node-2"):
        assert inits_of_node(data, node) == []
        assert_clean(data, node)
    shutil.rmtree(data, ignore_errors=True)
