"""The grader's view of a sandbox: `changes` (its writable layer, read host-side, packed) and
`audit` (every audit event published, losses counted per sandbox)."""
from __future__ import annotations

import asyncio
import base64
import io
import secrets
import tarfile
import time

import msgspec
import pytest

from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
from corral_common.contract.errors import InvalidRequest, NotFound
from corral_common.contract.messages import ChangesReply

from ..auditstream import stored


def _members(reply: ChangesReply) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    if not reply.archive_b64:
        return {}
    out = {}
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(reply.archive_b64)), mode="r:gz") as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m) if m.isreg() else None
            out[m.name] = (m, f.read() if f else None)
    return out


def _by_path(reply: ChangesReply) -> dict[str, object]:
    return {c.path: c for c in reply.changes}


async def test_changes_lists_the_writable_layer_and_packs_only_what_is_included(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
    try:
        await check_listing_and_packing(sb)
    finally:
        await sb.destroy()


async def check_listing_and_packing(sb) -> None:
    """Edits, a deletion, an opaque dir, links, a FIFO and an odd name, listed and packed (also run
    on guests, whose writable layer is read by their agent: test_microvm.py)."""
    r = await sb.exec(
        "set -e; mkdir -p /work/pkg /work/skip && echo hello > /work/pkg/a.txt && printf 'run\\n' > /work/pkg/run.sh && "
        "chmod 750 /work/pkg/run.sh && echo secret > /work/skip/s.txt && "
        "echo edited > /etc/hostname && rm /etc/group && "  # an edit and a deletion of image files
        "rm -rf /var && mkdir /var && echo v > /var/new && "  # an image dir replaced: opaque
        "ln -s /etc/shadow /work/pkg/shadow && ln -s / /work/pkg/root && mkfifo /work/pkg/fifo && "
        "echo odd > \"$(printf '/work/pkg/new\\nline\\377x')\" && echo done")
    assert r.stdout == "done\n", (r.stdout, r.stderr)
    reply = await sb.changes(include=["/work/pkg"], exclude=["/work/skip"])
    ch = _by_path(reply)
    assert ch["/work/pkg/a.txt"].kind == "file" and ch["/work/pkg/a.txt"].size == 6
    assert ch["/work/pkg/run.sh"].mode == 0o750
    assert ch["/etc/hostname"].kind == "file"
    assert ch["/etc/group"].kind == "deleted"
    assert ch["/var"].kind == "dir" and ch["/var"].opaque and ch["/var/new"].kind == "file"
    assert not ch["/etc"].opaque  # copied up for the edits inside: the image's entries remain
    assert ch["/work/pkg/shadow"].kind == "symlink" and ch["/work/pkg/shadow"].target == "/etc/shadow"
    assert ch["/work/pkg/root"].kind == "symlink" and ch["/work/pkg/root"].target == "/"
    assert ch["/work/pkg/fifo"].kind == "other"
    assert ch["/work/pkg/new\nline\\xffx"].kind == "file"  # undecodable bytes as \xNN
    assert not any(p.startswith("/work/skip") for p in ch)  # excluded from the listing
    assert not reply.truncated and not reply.too_large

    mem = _members(reply)
    assert set(mem) == {"work/pkg/a.txt", "work/pkg/run.sh", "work/pkg/shadow", "work/pkg/root",
                        "work/pkg/new\nline\udcffx"}, sorted(mem)
    assert reply.packed == len(mem)
    assert mem["work/pkg/a.txt"][1] == b"hello\n"
    assert mem["work/pkg/run.sh"][1] == b"run\n" and mem["work/pkg/run.sh"][0].mode == 0o750
    assert mem["work/pkg/new\nline\udcffx"][1] == b"odd\n"
    for name in ("work/pkg/shadow", "work/pkg/root"):  # links, never what they point at
        m, data = mem[name]
        assert m.issym() and data is None
    assert mem["work/pkg/shadow"][0].linkname == "/etc/shadow"
    for m, _ in mem.values():
        assert m.uid == 0 and m.gid == 0 and not m.isdev() and not m.islnk() and not m.isfifo()

    # nothing included: a listing without an archive; the sandbox runs on afterwards
    bare = await sb.changes()
    assert bare.archive_b64 == "" and bare.packed == 0 and "/etc/group" in _by_path(bare)
    assert (await sb.exec("echo alive")).stdout == "alive\n"
    assert (await sb.refresh()).state == "running"


async def test_changes_honour_max_archive_bytes_and_max_entries(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=256, ttl_s=600, disk_mb=256)
    try:
        r = await sb.exec("mkdir /out && for i in 1 2 3; do head -c 300000 /dev/urandom > /out/r$i; done && "
                          "head -c 2000000 /dev/zero > /out/zeros && echo ok")
        assert r.stdout == "ok\n", r.stderr
        reply = await sb.changes(include=["/out"], max_archive_bytes=700_000)
        raw = base64.b64decode(reply.archive_b64)
        assert len(raw) <= 700_000
        mem = _members(reply)
        # zeros compress to almost nothing; two random files fit, the third does not
        assert "out/zeros" in mem and mem["out/zeros"][1] == b"\0" * 2_000_000
        assert len([n for n in mem if n.startswith("out/r")]) == 2 and len(reply.too_large) == 1
        assert reply.too_large[0].startswith("/out/r") and reply.too_large[0].lstrip("/") not in mem

        few = await sb.changes(max_entries=2)
        assert few.truncated and len(few.changes) == 2
    finally:
        await sb.destroy()


async def test_changes_while_a_background_process_keeps_writing(client):
    """The walk freezes the sandbox: a writer churning files cannot break it, and runs on after."""
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
    try:
        # /churn/n is replaced by rename (atomic): a walk of a frozen sandbox then always finds a
        # whole number in it; with `echo $i > n` a freeze between its truncate and its write would
        # rightly show an empty file
        await sb.exec("mkdir /churn && (i=0; while :; do i=$((i+1)); echo $i > /churn/n.new; mv /churn/n.new /churn/n; echo x >> /churn/log; "
                      "touch /churn/f$((i % 50)); rm -f /churn/f$(((i + 25) % 50)); done) >/dev/null 2>&1 &")
        # until its first round is whole, a walk rightly finds only /churn/n.new (a clean clone
        # once froze it there, the writer just started)
        await sb.exec("while [ ! -s /churn/log ]; do sleep 0.01; done", timeout_s=30)
        for _ in range(5):
            reply = await sb.changes(include=["/churn"])
            mem = _members(reply)
            assert "churn/n" in mem and "churn/log" in mem
            n = int(mem["churn/n"][1])  # a consistent file, not a torn write
            assert n >= 1
        r1 = await sb.exec("cat /churn/n")
        await asyncio.sleep(0.3)
        r2 = await sb.exec("cat /churn/n")
        assert int(r2.stdout) > int(r1.stdout)  # thawed: the writer goes on

        # a paused sandbox stays paused
        await sb.pause()
        await sb.changes()
        assert (await sb.refresh()).state == "paused"
        a = await sb.changes(include=["/churn"])
        b = await sb.changes(include=["/churn"])
        assert _members(a)["churn/n"][1] == _members(b)["churn/n"][1]  # nothing ran in between
        await sb.resume()
    finally:
        await sb.destroy()


async def test_changes_errors(client, sandbox):
    with pytest.raises(NotFound):
        await client.sandbox("sb-000000000000").changes()
    with pytest.raises(InvalidRequest):
        await sandbox.changes(include=["relative/path"])
    with pytest.raises(InvalidRequest):
        await sandbox.changes(max_archive_bytes=64 * 1024 * 1024)
    with pytest.raises(NotFound):
        await client.sandbox("sb-000000000000").audit_state()


async def test_audit_state_covers_the_stream(client, nc):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
    try:
        r = await sb.exec("cat /etc/passwd /etc/hosts >/dev/null && echo x > /tmp/x && echo ok")
        assert r.stdout == "ok\n"
        st = await sb.audit_state()
        assert st.last_seq > 0 and st.published > 0 and st.lost == 0 and not st.reasons
        js = nc.jetstream()
        last = await js.get_last_msg("CORRAL_AUDIT", subjects.audit(sb.info.node, sb.id))
        assert last.seq <= st.last_seq
        # everything up to last_seq is there: the exec event among it, nothing of ours after it
        events = []
        for m in await stored(js, subjects.audit(sb.info.node, sb.id)):
            assert m.metadata.sequence.stream <= st.last_seq
            events.extend(msgspec.json.decode(m.data, type=AuditBatch).events)
        assert any(e.kind == "exec" and "cat /etc/passwd" in e.cmd for e in events)
        assert len(events) == st.published

        await sb.exec("true")
        again = await sb.audit_state()
        assert again.last_seq > st.last_seq and again.published > st.published
    finally:
        await sb.destroy()


async def test_audit_log_counts_losses_per_sandbox_and_publishes_them(nc):
    """Past max_buffer the oldest events of the sandbox holding the most are dropped (a flood
    loses its own, never a quieter neighbour's), counted against it, and told as a `loss` event
    that the cap never drops."""
    from corral_node_agent.audit.log import BUFFER_FULL, AuditLog

    js = nc.jetstream()
    a, b = f"sb-lossa-{secrets.token_hex(4)}", f"sb-lossb-{secrets.token_hex(4)}"
    log = AuditLog(js, "node-t", max_buffer=3)
    for i in range(7):
        log.emit(AuditEvent(id=event_id(), ts=time.time(), node="node-t", sandbox=a, kind="exec", cmd=f"a {i}"))
    log.emit(AuditEvent(id=event_id(), ts=time.time(), node="node-t", sandbox=b, kind="exec", cmd="b 0"))
    # a's last two and b's one remain: a lost 5, b none
    sa, sb_ = await log.sync(a), await log.sync(b)
    assert sa.lost == 5 and sa.reasons == [BUFFER_FULL] and sa.published == 3 and sa.last_seq > 0
    assert sb_.lost == 0 and not sb_.reasons and sb_.published == 1
    last = await js.get_last_msg("CORRAL_AUDIT", subjects.audit("node-t", a))
    assert last.seq == sa.last_seq
    events = [e for m in await stored(js, subjects.audit("node-t", a))
              for e in msgspec.json.decode(m.data, type=AuditBatch).events]
    assert [(e.kind, e.cmd or e.detail) for e in events] == [("loss", {"reason": BUFFER_FULL, "count": "5"}),
                                                            ("exec", "a 5"), ("exec", "a 6")]

    log.loss(b, "node-agent restarted", 0)  # a gap of unknown size counts as one
    sb2 = await log.sync(b)
    assert sb2.lost == 1 and sb2.reasons == ["node-agent restarted"] and sb2.last_seq > sb_.last_seq


async def test_a_sandbox_adopted_by_a_restarted_agent_reports_an_audit_gap():
    """While no agent ran, nothing of the sandbox was audited: its audit state says so, and a
    `loss` event on its stream lets the monitor say so too."""
    import os
    import signal

    import nats

    from corral_sdk import AsyncClient

    from ..conftest import running_stack
    from .test_crash import _wait_node

    async with running_stack(nodes=1) as stack:
        node = "node-1"
        c = await AsyncClient.connect(stack.url)
        nc = await nats.connect(stack.url)
        try:
            sb = await c.create(image="busybox", cpu=0.1, memory_mb=32)
            await sb.exec("echo before")
            before = await sb.audit_state()
            assert before.lost == 0 and not before.reasons

            agent = stack.proc(node).popen
            os.kill(agent.pid, signal.SIGKILL)
            agent.wait()
            stack.restart(node)
            await _wait_node(stack.url, node)

            after = await sb.audit_state()
            assert after.lost >= 1 and "node-agent restarted" in after.reasons, after
            last = await nc.jetstream().get_last_msg("CORRAL_AUDIT", subjects.audit(node, sb.id))
            assert last.seq <= after.last_seq
            losses = [e for e in msgspec.json.decode(last.data, type=AuditBatch).events if e.kind == "loss"]
            assert losses and losses[0].detail["reason"] == "node-agent restarted"
            await sb.destroy()
        finally:
            await nc.close()
            await c.close()


async def test_rate_limited_file_events_are_a_loss_the_audit_state_reports_at_once():
    """audit drains the fanotify queue and reports this sandbox's drops now, not on the next tick:
    right after the exec, its state counts them and a `loss` event is on its stream."""
    import nats

    from corral_sdk import AsyncClient

    from ..conftest import running_stack

    async with running_stack(nodes=1, monitor=False, node_args=["--file-events-rate", "50", "--file-events-burst", "200"]) as stack:
        c = await AsyncClient.connect(stack.url)
        nc = await nats.connect(stack.url)
        try:
            sb = await c.create(image="busybox", cpu=0.5, memory_mb=128)
            r = await sb.exec("mkdir /tmp/many && cd /tmp/many && i=0; while [ $i -lt 2000 ]; do : > f$i; i=$((i+1)); done; echo ok",
                              timeout_s=120)
            assert r.stdout == "ok\n", r
            st = await sb.audit_state()
            assert st.lost > 0 and set(st.reasons) & {"file events rate-limited", "fanotify queue overflow"}, st
            events = [e for m in await stored(nc.jetstream(), subjects.audit(sb.info.node, sb.id))
                      for e in msgspec.json.decode(m.data, type=AuditBatch).events]
            losses = [e for e in events if e.kind == "loss"]
            assert sum(int(e.detail["count"]) for e in losses) == st.lost
            await sb.destroy()
        finally:
            await nc.close()
            await c.close()
