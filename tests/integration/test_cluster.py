"""corral on a 3-server NATS cluster (`corral up --cluster 3`): JetStream keeps 3 replicas of
everything, and a nats-server killed with SIGKILL under load costs nothing: every create is
answered (a sandbox, or a clear error that a retry with the same request_id settles without a
second sandbox), every exec answered is audited exactly once, every trajectory step runs exactly
once (a step asked again is answered from the log), and the killed server rejoins.

Hosts as network namespaces, a killed host and a cut link: test_hosts.py."""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from corral_common.contract import subjects
from corral_common.contract.audit import QueryReply, QueryRequest
from corral_common.contract.errors import Capacity, CorralError, Timeout, Unavailable
from corral_common.contract.messages import SandboxSpec
from corral_common.contract.replies import NodePingReply
from corral_sdk import AsyncClient

from ..conftest import running_stack
from ..responders import check_hedged_once, responder_dropping_first_asking

pytestmark = pytest.mark.slow

CREATES = 40
EXECS_PER_SANDBOX = 25
TRAJ_STEPS = 20


async def _rows(c: AsyncClient, sql: str) -> list[list[object]]:
    return (await c.request(subjects.MONITOR_QUERY, QueryRequest(sql=sql), QueryReply, 30)).rows


@pytest.fixture(scope="module")
async def cluster():
    async with running_stack(nodes=2, cluster=3, env_builder=False) as s:
        yield s


async def test_everything_is_kept_three_times(cluster):
    async with await AsyncClient.connect(cluster.url) as c:
        js = c.nc.jetstream()
        streams = await js.streams_info()
        names = {s.config.name for s in streams}
        assert {"CORRAL_AUDIT", "CORRAL_EVENTS"} <= names and any(n.startswith("KV_") for n in names), names
        for s in streams:
            assert s.config.num_replicas == 3, (s.config.name, s.config.num_replicas)
            assert s.cluster is not None and len(s.cluster.replicas or []) == 2, (s.config.name, s.cluster)


async def test_a_killed_nats_server_loses_nothing(cluster):
    job = f"chaos-{secrets.token_hex(4)}"
    async with await AsyncClient.connect(cluster.url) as c:
        workers = [await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=64, job=job)) for _ in range(2)]
        answered: dict[str, str] = {}  # cmd -> stdout, for every exec that came back with a result
        errors: list[CorralError] = []

        async def exec_stream(sb, w: int) -> None:
            for i in range(EXECS_PER_SANDBOX):
                cmd = f"echo {job}-w{w}-{i}"
                try:
                    r = await sb.exec(cmd, timeout_s=20)
                    answered[cmd] = r.stdout
                except CorralError as e:  # answered, with an error a person can read
                    errors.append(e)
                await asyncio.sleep(0.05)

        steps_done: list[int] = []

        async def trajectory_steps(t) -> None:
            """Each step appends its number to a file; a step whose answer was lost is asked
            again at the same step, which the node answers from its log instead of running it."""
            for i in range(TRAJ_STEPS):
                for attempt in range(20):
                    try:
                        r = await t.exec(f"echo {i} >> /tmp/steps; wc -l < /tmp/steps", timeout_s=20)
                        assert r.exit_code == 0, r
                        steps_done.append(i)
                        break
                    except (Timeout, Unavailable):
                        await asyncio.sleep(0.5)
                await asyncio.sleep(0.05)

        async def create(i: int) -> tuple[str, object]:
            spec = SandboxSpec(image="busybox", cpu=0.1, memory_mb=64, job=job, request_id=f"{job}-{i}")
            try:
                return spec.request_id, await c.create_spec(spec, timeout=60, wait_for_capacity_s=60)
            except CorralError as e:
                return spec.request_id, e

        async def chaos() -> float:
            await asyncio.sleep(0.5)
            cluster.kill_nats(0)
            await asyncio.sleep(3)
            t0 = time.monotonic()
            await cluster.restart_nats(0)
            return time.monotonic() - t0

        traj = c.trajectory(f"{job}-traj", image="busybox", cpu=0.1, memory_mb=64, job=job)
        await traj.open()
        results = await asyncio.gather(*(create(i) for i in range(CREATES)), *(exec_stream(sb, w) for w, sb in enumerate(workers)),
                                       trajectory_steps(traj), chaos())
        created = list(results[:CREATES])
        failed = [(rid, o) for rid, o in created if isinstance(o, BaseException)]
        print(f"chaos: {len(failed)} creates failed {failed[:3]}, {len(errors)} exec errors {errors[:3]}, "
              f"{len(answered)} execs answered, restart {results[-1]:.2f}s")
        # a failover may cost an answer in time, never a wrong one: an image or a sandbox that
        # exists is never reported missing, and a retry with the same request_id settles it
        assert all(isinstance(o, (Timeout, Unavailable, Capacity)) for _, o in failed), failed
        assert all(isinstance(e, (Timeout, Unavailable)) for e in errors), errors
        for n, (rid, outcome) in enumerate(created):
            if isinstance(outcome, BaseException):
                created[n] = (rid, await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=64, job=job, request_id=rid),
                                                       timeout=60, wait_for_capacity_s=60))
        ok_ids = {o.id for _, o in created}
        assert len(ok_ids) == CREATES, "one request_id, one sandbox"

        listed = await c.list(job=job)
        ids = [s.id for s in listed]
        assert len(ids) == len(set(ids)), "a sandbox listed twice"
        assert traj.sandbox is not None
        mine = ok_ids | {w.id for w in workers} | {traj.sandbox.id}
        assert set(ids) == mine, set(ids) ^ mine
        assert answered, errors
        for cmd, out in answered.items():
            assert out == cmd.removeprefix("echo ") + "\n", (cmd, out)

        # every trajectory step ran exactly once: none lost, none run again by a retry
        assert steps_done == list(range(TRAJ_STEPS)), steps_done
        r = await traj.sandbox.exec("cat /tmp/steps")
        assert r.stdout.split() == [str(i) for i in range(TRAJ_STEPS)], r.stdout
        await traj.finish(delete_log=True)

        # every exec that was answered is in ClickHouse exactly once (none lost, none twice)
        deadline = time.monotonic() + 90
        while True:
            rows = await _rows(c, f"SELECT cmd, count() FROM audit_events FINAL WHERE job = '{job}' AND kind = 'exec' GROUP BY cmd")
            seen = {str(r[0]): int(str(r[1])) for r in rows}
            if all(cmd in seen for cmd in answered) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert [cmd for cmd in answered if cmd not in seen] == [], "execs answered but never audited"
        assert {cmd: n for cmd, n in seen.items() if n != 1} == {}, "execs audited twice"

        # the restarted server is a full member again: its replicas catch up
        js = c.nc.jetstream()
        deadline = time.monotonic() + 60
        while True:
            info = await js.stream_info("CORRAL_AUDIT")
            peers = [info.cluster.leader] + [p.name for p in info.cluster.replicas or [] if p.current] if info.cluster else []
            if "corral-1" in peers or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert "corral-1" in peers, info.cluster

        for sb in [*workers, *(o for _, o in created)]:
            await sb.destroy()
        # the scheduler's table follows the nodes' deletes again (its KV watch died with the server)
        deadline = time.monotonic() + 30
        while (left := await c.list(job=job)) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert left == []


async def test_an_idempotent_request_is_asked_again_when_the_client_reconnects(cluster):
    """A reply sent while the client is between servers (its server died) is lost for good: a
    request that is safe to repeat (a create with a request_id, a read) is asked again at the
    reconnect instead of waiting out its timeout. The responder here drops the first asking, as the
    failover would; the client (on server 1, which is killed) gets the second one's answer."""
    first, other = cluster.url.split(",")[:2]  # the operator's credentials in each
    responder, heard = await responder_dropping_first_asking(other, "test.idempotent")
    c = await AsyncClient.connect(first)
    try:
        t0 = time.monotonic()
        ask = asyncio.create_task(c.request("test.idempotent", b"{}", NodePingReply, timeout=60, resend=True))
        for _ in range(200):
            if heard or ask.done():
                break
            await asyncio.sleep(0.05)
        assert heard and not ask.done(), ask
        cluster.kill_nats(0)
        r = await ask
        assert r.node == "n" and len(heard) == 2
        assert time.monotonic() - t0 < 30, "answered after the reconnect, not at the timeout"
        # without `resend` the lost answer is waited out: a non-idempotent request is never asked twice
        heard.clear()
        with pytest.raises(Timeout):
            await c.request("test.idempotent", b"{}", NodePingReply, timeout=2)
        assert len(heard) == 1
    finally:
        await cluster.restart_nats(0)
        await c.close()
        await responder.close()


async def test_an_idempotent_request_lost_inside_a_server_is_asked_again_without_a_reconnect(cluster):
    """A request routed through the client's live server to a responder whose server then dies
    is lost inside that server, and nothing tells the client: in a cluster, a request safe to
    repeat is asked once more after `hedge_after_s` without an answer (the first asking stays in
    flight, the first answer wins). One that is not safe to repeat is never asked twice."""
    url = cluster.url.split(",")[1]  # a server no other test of this module kills
    await check_hedged_once(url, "test.hedged", clustered=True)
