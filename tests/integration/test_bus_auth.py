"""The embedded stack's bus authenticates every connection and the server enforces what each
service identity may do (stackauth.py): tried as an attacker holding one service's credentials
would, each refusal checked against a control that the same call works for whoever may make it."""
from __future__ import annotations

import asyncio
import os
import stat

import nats
import pytest
from nats.errors import NoServersError

from corral_common import auth
from corral_common.contract import subjects
from corral_sdk import stackauth


async def _as(stack, identity: str):
    """A connection as `identity`, and the permission violations the server reports to it."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(stack.bus_url, error_cb=on_error, max_reconnect_attempts=0,
                            **auth.connect_options(stack.bus_url, auth.creds_path(identity, stack.data_dir)))
    return nc, errors


async def _violation(errors: list[str], subject: str, timeout: float = 5.0) -> str:
    for _ in range(int(timeout / 0.05)):
        hit = next((e for e in errors if "permissions violation" in e.lower() and subject.lower() in e.lower()), None)
        if hit:
            return hit
        await asyncio.sleep(0.05)
    return ""


async def _refused(nc, errors, subject: str, *, subscribe: bool = False) -> bool:
    if subscribe:
        await nc.subscribe(subject)
    else:
        await nc.publish(subject, b"{}")
    await nc.flush()
    return bool(await _violation(errors, subject))


async def test_connections_without_valid_credentials_are_refused(stack):
    for kw in ({}, {"user": "admin", "password": "wrong"}, {"user": "nobody", "password": "x"}):
        with pytest.raises((NoServersError, nats.errors.Error, OSError)) as e:
            await nats.connect(stack.bus_url, max_reconnect_attempts=0, connect_timeout=3, allow_reconnect=False, **kw)
        assert "uthoriz" in repr(e.value) or isinstance(e.value, NoServersError), repr(e.value)
    # the operator's URL (what stack.url is) gets in
    nc = await nats.connect(stack.url)
    assert nc.is_connected
    await nc.close()


def test_credentials_are_private_files(stack):
    d = os.path.join(stack.data_dir, auth.AUTH_DIR)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    names = sorted(os.listdir(d))
    assert "nats.conf" in names and "admin.creds" in names and "node-agent.creds" in names, names
    for n in names:
        mode = os.stat(os.path.join(d, n)).st_mode
        assert stat.S_IMODE(mode) == (0o700 if stat.S_ISDIR(mode) else 0o600), n


async def test_hidden_tests_are_readable_only_by_the_env_builder(stack):
    kv_subject = subjects.kv_key(subjects.KV_ENVS, ">")
    info = subjects.js_api("STREAM.INFO", subjects.kv_stream(subjects.KV_ENVS))
    for identity in ("node-agent", "scheduler", "monitor", "image-cache", "image-loader"):
        nc, errors = await _as(stack, identity)
        try:
            assert await _refused(nc, errors, kv_subject, subscribe=True), (identity, errors)
            assert await _refused(nc, errors, info), (identity, errors)
            assert await _refused(nc, errors, subjects.js_api("DIRECT.GET", subjects.kv_stream(subjects.KV_ENVS))), (identity, errors)
        finally:
            await nc.close()
    # the control: the owner reads its bucket, in the catalog's own account, with its second identity
    nc, errors = await _as(stack, stackauth.CATALOG)
    try:
        kv = await nc.jetstream().key_value(subjects.KV_ENVS)
        assert kv is not None and not await _violation(errors, info, timeout=0.5), errors
    finally:
        await nc.close()


async def test_no_identity_of_the_shared_account_can_reach_the_catalog_sideways(stack):
    """JetStream has no per-stream create or source rights: in an account holding the catalog, any
    identity could make a stream of its own sourcing it and read the copy. The catalog is in no
    such account: the operator, unrestricted in CORRAL, finds no catalog stream there, and a
    stream sourcing one by name (made by a service identity) stays empty while the catalog has
    entries."""
    from nats.js.api import StreamConfig, StreamSource
    from nats.js.errors import NotFoundError

    cat, _ = await _as(stack, stackauth.CATALOG)
    try:
        kv = await cat.jetstream().key_value(subjects.KV_ENVS)
        await kv.put("probe.v1", b'{"hidden": "answer"}')
    finally:
        await cat.close()
    admin = await nats.connect(stack.url)
    try:
        with pytest.raises(NotFoundError):
            await admin.jetstream().stream_info(subjects.kv_stream(subjects.KV_ENVS))
    finally:
        await admin.close()
    nc, errors = await _as(stack, "scheduler")
    js = nc.jetstream()
    try:
        await js.add_stream(StreamConfig(name="STEAL", subjects=[], sources=[StreamSource(name=subjects.kv_stream(subjects.KV_ENVS))]))
        await asyncio.sleep(1.0)
        assert (await js.stream_info("STEAL")).state.messages == 0
    finally:
        await js.delete_stream("STEAL")
        await nc.close()
    cat, _ = await _as(stack, stackauth.CATALOG)
    try:
        await (await cat.jetstream().key_value(subjects.KV_ENVS)).delete("probe.v1")
    finally:
        await cat.close()


async def test_services_cannot_forge_heartbeats_audit_or_alerts_or_delete_audit(stack):
    forged = {
        subjects.NODE_HEARTBEAT: ("scheduler", "monitor", "image-cache", "env-builder", "image-loader", "gateway"),
        subjects.audit("node-1", "sb-x"): ("scheduler", "monitor", "image-cache", "env-builder", "gateway"),
        subjects.alert("critical", "forged"): ("scheduler", "node-agent", "image-cache", "env-builder", "gateway"),
        subjects.kv_key(subjects.KV_ENVS, "x"): ("gateway",),
    }
    for subject, identities in forged.items():
        for identity in identities:
            nc, errors = await _as(stack, identity)
            try:
                assert await _refused(nc, errors, subject), (identity, subject, errors)
            finally:
                await nc.close()
    for identity in ("node-agent", "monitor", "scheduler"):
        nc, errors = await _as(stack, identity)
        try:
            for api in subjects.stream_erasure("CORRAL_AUDIT"):
                assert await _refused(nc, errors, api), (identity, api, errors)
        finally:
            await nc.close()
    # controls: the rightful publishers are not refused
    for identity, subject in (("node-agent", subjects.NODE_HEARTBEAT + ".probe"), ("monitor", subjects.alert("low", "probe"))):
        nc, errors = await _as(stack, identity)
        try:
            await nc.publish(subject, b"{}")
            await nc.flush()
            assert not await _violation(errors, subject, timeout=0.5), (identity, errors)
        finally:
            await nc.close()


async def test_the_gateway_reaches_only_sandboxes_it_made(stack, client):
    """The gateway (facing HTTP clients) is a user of the TENANTS account allowed sandbox requests
    only: nothing else on the bus, and only its own sandboxes (another's is `forbidden`)."""
    nc, errors = await _as(stack, "gateway")
    other = await client.create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        for subject in (subjects.QUOTA_SET, subjects.IMAGE_IMPORT, subjects.MONITOR_QUERY, subjects.ENV_GRADE,
                        subjects.NODE_HEARTBEAT):
            assert await _refused(nc, errors, subject), (subject, errors)
        assert await _refused(nc, errors, subjects.EVENTS_ALL, subscribe=True), errors
        r = await nc.request(subjects.SANDBOX_RUN, b'{"exec": {"cmd": "echo hi"}, "spec": {"image": "busybox"}}', timeout=60)
        assert b'"ok":true' in r.data and b"hi" in r.data, r.data
        r = await nc.request(subjects.sandbox_op(other.id, "exec"), b'{"cmd": "echo x"}', timeout=30)
        assert b'"forbidden"' in r.data, r.data
    finally:
        await other.destroy()
        await nc.close()
