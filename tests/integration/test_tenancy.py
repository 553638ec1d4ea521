"""Tenants on the authenticated bus: the tenancy matrix (tenant B on tenant A's sandbox, for every
operation: forbidden and audited), what only the operator may do, isolation of the tenants'
traffic, identities that come from authentication and never from a field, and `corral tenant`."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys

import msgspec
import nats
import pytest

from corral_common import auth
from corral_common.contract import labels, subjects
from corral_common.contract.audit import AuditBatch
from corral_sdk import AsyncClient, Capacity, Forbidden
from corral_sdk.stackauth import add_tenant, revoke_tenant


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


async def _code(nc, subject: str, body: dict | None = None, timeout: float = 30) -> str:
    """The reply's error code ("" for a success)."""
    r = json.loads((await nc.request(subject, json.dumps(body or {}).encode(), timeout=timeout)).data)
    return "" if r.get("ok") else r["error"]["code"]


@pytest.fixture
async def two_tenants(stack):
    a, b = _name("ta"), _name("tb")
    creds = {n: add_tenant(stack.data_dir, n) for n in (a, b)}
    clients = {n: await AsyncClient.connect(stack.bus_url, creds=creds[n]) for n in (a, b)}
    yield a, b, clients, creds
    for n in (a, b):
        await clients[n].close()
        revoke_tenant(stack.data_dir, n)


async def test_tenancy_matrix_every_operation_on_anothers_sandbox(stack, client, two_tenants):
    a, b, clients, _ = two_tenants
    sb = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64, ttl_s=600, job="tenancy")
    try:
        assert sb.info.tenant == a
        assert (await sb.exec("echo mine")).stdout == "mine\n"
        nb = clients[b].nc
        audit_sub = await client.nc.jetstream().subscribe(subjects.audit(sb.info.node, sb.id), ordered_consumer=True)
        for op in subjects.SANDBOX_OPS:
            assert await _code(nb, subjects.sandbox_op(sb.id, op)) == "forbidden", op
        # the operator may do anything; the owner's sandbox is untouched by the attempts
        assert (await client.sandbox(sb.id).exec("echo operator")).stdout == "operator\n"
        assert (await sb.exec("cat /proc/1/cmdline | tr '\\0' ' '")).stdout.startswith("/.corral/init")
        # every refused attempt is an audit event of kind "access" naming the tenant and the op
        seen: set[str] = set()
        for _ in range(200):
            if seen >= set(subjects.SANDBOX_OPS):
                break
            try:
                m = await audit_sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            for e in msgspec.json.decode(m.data, type=AuditBatch).events:
                if e.kind == "access":
                    assert e.denied and e.detail["tenant"] == b and e.detail["owner"] == a, e
                    seen.add(e.op)
        assert seen == set(subjects.SANDBOX_OPS), seen
        await audit_sub.unsubscribe()
        # listing: each tenant sees its own, the operator all
        assert sb.id in {s.id for s in await clients[a].list()}
        assert sb.id not in {s.id for s in await clients[b].list()}
        assert sb.id in {s.id for s in await client.list()}
    finally:
        await sb.destroy()


async def test_identity_comes_from_authentication_not_from_fields(stack, client, two_tenants):
    a, b, clients, _ = two_tenants
    # B names A as the tenant in its spec: the sandbox is B's all the same, and A cannot touch it
    r = json.loads((await clients[b].nc.request(subjects.SANDBOX_CREATE, json.dumps(
        {"image": "busybox", "cpu": 0.2, "memory_mb": 64, "tenant": a}).encode(), timeout=60)).data)
    assert r["ok"] and r["sandbox"]["tenant"] == b, r
    sid = r["sandbox"]["id"]
    try:
        assert await _code(clients[a].nc, subjects.sandbox_op(sid, "exec"), {"cmd": "true"}) == "forbidden"
        # a forged Nats-Request-Info header is overwritten by the server
        m = await clients[a].nc.request(subjects.sandbox_op(sid, "exec"), b'{"cmd": "true"}', timeout=30,
                                        headers={"Nats-Request-Info": json.dumps({"acc": "TENANTS", "user": b})})
        assert json.loads(m.data)["error"]["code"] == "forbidden"
    finally:
        await client.sandbox(sid).destroy()
    # the same request id from two tenants: two sandboxes, neither reaches the other's
    rid = secrets.token_hex(6)
    sa = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64, request_id=rid)
    sb = await clients[b].create(image="busybox", cpu=0.2, memory_mb=64, request_id=rid)
    try:
        assert sa.id != sb.id and (sa.info.tenant, sb.info.tenant) == (a, b)
        again = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64, request_id=rid)
        assert again.id == sa.id  # still idempotent within a tenant
    finally:
        await sa.destroy()
        await sb.destroy()


async def test_a_tenants_jobs_are_its_own(stack, client, two_tenants):
    """Job names live under the tenant's name: the operator's quota on one tenant's job does not
    touch another's job of the same name, and listing by job sees one's own."""
    a, b, clients, _ = two_tenants
    await client.nc.request(subjects.QUOTA_SET, json.dumps({"job": f"{b}/shared", "sandboxes": 0}).encode(), timeout=10)
    sa = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64, job="shared")
    try:
        assert sa.info.job == f"{a}/shared"
        with pytest.raises(Capacity):
            await clients[b].create(image="busybox", cpu=0.2, memory_mb=64, job="shared")
        assert [s.id for s in await clients[a].list(job="shared")] == [sa.id]
        assert await clients[b].list(job="shared") == []
        used = json.loads((await clients[a].nc.request(subjects.QUOTA_GET, b'{"job": "shared"}', timeout=10)).data)
        assert used["ok"] and used["job"] == f"{a}/shared" and used["used"]["sandboxes"] == 1, used
    finally:
        await sa.destroy()


async def test_trajectories_and_grades_are_the_owners(stack, client, two_tenants):
    a, b, clients, _ = two_tenants
    tid = f"t{secrets.token_hex(5)}"
    sa = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64)
    sb = await clients[b].create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        r = await sa.exec("echo secret-output-of-a", trajectory=tid, step=0)
        assert r.stdout == "secret-output-of-a\n"
        nb = clients[b].nc
        assert await _code(nb, subjects.TRAJ_GET, {"id": tid}) == "forbidden"
        assert await _code(nb, subjects.TRAJ_DELETE, {"id": tid}) == "forbidden"
        assert await _code(nb, subjects.TRAJ_OPEN, {"id": tid, "sandbox_id": sb.id, "spec": {"image": "busybox"}}) == "forbidden"
        # replaying A's logged step from B's own sandbox would hand B A's output
        with pytest.raises(Forbidden):
            await sb.exec("echo secret-output-of-a", trajectory=tid, step=0)
        assert await _code(nb, subjects.sandbox_op(sb.id, "restore"), {"trajectory": tid}) == "forbidden"
        listed = json.loads((await nb.request(subjects.TRAJ_LIST, b"{}", timeout=30)).data)
        assert tid not in {t["id"] for t in listed["trajectories"]}
        assert await _code(clients[a].nc, subjects.TRAJ_GET, {"id": tid}) == ""
        assert await _code(nb, subjects.ENV_GRADE, {"sandbox_id": sa.id, "name": "any"}) == "forbidden"
    finally:
        await sa.destroy()
        await sb.destroy()
        await client.nc.request(subjects.TRAJ_DELETE, json.dumps({"id": tid}).encode(), timeout=30)


async def test_a_tenant_forwards_ports_of_its_own_sandboxes_only(stack, two_tenants):
    """Port forwards cross into the tenant's account: the frames follow the reply on its route."""
    a, b, clients, _ = two_tenants
    sb = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        r = await sb.exec("(while true; do nc -l -p 7000 -e /bin/cat; done) >/dev/null 2>&1 & "
                          "for i in $(seq 50); do netstat -ltn | grep -q :7000 && exit 0; sleep 0.1; done; exit 1",
                          session="srv")
        assert r.exit_code == 0, r
        reader, writer = await sb.connect_port(7000)
        writer.write(b"through the tenant's own route")
        await writer.drain()
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(-1), 30) == b"through the tenant's own route"
        writer.close()
        with pytest.raises(Forbidden):
            await clients[b].sandbox(sb.id).connect_port(7000)
    finally:
        await sb.destroy()


async def test_a_tenant_hears_the_alerts_on_its_own_sandboxes_only(stack, two_tenants):
    a, b, clients, creds = two_tenants
    sa = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        assert sa.info.labels.get(labels.TENANT) == a
        async with clients[a].alerts.subscribe(tenant=a) as mine, clients[b].alerts.subscribe(tenant=b) as theirs:
            await sa.exec("mount -t tmpfs x /mnt; true")
            got = await asyncio.wait_for(mine.__anext__(), 60)
            assert got.sandbox == sa.id and got.rule in ("denied_syscall", "denial_burst"), got
            await asyncio.sleep(1)
            assert theirs._queue.empty()
        # and B may not listen on A's subject at all
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e).lower())

        nb = await nats.connect(stack.bus_url, error_cb=on_error, max_reconnect_attempts=0,
                                **auth.connect_options(stack.bus_url, creds[b]))
        await nb.subscribe(subjects.tenant_alerts(a))
        await nb.flush()
        for _ in range(100):
            if any("permissions violation" in e for e in errors):
                break
            await asyncio.sleep(0.05)
        assert any("permissions violation" in e for e in errors), errors
        await nb.close()
    finally:
        await sa.destroy()


async def test_a_tenant_follows_its_own_batchs_progress(stack, two_tenants):
    """A tenant may not subscribe to corral.events; its create_batch progress arrives on the
    request's own reply route, and another tenant can neither hear it nor the operator's events."""
    a, b, clients, _ = two_tenants
    got = []
    sbs = await clients[a].create_batch(3, cpu=0.05, memory_mb=32, ttl_s=300, job="progress", progress=got.append)
    try:
        assert len(sbs) == 3 and all(sb.info.tenant == a for sb in sbs)
        assert got and got[-1].done and (got[-1].placed, got[-1].total) == (3, 3), got
        assert [g.placed for g in got] == sorted(g.placed for g in got)
        # the other tenant: no subscription to the operator's event subjects (the server refuses it)
        errors: list[Exception] = []

        async def on_error(e: Exception) -> None:
            errors.append(e)

        nb = await nats.connect(stack.bus_url, error_cb=on_error, **auth.connect_options(stack.bus_url, creds=two_tenants[3][b]))
        try:
            await nb.subscribe(subjects.batch_event(got[-1].batch_id, "*"))
            await nb.flush()
            for _ in range(50):
                if errors:
                    break
                await asyncio.sleep(0.05)
            assert any("ermissions" in str(e) for e in errors), errors
        finally:
            await nb.close()
    finally:
        for sb in sbs:
            await sb.destroy()


async def test_what_only_the_operator_may_do(stack, two_tenants):
    a, _, clients, _ = two_tenants
    na = clients[a].nc
    refused = {
        subjects.IMAGE_IMPORT: {"name": "x", "source": "dir", "path": "/etc"},  # would read the host's /etc
        subjects.IMAGE_DELETE: {"name": "busybox"},
        subjects.MONITOR_QUERY: {"sql": "SELECT count() FROM audit"},
        subjects.MONITOR_EVALUATE: {"sandbox_id": "sb-x"},
        subjects.QUOTA_SET: {"job": "j", "max_sandboxes": 1000},
        subjects.ENV_DELETE: {"name": "x"},
        subjects.ENV_BUILD: {"spec": {"name": "x"}},
    }
    for subject, body in refused.items():
        assert await _code(na, subject, body) == "forbidden", subject
    for subject, body in ((subjects.IMAGE_LIST, {}), (subjects.QUOTA_GET, {"job": "j"}), (subjects.ENV_LIST, {}),
                          (subjects.MONITOR_RULES, {})):
        assert await _code(na, subject, body) in ("", "not_found"), subject  # served, not refused
    assert (await clients[a].run("echo one-shot", cpu=0.2, memory_mb=64)).stdout == "one-shot\n"


async def test_tenants_see_nothing_but_their_own_replies(stack, client, two_tenants):
    a, b, clients, _ = two_tenants
    heard: list[str] = []

    async def on_msg(m) -> None:
        heard.append(m.subject)

    for sub in (subjects.EVENTS_ALL, subjects.sandbox_all("*"), "_INBOX.>", subjects.kv_key("*", ">"), ">"):
        await clients[b].nc.subscribe(sub, cb=on_msg)
    await clients[b].nc.flush()
    sa = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64)
    await sa.exec("echo traffic")
    await sa.destroy()
    await client.nc.publish(subjects.NODE_HEARTBEAT + ".x", b"{}")
    await asyncio.sleep(0.5)
    assert heard == [], heard
    # no JetStream, so no stream, bucket or object store, in a tenant's account
    with pytest.raises(Exception):
        await clients[b].nc.jetstream().key_value(subjects.KV_ENVS)


def test_corral_tenant_cli_add_list_revoke(stack):
    name = _name("tc")
    corral = os.path.join(os.path.dirname(sys.executable), "corral")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([corral, "tenant", *args, "--data-dir", stack.data_dir], capture_output=True, text=True, timeout=60)

    p = run("add", name)
    assert p.returncode == 0, p.stderr
    creds = p.stdout.strip()
    assert os.stat(creds).st_mode & 0o777 == 0o600
    assert name in run("list").stdout.split()
    assert run("add", name).returncode == 1  # exists
    assert run("add", "Bad Name").returncode == 1

    async def connected_then_revoked() -> None:
        c = await AsyncClient.connect(stack.bus_url, creds=creds)
        assert await c.list() is not None
        assert run("revoke", name).returncode == 0
        for _ in range(100):
            if not c.nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert not c.nc.is_connected  # closed at once by the reload
        await c.nc.close()
        with pytest.raises(Exception):
            await AsyncClient.connect(stack.bus_url, creds=creds)

    asyncio.run(connected_then_revoked())
    assert name not in run("list").stdout.split()
    assert run("revoke", name).returncode == 1
