"""The SDK, async and sync, against the real stack."""
from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from corral_common.contract import subjects
from corral_sdk import Client, ExecChunk, ExecResult, InvalidRequest, NotFound, Sandbox


async def test_async_context_manager_destroys(client):
    async with await client.create(image="busybox", cpu=0.1, memory_mb=32, labels={"k": "v"}) as sb:
        r = await sb.exec(["sh", "-c", "echo $0", "argv0"])
        assert r.stdout == "argv0\n"
        sid = sb.id
        assert any(i.id == sid for i in await client.list(labels={"k": "v"}))
    with pytest.raises(NotFound):
        await client.sandbox(sid).exec("true")


async def test_exec_stream_yields_chunks_before_the_end(client, sandbox):
    seen: list[tuple[float, object]] = []
    async for item in sandbox.exec_stream("echo start; sleep 1; echo end"):
        seen.append((time.monotonic(), item))
    chunks = [(t, i) for t, i in seen if isinstance(i, ExecChunk)]
    final_t, final = seen[-1]
    assert isinstance(final, ExecResult) and final.stdout == "start\nend\n"
    assert chunks[0][1].data == "start\n"
    # the first chunk arrived well before the command ended: streaming, not buffering
    assert final_t - chunks[0][0] > 0.5


async def test_files_roundtrip_and_errors(sandbox):
    await sandbox.files.write("/tmp/a.txt", "hé")
    assert await sandbox.files.read_text("/tmp/a.txt") == "hé"
    with pytest.raises(NotFound):
        await sandbox.files.read("/tmp/none")
    with pytest.raises(InvalidRequest):
        await sandbox.files.read("/tmp")


async def test_invalid_spec_is_a_typed_error(client):
    with pytest.raises(InvalidRequest, match="substrate"):
        await client.create(image="busybox", substrate="nonsense")


async def test_ttl_expiry_destroys_and_publishes_events(client, stack):
    nc = await nats.connect(stack.url)
    events: list[dict] = []

    async def on_event(m) -> None:
        events.append(json.loads(m.data))

    sub = await nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_event)
    try:
        sb = await client.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=1.0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e["kind"] == "destroyed" and e["sandbox_id"] == sb.id for e in events):
            await asyncio.sleep(0.1)
        kinds = [e["kind"] for e in events if e["sandbox_id"] == sb.id]
        assert kinds == ["created", "ready", "destroyed"], kinds
        assert [e for e in events if e["sandbox_id"] == sb.id][-1]["reason"] == "ttl expired"
        with pytest.raises(NotFound):
            await sb.exec("true")
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_events_are_in_jetstream(client, stack):
    sb = await client.create(image="busybox", cpu=0.1, memory_mb=32)
    await sb.destroy()
    nc = await nats.connect(stack.url)
    try:
        js = nc.jetstream()
        psub = await js.subscribe(subjects.event(sb.id, "*"), ordered_consumer=True)
        kinds = []
        for _ in range(3):
            m = await psub.next_msg(timeout=5)
            kinds.append(json.loads(m.data)["kind"])
        assert kinds == ["created", "ready", "destroyed"]
    finally:
        await nc.close()


def test_sync_client(stack):
    with Client(stack.url) as c:
        with c.create(image="busybox", cpu=0.1, memory_mb=32) as sb:
            assert sb.exec("echo sync").stdout == "sync\n"
            sb.files.write("/x", b"1")
            assert sb.files.read("/x") == b"1"
            items = list(sb.exec_stream("echo a; echo b >&2"))
            assert isinstance(items[-1], ExecResult) and items[-1].stdout == "a\n" and items[-1].stderr == "b\n"
        batch = c.create_batch(3, image="busybox", cpu=0.1, memory_mb=32, job="sync-batch")
        assert len({s.id for s in batch}) == 3
        assert {i.id for i in c.list(job="sync-batch")} == {s.id for s in batch}
        for s in batch:
            s.destroy()
        assert c.list(job="sync-batch") == []


def test_sync_sandbox_own_connection(stack):
    sb = Sandbox.create(image="busybox", cpu=0.1, memory_mb=32, nats_url=stack.url)
    try:
        assert sb.exec("echo own").stdout == "own\n"
    finally:
        sb.destroy()


async def test_nats_url_from_environment(stack, monkeypatch):
    from corral_sdk import AsyncClient

    monkeypatch.setenv("CORRAL_NATS_URL", stack.url)
    c = await AsyncClient.connect()
    try:
        assert isinstance(await c.list(), list)
    finally:
        await c.close()


async def test_concurrent_requests_same_request_id_make_one_sandbox(client):
    results = await asyncio.gather(*(client.create(image="busybox", cpu=0.1, memory_mb=32, request_id="race-1") for _ in range(5)))
    assert len({r.id for r in results}) == 1
    await results[0].destroy()


async def test_every_exec_is_audited_on_jetstream(client, stack):
    import msgspec

    from corral_common.contract.audit import AuditBatch

    sb = await client.create(image="busybox", cpu=0.1, memory_mb=32, job="audited")
    await sb.exec("echo one", cwd="/tmp")
    await sb.exec(["ls", "/"], session="s1")
    await sb.destroy()
    nc = await nats.connect(stack.url)
    try:
        psub = await nc.jetstream().subscribe(subjects.audit("node-1", sb.id), ordered_consumer=True)
        events = []
        while len(events) < 2:  # (file activity of the same sandbox comes on the same subject)
            m = await psub.next_msg(timeout=5)
            events += [e for e in msgspec.json.decode(m.data, type=AuditBatch).events if e.kind == "exec"]
        assert [(e.kind, e.cmd, e.exit_code, e.job) for e in events] == [("exec", "echo one", 0, "audited"), ("exec", "ls /", 0, "audited")]
        assert events[0].cwd == "/tmp" and events[1].session == "s1" and events[0].stdout_bytes == 4
        assert len({e.id for e in events}) == 2
    finally:
        await nc.close()
