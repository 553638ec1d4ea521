"""`corral.v1.monitor.evaluate` against a real stack: real NATS, a real sandbox, the monitor with its
embedded ClickHouse.

The monitor here runs its periodic window-rule pass only once an hour (`--window-every-s 3600`)
and commits only every 2 s (`--commit-ms 2000`): an alert of a window rule in an evaluate reply
can then only come from the evaluate itself (the run counter of the periodic pass stays at 0), and
an answer that did not wait for the events to be *stored* (not just fetched) would miss them."""
from __future__ import annotations

import json
import time

import msgspec
import nats
import pytest_asyncio

from corral_common import bus
from corral_common.contract import subjects
from corral_common.contract.audit import Alert, AuditBatch, AuditEvent, EvaluateRequest, Finding, event_id
from corral_sdk import AsyncClient

from ..conftest import running_stack
from .test_monitor import metric, rows, wait_for

EVALUATE = subjects.MONITOR_EVALUATE
JOB = "evaluate"


@pytest_asyncio.fixture(scope="module")
async def estack():
    async with running_stack(nodes=1, env_builder=False, monitor_args=["--window-every-s", "3600", "--commit-ms", "2000"]) as s:
        yield s


@pytest_asyncio.fixture(scope="module")
async def eclient(estack):
    c = await AsyncClient.connect(estack.url)
    yield c
    await c.close()


@pytest_asyncio.fixture
async def enc(estack):
    conn = await nats.connect(estack.url)
    yield conn
    await conn.close()


@pytest_asyncio.fixture
async def bus_alerts(enc):
    """Alerts published on corral.alerts.> while the test runs, with their subjects."""
    got: list[tuple[str, Alert]] = []

    async def on_msg(msg) -> None:
        got.append((msg.subject, msgspec.json.decode(msg.data, type=Alert)))

    sub = await enc.subscribe(subjects.ALERTS_ALL, cb=on_msg)
    assert await bus.barrier(enc)
    yield got
    await sub.unsubscribe()


async def evaluate(nc, req: EvaluateRequest | bytes, timeout: float = 60) -> dict:
    data = req if isinstance(req, bytes) else msgspec.json.encode(req)
    m = await nc.request(EVALUATE, data, timeout=timeout)
    return json.loads(m.data)


async def test_window_rule_alert_is_in_the_reply_at_once_and_findings_are_recorded_once(eclient, estack, enc, bus_alerts):
    js = enc.jetstream()
    url = estack.proc("monitor").metrics_url
    sb = await eclient.create(image="busybox", cpu=0.5, memory_mb=64, ttl_s=300, job=JOB)
    try:
        subject = subjects.audit(sb.info.node, sb.id)
        seen: list[AuditEvent] = []

        async def on_audit(msg) -> None:
            seen.extend(msgspec.json.decode(msg.data, type=AuditBatch).events)

        watch = await js.subscribe(subject, cb=on_audit, ordered_consumer=True)
        # probing the seccomp wall: 30 denied mounts (the window rule denial_burst wants 20 in 60 s)
        r = await sb.exec("for i in $(seq 30); do mount -t tmpfs x /mnt 2>/dev/null; done; echo done", timeout_s=60)
        assert r.exit_code == 0 and "done" in r.stdout, r

        async def denied_published():
            return sum(1 for e in seen if e.kind == "syscall" and e.denied) >= 30

        await wait_for(denied_published, 30, what="the denied syscalls on the audit stream")
        await watch.unsubscribe()
        after = (await js.get_last_msg("CORRAL_AUDIT", subject)).seq
        finding = Finding(rule="grader_tampering", severity="high", message="conftest.py changed by the agent",
                          paths=["/repo/conftest.py"])
        req = EvaluateRequest(sandbox=sb.id, after_seq=after, node=sb.info.node, job=JOB, findings=[finding], wait_s=60)
        first = await evaluate(enc, req)
        assert first["ok"], first
        assert first["complete"] is True and first["stored_seq"] >= after, first
        assert first["lost"] == 0
        rules = {a["rule"] for a in first["alerts"]}
        assert {"denial_burst", "denied_syscall", "grader_tampering"} <= rules, first
        burst = next(a for a in first["alerts"] if a["rule"] == "denial_burst")
        assert burst["severity"] == "high" and sb.id in burst["message"]
        found = next(a for a in first["alerts"] if a["rule"] == "grader_tampering")
        assert found == {"rule": "grader_tampering", "severity": "high", "message": "conftest.py changed by the agent",
                         "paths": ["/repo/conftest.py"]}
        # the periodic pass never ran: the evaluate's own run of the window rule raised it
        assert metric(url, "corral_monitor_window_runs_total", rule="denial_burst", scope="all") == 0
        assert metric(url, "corral_monitor_window_runs_total", rule="denial_burst", scope="sandbox") >= 1

        # the same request again: the same answer, nothing recorded twice
        second = await evaluate(enc, req)
        assert second["ok"] and second["complete"] is True, second
        key = lambda a: (a["rule"], a["severity"], a["message"], tuple(a.get("paths", [])))  # noqa: E731
        assert sorted(map(key, second["alerts"])) == sorted(map(key, first["alerts"]))
        for rule in ("denial_burst", "grader_tampering"):
            assert await rows(enc, f"SELECT count() FROM alerts WHERE sandbox = '{sb.id}' AND rule = '{rule}'") == [[1]], rule

        # published like the monitor's own alerts, once each (a core subscriber may see a
        # JetStream re-publication, always with the same id)
        async def published():
            return {a.rule for _, a in bus_alerts if a.sandbox == sb.id} >= {"denial_burst", "grader_tampering"}

        await wait_for(published, 10, what=f"the alerts on {subjects.ALERTS_ALL}")
        for rule in ("denial_burst", "grader_tampering"):
            mine = [(s, a) for s, a in bus_alerts if a.sandbox == sb.id and a.rule == rule]
            assert {s for s, _ in mine} == {subjects.alert("high", rule)}
            assert len({a.id for _, a in mine}) == 1, mine
        tamper = next(a for _, a in bus_alerts if a.rule == "grader_tampering" and a.sandbox == sb.id)
        assert tamper.paths == ["/repo/conftest.py"] and tamper.job == JOB and tamper.node == sb.info.node
    finally:
        await sb.destroy()


async def test_lost_audit_raises_audit_incomplete_and_is_counted(enc, bus_alerts):
    """A node-agent's `loss` events: the rule audit_incomplete fires, and `lost` sums their counts.
    The monitor commits every 2 s: both are only in the reply if evaluate waited for the commit."""
    js = enc.jetstream()
    sandbox = "sb-lossy-" + event_id()[-8:]
    now = time.time()
    evs = [AuditEvent(id="loss-" + event_id(), ts=now, node="n-loss", sandbox=sandbox, kind="loss", job=JOB,
                      detail={"reason": "audit buffer full", "count": "7"}),
           AuditEvent(id="loss-" + event_id(), ts=now + 0.5, node="n-loss", sandbox=sandbox, kind="loss", job=JOB,
                      detail={"reason": "publish failed", "count": "5"}),
           AuditEvent(id="ok-" + event_id(), ts=now, node="n-loss", sandbox=sandbox, kind="exec", job=JOB, cmd="ls", cwd="/", exit_code=0)]
    ack = await js.publish(subjects.audit("n-loss", sandbox), msgspec.json.encode(AuditBatch(events=evs)))
    r = await evaluate(enc, EvaluateRequest(sandbox=sandbox, after_seq=ack.seq, wait_s=60))
    assert r["ok"] and r["complete"] is True and r["stored_seq"] >= ack.seq, r
    assert r["lost"] == 12, r
    assert [a["rule"] for a in r["alerts"]] == ["audit_incomplete"], r
    a = r["alerts"][0]
    assert a["severity"] == "high" and "7" in a["message"] and "audit buffer full" in a["message"], a

    async def published():
        return [s for s, x in bus_alerts if x.sandbox == sandbox]

    subs = await wait_for(published, 10, what="audit_incomplete on the bus")
    assert set(subs) == {subjects.alert("high", "audit_incomplete")}


async def test_after_seq_not_reached_is_incomplete_after_wait_s(enc):
    js = enc.jetstream()
    last = (await js.stream_info("CORRAL_AUDIT")).state.last_seq
    t0 = time.monotonic()
    r = await evaluate(enc, EvaluateRequest(sandbox="sb-nothing", after_seq=last + 1000, wait_s=0.5))
    assert r["ok"] and r["complete"] is False, r
    assert r["stored_seq"] < last + 1000 and r["alerts"] == [] and r["lost"] == 0
    assert time.monotonic() - t0 >= 0.5  # it did wait
    # after_seq 0: nothing to wait for
    r = await evaluate(enc, EvaluateRequest(sandbox="sb-nothing"))
    assert r["ok"] and r["complete"] is True, r


async def test_malformed_requests_are_invalid_request(enc):
    for raw in [b"not json", b"{}", b'{"sandbox": ""}', b'{"sandbox": "a b"}', b'{"sandbox": "x", "after_seq": -1}',
                b'{"sandbox": "x", "bogus": 1}', b'{"sandbox": "x", "wait_s": 1000}', b'{"sandbox": "x", "after_seq": "7"}',
                b'{"sandbox": "x", "findings": [{"rule": "Bad Rule", "severity": "high", "message": "m"}]}',
                b'{"sandbox": "x", "findings": [{"rule": "r", "severity": "apocalyptic", "message": "m"}]}',
                b"{\"sandbox\": \"x'; DROP TABLE alerts; --\"}"]:
        r = await evaluate(enc, raw, timeout=10)
        assert not r["ok"] and r["error"]["code"] == "invalid_request", (raw, r)
    # still serving, and nothing was recorded for the malformed ones
    assert (await evaluate(enc, EvaluateRequest(sandbox="x")))["ok"]
    assert await rows(enc, "SELECT count() FROM alerts WHERE sandbox = 'x'") == [[0]]


MIGRATION_CHECK = r"""
import sys
import clickhouse_connect
from corral_monitor.store import AlertRow, Store, wait_connect

dsn = sys.argv[1]
c = clickhouse_connect.get_client(dsn=dsn)
# the alerts table as a monitor before `paths` made it
c.command('''CREATE TABLE alerts (id String, ts DateTime64(3, 'UTC'), event_ts DateTime64(3, 'UTC'), rule LowCardinality(String),
             severity LowCardinality(String), sandbox String, node LowCardinality(String), job String, message String,
             evidence_ids Array(String), evidence String, ingested_at DateTime64(3, 'UTC') DEFAULT now64(3))
             ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(event_ts) ORDER BY (rule, sandbox, event_ts, id)''')
c.command("INSERT INTO alerts (id, ts, event_ts, rule, severity, sandbox, message) VALUES ('old', now64(3), now64(3), 'r', 'high', 'sb', 'm')")
c.close()
for _ in range(2):  # a second start finds the column there
    s = wait_connect(dsn)
    s.close()
s = wait_connect(dsn)
s.insert("alerts", [AlertRow(id="new", ts=1.7e9, event_ts=1.7e9, rule="r", severity="high", sandbox="sb", node="", job="",
                              message="m", evidence_ids=[], evidence="[]", paths=["/a"])])
print(sorted(s.query("SELECT id, paths FROM alerts ORDER BY id").rows))
"""


def test_existing_alerts_table_gets_the_paths_column(tmp_path):
    """A monitor upgraded over an existing database adds `alerts.paths` (CREATE TABLE IF NOT
    EXISTS alone would leave the old table, whose inserts skip unknown fields: every alert's paths
    would be dropped without a word)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", MIGRATION_CHECK, f"chdb://{tmp_path}/monitor.db"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[['new', ['/a']], ['old', []]]", p.stdout
