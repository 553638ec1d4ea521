"""NATS service discovery: every corral service answers `$SRV.PING/INFO/STATS` as standard NATS
tooling asks (plain nats-py here; the replies are read back with nats-py's own micro parsers, so a
field the protocol requires and a client reads cannot go missing unnoticed).

Subjects are built by nats-py's `nats.micro` (`control_subject`), as any micro client builds them."""
from __future__ import annotations

import asyncio
import importlib.metadata
import json

import msgspec
import nats
import pytest
from nats.micro.service import NAME_REGEX, SEMVER_REGEX, ServiceInfo, ServicePing, ServiceStats, ServiceVerb, control_subject

from corral_common import bus
from corral_common.contract import subjects
from corral_common.contract.errors import Code, CorralError

# the default session stack: one node, monitor and env-builder on
SERVICES = {"corral-image-cache", "corral-scheduler", "corral-monitor", "corral-env-builder", "corral-loader", "corral-node-agent"}


async def gather_replies(nc, subject: str, want: int, timeout: float = 10.0) -> list[dict]:
    """Send one request and collect replies until `want` arrived (or the timeout ends)."""
    inbox = nc.new_inbox()
    got: list[dict] = []
    enough = asyncio.Event()

    async def on_reply(msg) -> None:
        got.append(json.loads(msg.data))
        if len(got) >= want:
            enough.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        try:
            await asyncio.wait_for(enough.wait(), timeout)
        except TimeoutError:
            pass  # the assertions below say which services did not answer
        return list(got)
    finally:
        await sub.unsubscribe()


async def request(nc, subject: str) -> dict:
    return json.loads((await nc.request(subject, b"", timeout=10)).data)


def by_name(endpoints) -> dict:
    return {ep.name: ep for ep in endpoints}


async def test_ping_answers_once_per_service(nc):
    replies = await gather_replies(nc, control_subject(ServiceVerb.PING), want=len(SERVICES))
    pings = [ServicePing.from_dict(r) for r in replies]
    assert sorted(p.name for p in pings) == sorted(SERVICES), replies
    assert all(r["type"] == "io.nats.micro.v1.ping_response" for r in replies)
    assert len({p.id for p in pings}) == len(pings)  # an id per service process
    version = importlib.metadata.version("corral")
    for p in pings:
        assert NAME_REGEX.match(p.name) and SEMVER_REGEX.match(p.version), p
        assert p.version == version, p
        assert p.metadata["pid"].isdigit() and p.metadata["host"], p
    nodes = {p.name: p.metadata.get("node") for p in pings}
    assert nodes["corral-node-agent"] == "node-1" and nodes["corral-loader"] == "node-1"
    # the same service by name, and by name and id, is the same instance
    sched = next(p for p in pings if p.name == "corral-scheduler")
    assert ServicePing.from_dict(await request(nc, control_subject(ServiceVerb.PING, name=sched.name))).id == sched.id
    again = await request(nc, control_subject(ServiceVerb.PING, name=sched.name, id=sched.id))
    assert again["id"] == sched.id and again["name"] == "corral-scheduler"


async def test_info_lists_the_scheduler_endpoints(nc):
    info = ServiceInfo.from_dict(await request(nc, control_subject(ServiceVerb.INFO, name="corral-scheduler")))
    assert info.type == "io.nats.micro.v1.info_response" and info.description
    q = subjects.SCHEDULER_QUEUE
    assert {(e.name, e.subject, e.queue_group, e.metadata["op"]) for e in info.endpoints} == {
        ("create", subjects.SANDBOX_CREATE, q, "create"),
        ("create_batch", subjects.SANDBOX_CREATE_BATCH, q, "create_batch"),
        ("list", subjects.SANDBOX_LIST, q, "list"),
        ("quota-set", subjects.QUOTA_SET, q, "quota.set"),
        ("quota-get", subjects.QUOTA_GET, q, "quota.get"),
        ("run", subjects.SANDBOX_RUN, q, "run"),
    }
    for e in info.endpoints:
        assert NAME_REGEX.match(e.name), e


async def test_stats_count_an_error_reply_with_its_code(nc):
    async def scheduler_stats() -> ServiceStats:
        replies = await gather_replies(nc, control_subject(ServiceVerb.STATS), want=len(SERVICES))
        assert all(r["type"] == "io.nats.micro.v1.stats_response" for r in replies)
        return next(ServiceStats.from_dict(r) for r in replies if r["name"] == "corral-scheduler")

    before = by_name((await scheduler_stats()).endpoints)["create"]
    reply = json.loads((await nc.request(subjects.SANDBOX_CREATE, b'{"image": "busybox", "cpu": -1}', timeout=10)).data)
    assert reply["ok"] is False and reply["error"]["code"] == "invalid_request", reply
    stats = await scheduler_stats()
    after = by_name(stats.endpoints)["create"]
    assert after.num_requests == before.num_requests + 1
    assert after.num_errors == before.num_errors + 1 >= 1
    assert after.last_error == f"invalid_request: {reply['error']['message']}"
    assert after.data["errors"]["invalid_request"] == before.data["errors"].get("invalid_request", 0) + 1
    assert after.processing_time > before.processing_time and after.average_processing_time > 0
    assert stats.started.year >= 2024


async def test_a_node_lists_one_sandbox_endpoint_whatever_its_sandboxes(nc, client):
    sbs = [await client.create(image="busybox", cpu=0.1, memory_mb=64, ttl_s=300) for _ in range(2)]
    try:
        subject = control_subject(ServiceVerb.INFO, name="corral-node-agent")
        info = ServiceInfo.from_dict(await request(nc, subject))
        assert info.metadata["node"] == "node-1"
        sandbox_eps = [e for e in info.endpoints if e.metadata["op"] == "sandbox"]
        assert [(e.name, e.subject, e.queue_group) for e in sandbox_eps] == [("sandbox", subjects.sandbox_all("*"), "")]
        assert {"create", "create_batch", "ping", "run", "traj-open"} <= {e.name for e in info.endpoints}
        assert by_name(info.endpoints)["traj-open"].queue_group == subjects.TRAJ_QUEUE

        stats_subject = control_subject(ServiceVerb.STATS, name="corral-node-agent", id=info.id)
        before = by_name(ServiceStats.from_dict(await request(nc, stats_subject)).endpoints)["sandbox"]
        for sb in sbs:
            assert (await sb.exec(["true"])).exit_code == 0
        with pytest.raises(CorralError) as e:
            await sbs[0].files.read("/no/such/file")
        code = e.value.code.value
        after = by_name(ServiceStats.from_dict(await request(nc, stats_subject)).endpoints)["sandbox"]
        assert after.num_requests >= before.num_requests + 3
        assert after.num_errors == before.num_errors + 1
        assert after.last_error == f"{code}: {e.value.message}"
    finally:
        for sb in sbs:
            await sb.destroy()
    # still listed with no sandbox left: the node can serve sandbox ops whenever one is placed
    info = ServiceInfo.from_dict(await request(nc, subject))
    assert [e.subject for e in info.endpoints if e.name == "sandbox"] == [subjects.sandbox_all("*")]


class Echo(msgspec.Struct):
    text: str


async def test_a_responder_answers_discovery_from_serve_until_drain(stack):
    """The life cycle on a Responder of the test's own: listed once served, unlisted when
    unserved, silent after drain; an internal error counts as `internal`."""
    nc = await nats.connect(stack.url)
    try:
        r = bus.Responder(nc, "discovery-test", metadata={"role": "test"})

        async def echo(msg) -> bytes:
            req = bus.decode(msg.data, Echo)
            if req.text == "boom":
                raise RuntimeError("boom")
            if not req.text:
                raise CorralError("text is empty", Code.INVALID_REQUEST)
            return msg.data

        await r.serve("discovery-test.echo", echo, "echo.v1", queue="discovery-test")
        await r.serve("discovery-test.other", echo, "other")
        name = "corral-discovery-test"
        info = await request(nc, control_subject(ServiceVerb.INFO, name=name))
        assert info["metadata"]["role"] == "test"
        assert [(e["name"], e["subject"], e["queue_group"]) for e in info["endpoints"]] == [
            ("echo-v1", "discovery-test.echo", "discovery-test"), ("other", "discovery-test.other", "")]

        for body in (b'{"text": "hi"}', b'{"text": ""}', b'{"text": "boom"}', b"not json"):
            await nc.request("discovery-test.echo", body, timeout=5)
        stats = ServiceStats.from_dict(await request(nc, control_subject(ServiceVerb.STATS, name=name, id=info["id"])))
        echo_stats = by_name(stats.endpoints)["echo-v1"]
        assert (echo_stats.num_requests, echo_stats.num_errors) == (4, 3)
        assert echo_stats.data == {"errors": {"invalid_request": 2, "internal": 1}}
        assert echo_stats.last_error.startswith("invalid_request: malformed JSON")
        assert by_name(stats.endpoints)["other"].num_requests == 0

        await r.unserve("discovery-test.other")
        info = await request(nc, control_subject(ServiceVerb.INFO, name=name))
        assert [e["name"] for e in info["endpoints"]] == ["echo-v1"]

        await r.drain()
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(control_subject(ServiceVerb.PING, name=name), b"", timeout=5)
    finally:
        await nc.close()
