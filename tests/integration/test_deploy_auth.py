"""`corral deploy-auth`: the credentials and server authorization deploy/ runs with, on real
nats-servers configured the way deploy/nats/nats.conf includes them: corral's identities by nkey,
tenants by password, the same permissions as the embedded stack, authenticated routes."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
import urllib.request

import nats
import pytest

from corral_common import auth
from corral_common.contract import subjects
from corral_sdk import deployauth
from corral_sdk.stack import free_port, nats_server_binary


def _server(d: str, name: str, port: int, cluster: dict | None) -> tuple[subprocess.Popen, int]:
    http = free_port()
    conf = os.path.join(d, f"{name}.conf")
    text = (f'server_name: {name}\nlisten: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
            f'jetstream {{ store_dir: "{d}/{name}-js" }}\ninclude "auth/accounts.conf"\n')
    if cluster is not None:
        text += f"cluster {json.dumps(cluster)}\n"
    with open(conf, "w") as f:
        f.write(text)
    p = subprocess.Popen([nats_server_binary(), "-c", conf], stdout=subprocess.DEVNULL, stderr=open(f"{d}/{name}.log", "wb"))
    return p, http


def _wait_ready(http: int, p: subprocess.Popen) -> None:
    for _ in range(200):
        assert p.poll() is None, "nats-server exited"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz", timeout=1)
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("nats-server did not become ready")


async def _refused(errors: list[Exception]) -> bool:
    """Whether the server reported a permissions violation to this connection (within 2.5 s)."""
    for _ in range(50):
        if any("ermissions" in str(e) for e in errors):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.fixture
def rendered():
    d = tempfile.mkdtemp(prefix="crl-da-")
    a, b = free_port(), free_port()
    files = deployauth.render(f"{d}/auth", tenants=["alice"], routes=[f"127.0.0.1:{a}", f"127.0.0.1:{b}"], k8s=True)
    yield d, f"{d}/auth", (a, b), files
    subprocess.run(["rm", "-rf", d])


def test_keys_are_kept_and_files_private(rendered):
    d, out, _, files = rendered
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    before = {f: open(f).read() for f in files if f.endswith((".nk", ".creds"))}
    deployauth.render(out, tenants=["alice", "bob"], routes=[], k8s=True)
    assert all(open(f).read() == text for f, text in before.items()), "a second run replaced existing keys"
    assert os.path.exists(f"{out}/bob.creds")
    with open(f"{out}/accounts.conf") as f:
        text = f.read()
    # the server holds public keys only, never a seed
    assert all(open(f"{out}/{i}.nk").read().strip() not in text for i in deployauth.NKEY_IDENTITIES)
    assert all(deployauth.public_key(open(f"{out}/{i}.nk").read().strip()) in text for i in deployauth.NKEY_IDENTITIES)
    secrets = json.load(open(f"{out}/secrets.json"))
    names = {s["metadata"]["name"] for s in secrets["items"]}
    assert {"corral-nats-auth", "corral-nats-creds-scheduler", "corral-nats-creds-node-agent",
            "corral-nats-creds-image-loader", "corral-nats-creds-gateway", "corral-nats-creds-bob"} <= names
    with pytest.raises(Exception, match="invalid tenant name"):
        deployauth.render(out, tenants=["scheduler"])


async def test_a_deployment_bus_authenticates_every_connection(rendered):
    d, out, (ra, rb), _ = rendered
    with open(f"{out}/cluster.conf") as f:
        cluster = json.loads(f.read().removeprefix("cluster "))
    pa, pb = free_port(), free_port()
    procs = []
    try:
        for name, port, route in (("n1", pa, ra), ("n2", pb, rb)):
            p, http = _server(d, name, port, {**cluster, "listen": f"127.0.0.1:{route}"})
            procs.append((p, http))
        for p, http in procs:
            _wait_ready(http, p)
        # the two servers route to each other with the route secret
        for _ in range(100):
            routes = [json.load(urllib.request.urlopen(f"http://127.0.0.1:{h}/routez"))["num_routes"] for _, h in procs]
            if all(n >= 1 for n in routes):
                break
            await asyncio.sleep(0.1)
        assert all(n >= 1 for n in routes), routes
        url = f"nats://127.0.0.1:{pa}"
        # no credentials: refused
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)
        # a service by its nkey seed, as the SDK and services find it (CORRAL_NATS_CREDS)
        opts = auth.connect_options(url, creds=f"{out}/scheduler.nk")
        assert "nkeys_seed" in opts
        errors: list[Exception] = []

        async def on_error(e: Exception) -> None:
            errors.append(e)

        sched = await nats.connect(url, error_cb=on_error, **opts)
        info = await sched.jetstream().account_info()  # the CORRAL account has JetStream
        assert info is not None
        await sched.publish(subjects.NODE_HEARTBEAT, b"{}")  # node-agents' only
        await sched.flush()
        assert await _refused(errors), errors
        # a tenant by password: requests go out; another's traffic and corral.events do not come in
        tenant = await nats.connect(f"nats://127.0.0.1:{pb}", error_cb=on_error,
                                    **auth.connect_options(url, creds=f"{out}/alice.creds"))
        errors.clear()
        await tenant.subscribe(subjects.EVENTS_ALL)
        await tenant.flush()
        assert await _refused(errors), errors
        # a wrong seed is refused
        os.makedirs(f"{d}/scratch")
        with open(f"{d}/other.nk", "w") as f:
            f.write(deployauth.user_seed(f"{d}/scratch", "x"))
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0,
                               **auth.connect_options(url, creds=f"{d}/other.nk"))
        await sched.close()
        await tenant.close()
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(10)
