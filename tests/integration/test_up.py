"""`corral up` as a user runs it: one ready line, a working stack (warm pools passed on to the nodes), a clean
stop on SIGTERM; a malformed option refused before anything starts."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import nats
import pytest

from corral_common import auth
from corral_common.contract import subjects
from corral_sdk import AsyncClient, Client
from corral_sdk.stack import free_port

from ..conftest import IMAGE_DIR
from ..leaks import assert_clean, inits_of_node, processes_with


async def _claim_reason(url: str) -> str:
    """Once every node heartbeats a warm busybox sandbox (--warm-pool passed on to the nodes),
    create one and return its `created` event's reason."""
    nc = await nats.connect(url, **auth.connect_options(url))
    warm: dict[str, int] = {}
    created: dict[str, str] = {}

    async def on_hb(m) -> None:
        hb = json.loads(m.data)
        warm[hb["node"]] = hb.get("warm", {}).get("busybox", 0)

    async def on_created(m) -> None:
        ev = json.loads(m.data)
        created[ev["sandbox_id"]] = ev.get("reason", "")

    await nc.subscribe(subjects.NODE_HEARTBEAT, cb=on_hb)
    await nc.subscribe(subjects.event("*", "created"), cb=on_created)
    try:
        for _ in range(600):
            if len(warm) == 2 and all(warm.values()):
                break
            await asyncio.sleep(0.1)
        assert len(warm) == 2 and all(warm.values()), warm
        c = await AsyncClient.connect(url)
        try:
            sb = await c.create(image="busybox", cpu=0.1, memory_mb=32)
            for _ in range(300):
                if sb.id in created:
                    break
                await asyncio.sleep(0.1)
            await sb.destroy()
        finally:
            await c.close()
        assert sb.id in created, created
        return created[sb.id]
    finally:
        await nc.close()


def test_corral_up_ready_line_and_clean_shutdown():
    data = tempfile.mkdtemp(prefix="crl-up-", dir="/tmp")
    port = free_port()
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    p = subprocess.Popen([corral, "up", "--data-dir", data, "--nats-port", str(port), "--nodes", "2", "--image-dir", IMAGE_DIR,
                          "--warm-pool", "busybox=1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line == f"corral ready nats://127.0.0.1:{port}\n", (line, p.stderr.read() if p.poll() is not None else "")
        # the bus wants credentials; `corral up` wrote the operator's into its data dir
        with pytest.raises(Exception, match="(?i)authoriz"):
            asyncio.run(nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=0, allow_reconnect=False))
        os.environ[auth.CREDS_ENV] = auth.creds_path("admin", data)
        with Client(f"nats://127.0.0.1:{port}") as c:
            sbs = c.create_batch(4, image="busybox", cpu=0.1, memory_mb=32)
            assert {s.info.node for s in sbs} == {"node-1", "node-2"}  # spread over both nodes
            for s in sbs:
                s.exec("sleep 600 &")
        assert asyncio.run(_claim_reason(f"nats://127.0.0.1:{port}")) == "claimed from the warm pool"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        rest = p.stdout.read()
        assert "corral ready" not in rest  # exactly one ready line
    finally:
        os.environ.pop(auth.CREDS_ENV, None)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert processes_with(data) == []
    for node in ("node-1", "node-2"):
        assert inits_of_node(data, node) == []
        assert_clean(data, node)
    shutil.rmtree(data, ignore_errors=True)


def test_corral_up_refuses_a_malformed_warm_pool():
    data = tempfile.mkdtemp(prefix="crl-up-", dir="/tmp")
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    p = subprocess.run([corral, "up", "--data-dir", data, "--nats-port", str(free_port()), "--warm-pool", "busybox=many"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "expected IMAGE=COUNT" in p.stderr, (p.returncode, p.stderr)
    assert processes_with(data) == []
    shutil.rmtree(data, ignore_errors=True)
