"""Network attempts and signals seen by the kernel (seccomp notify, audit/seccomp.py), pids-limit
hits and OOM kills (the sandbox's cgroup counters), each from a real sandbox doing the thing, with
a benign counterpart that must stay quiet."""
from __future__ import annotations

import asyncio
import time

from corral_common.contract import subjects

from ..auditstream import stored
from .test_audit_sources import Watch

PY = "debian"


async def test_network_attempts_are_kernel_events(client, nc):
    sb = await client.create(image=PY, cpu=0.5, memory_mb=256, ttl_s=600, job="audit-kernel")
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            # benign: a server on loopback and a client talking to it
            r = await sb.exec("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
                              "c=socket.create_connection(s.getsockname()); print('local ok')\"")
            assert r.stdout == "local ok\n", r.stderr
            # the attempt fails (only lo), but the kernel saw it
            r = await sb.exec("python3 -c \"import socket; s=socket.socket(); s.connect(('1.2.3.4', 80))\"")
            assert r.exit_code != 0 and "unreachable" in r.stderr, r.stderr
            r = await sb.exec("python3 -c \"import socket; s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); "
                              "s.sendto(b'x', ('2001:db8::1', 53))\"")
            assert r.exit_code != 0, r.stderr
            await w.until(lambda: {"1.2.3.4:80", "[2001:db8::1]:53"} <= {e.target for e in w.of("net")}, what="net events")
            c = next(e for e in w.of("net") if e.target == "1.2.3.4:80")
            assert c.op == "connect" and c.comm.startswith("python") and c.pid > 1 and not c.denied and c.detail["port"] == "80"
            assert next(e for e in w.of("net") if e.target.startswith("[2001")).op == "sendto"
            assert all(not e.target.startswith("127.") for e in w.of("net"))
            await w.until(lambda: "network_egress" in {a.rule for a in w.alerts}, what="network_egress alert")
            assert any(a.evidence and a.evidence[0].kind == "net" for a in w.alerts if a.rule == "network_egress")
    finally:
        await sb.destroy()


async def test_signals_to_processes_the_exec_did_not_start(client, nc):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600, job="audit-kernel")
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            # benign: signals within one exec (a child, a background job of the same command)
            r = await sb.exec("sleep 30 & kill $!; wait; (sleep 31 & echo $! > /tmp/p); kill $(cat /tmp/p); echo ok")
            assert r.stdout.strip().endswith("ok"), (r.stdout, r.stderr)
            assert (await sb.exec("pidof sleep")).stdout == ""  # both gone
            # a "grader" started by another exec, killed from this one
            await sb.exec("sleep 300 >/dev/null 2>&1 &")
            r = await sb.exec("kill -TERM $(pidof sleep); kill -9 1; echo rc=$?")
            assert "rc=1" in r.stdout, (r.stdout, r.stderr)  # init is protected: EPERM
            await w.until(lambda: {e.target for e in w.of("signal")} >= {"1"} and len(w.of("signal")) >= 2, what="signal events")
            init = next(e for e in w.of("signal") if e.target == "1")
            assert init.denied and init.detail["signal"] == "SIGKILL" and init.comm in ("sh", "kill")  # a shell builtin
            grader = next(e for e in w.of("signal") if e.target != "1")
            assert grader.detail["signal"] == "SIGTERM" and grader.detail.get("target_comm") == "sleep" and not grader.denied
            assert len(w.of("signal")) == 2, [(e.target, e.detail) for e in w.of("signal")]  # the benign ones made none
            await w.until(lambda: "kill_foreign_process" in {a.rule for a in w.alerts}, what="kill alert")
            assert any(a.evidence and a.evidence[0].kind == "signal" for a in w.alerts if a.rule == "kill_foreign_process")
    finally:
        await sb.destroy()


async def test_pids_limit_hits_and_oom_kills_are_events(client, nc):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=64, pids_max=32, ttl_s=600, job="audit-kernel")
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            # benign: a handful of processes and a modest allocation stay under both limits
            r = await sb.exec("for i in 1 2 3 4; do sleep 0.1 & done; wait; x=$(head -c 1000000 /dev/zero | tr '\\0' a); echo ${#x}")
            assert r.stdout.strip() == "1000000"
            # a loop that forks until the limit refuses
            t_bomb = time.time()
            r = await sb.exec("(for i in $(seq 1 80); do sleep 1000 >/dev/null 2>&1 & done) 2>/dev/null; true", timeout_s=30)
            await w.until(lambda: bool(w.of("pids")), what="pids event")
            ev = w.of("pids")[0]
            assert ev.op == "pids_limit" and ev.detail["limit"] == "32" and int(ev.detail["hits"]) >= 1
            assert "seq 1 80" in ev.detail.get("cmd", "seq 1 80")  # named when seen at the exec's end (not by the 1 s poll)
            await w.until(lambda: "fork_bomb" in {a.rule for a in w.alerts}, what="fork_bomb alert")
            assert any(a.evidence[0].kind == "pids" for a in w.alerts if a.rule == "fork_bomb")
            assert not w.of("oom")
            assert all(e.ts >= t_bomb for e in w.of("pids"))  # the benign exec before made none
    finally:
        await sb.destroy()
    # a memory bomb (in a sandbox of its own: the one above is full of processes)
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=64, ttl_s=600, job="audit-kernel")
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            r = await sb.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=60)
            assert r.oom_killed
            await w.until(lambda: bool(w.of("oom")), what="oom event")
            assert w.of("oom")[0].detail["memory_mb"] == "64" and int(w.of("oom")[0].detail["kills"]) >= 1
            await w.until(lambda: "memory_bomb" in {a.rule for a in w.alerts}, what="memory_bomb alert")
            # one that goes off in the background after its exec has answered: seen by the poll
            # with the heartbeat (no command to name)
            r = await sb.exec("(sleep 1; x=$(head -c 200000000 /dev/zero | tr '\\0' a)) >/dev/null 2>&1 & echo started")
            assert r.stdout == "started\n" and not r.oom_killed
            await w.until(lambda: len(w.of("oom")) >= 2, what="a second oom event, from the background")
            assert "cmd" not in w.of("oom")[1].detail and int(w.of("oom")[1].detail["kills"]) >= 1
    finally:
        await sb.destroy()


async def test_retried_audit_batches_are_stored_once(nc):
    """A batch whose publish was stored but whose ack was lost is retried under the same
    Nats-Msg-Id: JetStream's duplicate window drops the second copy."""
    import secrets

    import msgspec

    from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
    from corral_node_agent.audit.log import AuditLog

    js = nc.jetstream()
    sid = f"sb-dedupe-{secrets.token_hex(4)}"
    log = AuditLog(js, "node-t")
    for i in range(3):
        log.emit(AuditEvent(id=event_id(), ts=time.time(), node="node-t", sandbox=sid, kind="exec", cmd=f"echo {i}"))
    sent = list(log.pending[sid])
    await log.flush()
    log.retry.append((sid, sent))  # as if the ack of that publish had timed out
    await log.flush()
    assert not log.retry
    got = []
    for m in await stored(js, subjects.audit("node-t", sid)):
        assert m.headers and m.headers.get("Nats-Msg-Id")
        got.extend(msgspec.json.decode(m.data, type=AuditBatch).events)
    assert [e.id for e in got] == [e.id for e in sent]


async def test_audit_log_publishes_on_a_timer_not_per_event(nc):
    """Events emitted close together go out in one publish `interval_s` after the first; an idle
    log has no timer armed; a later event starts a new one."""
    import secrets

    import msgspec

    from corral_common.contract.audit import AuditBatch, AuditEvent, event_id
    from corral_node_agent.audit.log import AuditLog

    js = nc.jetstream()
    sid = f"sb-timer-{secrets.token_hex(4)}"
    got: list[tuple[float, list[str]]] = []

    async def on_msg(m) -> None:
        got.append((time.monotonic(), [e.cmd for e in msgspec.json.decode(m.data, type=AuditBatch).events]))

    sub = await js.subscribe(subjects.audit("node-t", sid), cb=on_msg, ordered_consumer=True)
    log = AuditLog(js, "node-t", interval_s=0.3)
    log.start()
    try:
        t0 = time.monotonic()
        for i in range(5):
            log.emit(AuditEvent(id=event_id(), ts=time.time(), node="node-t", sandbox=sid, kind="exec", cmd=f"echo {i}"))
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert got and got[0][1] == [f"echo {i}" for i in range(5)], got  # one publish holds all five
        assert got[0][0] - t0 >= 0.25, got[0][0] - t0  # not before the timer
        await asyncio.sleep(0.5)
        assert len(got) == 1 and not log.pending and log.timer is None
        log.emit(AuditEvent(id=event_id(), ts=time.time(), node="node-t", sandbox=sid, kind="exec", cmd="echo later"))
        assert log.timer is not None
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [c for _, c in got] == [[f"echo {i}" for i in range(5)], ["echo later"]]
    finally:
        await log.close()
        await sub.unsubscribe()
