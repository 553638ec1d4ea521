"""corral across hosts (`corral up --hosts 3`): three network namespaces on a bridge, each with
its own nats-server of a 3-server cluster (JetStream at replicas 3), a node-agent and its image
loader; two scheduler replicas, the monitor and the env-builder spread over them, every process
started with the CLI a deployment uses and given its own host's server only.

Chaos under load, with nothing lost: a host killed outright (every process in its namespace and
its sandboxes) while a batch of creates, exec streams and trajectories run; a host's link cut and
healed. Afterwards every create is answered and settles on a retry with its request_id, no
sandbox is owned twice, every answered exec is audited exactly once, trajectories of the dead
host resume on others from their snapshots with every step run once, and nothing is left over
(running_stack checks each node). The recovery times are printed (bench/cluster.py reports them)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral_common.contract import subjects
from corral_common.contract.audit import QueryReply, QueryRequest
from corral_common.contract.errors import CorralError, NotFound, Timeout, Unavailable
from corral_common.contract.messages import SandboxSpec
from corral_sdk import AsyncClient, AsyncSandbox
from corral_sdk.stack import Stack

from ..conftest import running_stack

pytestmark = pytest.mark.slow

BATCH = 600
VICTIM = 1  # host 2: nats-server-2, scheduler-2, loader-2, node-2
CUT = 2  # host 3: nats-server-3, the monitor, loader-3, node-3
NODES = ("node-1", "node-2", "node-3")
# when each node's current agent started (time.time(); absent: with the stack): its /metrics
# count the audit events it published from then on
_BORN: dict[str, float] = {}


@pytest.fixture(scope="module")
async def hosts():
    async with running_stack(nodes=3, hosts=3) as s:
        yield s


@pytest.fixture(autouse=True)
async def nothing_left_between(hosts: Stack):
    """Each test starts on empty nodes (placement is by free room), also after one that failed:
    then a host it killed boots again and a link it cut comes back, so the failure stays its own."""
    yield
    while Load.running:
        await Load.running.pop().abandon()
    for i in range(hosts.hosts):
        hosts.heal_link(i)  # a no-op for a link that is up
        if any(p.host == i and p.popen.poll() is not None for p in hosts.procs):
            for node in (p.name for p in hosts.procs if p.host == i and p.name.startswith("node-")):
                _BORN[node] = time.time()
            await hosts.restart_host(i)
    async with await AsyncClient.connect(hosts.url) as c:
        await _until(lambda: _serving_every_node(c))
        for info in await c.list():
            with contextlib.suppress(CorralError):
                await c.sandbox(info.id).destroy()


async def _serving_every_node(c: AsyncClient) -> bool:
    for node in NODES:
        try:
            await c.nc.request(subjects.node_ping(node), b"{}", timeout=2)
        except Exception:  # not up (yet): no responders, or no answer in time
            return False
    return True


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


async def _rows(c: AsyncClient, sql: str) -> list[list[object]]:
    return (await c.request(subjects.MONITOR_QUERY, QueryRequest(sql=sql), QueryReply, 30)).rows


async def _audited_once(c: AsyncClient, job: str, answered: set[str]) -> None:
    """Every exec answered is in ClickHouse exactly once (none lost, none twice)."""
    deadline = time.monotonic() + 120
    while True:
        rows = await _rows(c, f"SELECT cmd, count() FROM audit_events FINAL WHERE job = '{job}' AND kind = 'exec' GROUP BY cmd")
        seen = {str(r[0]): int(str(r[1])) for r in rows}
        if answered <= set(seen) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert sorted(answered - set(seen)) == [], "execs answered but never audited"
    assert {cmd: n for cmd, n in seen.items() if n != 1} == {}, "execs audited twice"


def _counted(hosts: Stack, node: str, *names: str, **labels: str) -> list[int]:
    """The node agent's counters `names` (summed over the node's samples with `labels`), from its /metrics."""
    with urllib.request.urlopen(hosts.proc(node).metrics_url, timeout=5) as r:
        text = r.read().decode()
    counts = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counts and sample.labels.get("node") == node and all(sample.labels.get(k) == v for k, v in labels.items()):
                counts[sample.name] += sample.value
    return [int(counts[n]) for n in names]


def _published(hosts: Stack, node: str) -> tuple[int, int]:
    """(audit events the node's agent published, JetStream acknowledging them; events it dropped
    after publishes failed, which may have landed all the same)."""
    published, dropped = _counted(hosts, node, "corral_audit_events_total", "corral_audit_events_dropped_total")
    return published, dropped


def _made(hosts: Stack, node: str) -> int:
    """Batch items the node's agent made so far (each counted as it is made, before the node
    answers its share)."""
    return _counted(hosts, node, "corral_node_batch_items_total", outcome="ok")[0]


async def _stored(c: AsyncClient, node: str, since: float, until: float | None = None) -> tuple[int, int]:
    """(rows, distinct event ids) in ClickHouse of `node`'s audit events stamped in [since, until]."""
    sql = (f"SELECT count(), uniqExact(id) FROM audit_events WHERE node = '{node}' "
           f"AND toUnixTimestamp64Milli(ts) >= {int(since * 1000)}")
    if until is not None:
        sql += f" AND toUnixTimestamp64Milli(ts) <= {int(until * 1000) + 1}"
    rows = await _rows(c, sql)
    return int(str(rows[0][0])), int(str(rows[0][1]))


async def _stored_as_published(c: AsyncClient, hosts: Stack) -> None:
    """Counted against what the node-agents published: per node, ClickHouse holds each event its
    current agent had acknowledged by JetStream exactly once (no id twice, none missing; more only
    by what it dropped after a failed publish that may have landed)."""
    for node in NODES:
        deadline = time.monotonic() + 120
        while True:
            published, dropped = _published(hosts, node)
            rows, ids = await _stored(c, node, _BORN.get(node, 0.0))
            if published <= ids <= published + dropped or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert rows == ids, f"{node}: {rows - ids} audit events stored twice"
        assert published <= ids <= published + dropped, f"{node}: published {published} (dropped {dropped}), stored {ids}"
        print(f"audit: {node} published {published}, stored {ids} once each")


async def _on_every_node(c: AsyncClient, job: str) -> list:
    """One sandbox on each node: spread placement fills the emptiest node first, so creates get
    to every node within a few; the extra ones are destroyed."""
    by_node: dict[str, object] = {}
    for _ in range(30):
        if len(by_node) == 3:
            break
        sb = await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=32, job=job))
        if sb.info.node in by_node:
            await sb.destroy()
        else:
            by_node[sb.info.node] = sb
    assert sorted(by_node) == ["node-1", "node-2", "node-3"]
    return [by_node[n] for n in sorted(by_node)]


async def _answers(sb: AsyncSandbox, word: str) -> bool:
    """Whether `sb` answers an exec within 2 s. A probe is not waited out: a request caught in a
    dying route or server gets no answer until its timeout (timeout_s + 15 s), which says nothing
    about when the sandbox answers again. Each probe's command is its own, so the audit check
    (each answered command once) holds for probes given up on that ran all the same."""
    word = f"{word}-{secrets.token_hex(3)}"
    try:
        return (await asyncio.wait_for(sb.exec(f"echo {word}", timeout_s=5), 2)).stdout == f"{word}\n"
    except (Timeout, Unavailable, NotFound, asyncio.TimeoutError):
        # not_found: its node is declared lost and the replica asked has not heard it again yet
        return False


class Load:
    """Exec streams on a set of sandboxes: what came back, and the errors (which must be ones a
    caller can act on: a timeout, unavailable, or not_found while its node is declared lost;
    never a wrong answer)."""

    running: list[Load] = []  # stopped after each test whatever happened (nothing_left_between)

    def __init__(self, job: str):
        self.job = job
        self.answered: dict[str, str] = {}
        self.errors: list[CorralError] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def start(self, sbs: list[AsyncSandbox]) -> None:
        self.tasks = [asyncio.create_task(self.stream(sb, w)) for w, sb in enumerate(sbs)]
        Load.running.append(self)

    async def stream(self, sb, w: int) -> None:
        i = 0
        while not self.stop.is_set():
            cmd = f"echo {self.job}-w{w}-{i}"
            i += 1
            try:
                self.answered[cmd] = (await sb.exec(cmd, timeout_s=10)).stdout
            except (Timeout, Unavailable, NotFound) as e:
                self.errors.append(e)
            await asyncio.sleep(0.05)

    async def finish(self) -> None:
        """Stop the streams, let them end, check what came back."""
        self.stop.set()
        await asyncio.gather(*self.tasks)
        assert self.answered, self.errors
        assert {cmd: out for cmd, out in self.answered.items() if out != cmd.removeprefix("echo ") + "\n"} == {}

    async def abandon(self) -> None:
        """After a test that failed: its streams must not outlive it (an exception never
        retrieved from one surfaces in a later test of this worker, on CPython 3.11.7 once as an
        AST SystemError in a parse that the garbage collector interrupted to log it)."""
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _logged(stack: Stack, words: list[str]) -> dict[str, list[str]]:
    """For a failure's message: the stack's log lines (file: line) that name any of `words`."""
    d = stack.log_dir or os.path.join(stack.data_dir, "logs")
    found: dict[str, list[str]] = {}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), errors="replace") as f:
            found.update({name: hits} if (hits := [ln.strip()[:400] for ln in f if any(w in ln for w in words)]) else {})
    return found


async def _until(what, timeout: float = 120.0, every: float = 0.2) -> float:
    """Seconds until `what()` (a coroutine function) returns true."""
    t0 = time.monotonic()
    while not await what():
        assert time.monotonic() - t0 < timeout, f"not within {timeout:g}s: {what.__doc__ or what}"
        await asyncio.sleep(every)
    return time.monotonic() - t0


async def test_every_host_is_a_network_of_its_own(hosts: Stack):
    topo = hosts.topology
    assert topo is not None
    root = _netns(os.getpid())
    nets = [os.stat(f"/run/netns/{topo.netns(i)}").st_ino for i in range(3)]
    assert len(set(nets)) == 3 and root not in nets
    placed = {p.name: p.host for p in hosts.procs}
    for p in hosts.procs:
        assert _netns(p.popen.pid) == nets[p.host], p.name
    # two scheduler replicas, the monitor and the env-builder not all on one host; a node per host
    assert placed["scheduler"] != placed["scheduler-2"] and placed["monitor"] not in (placed["scheduler"], placed["scheduler-2"])
    assert {placed[f"node-{i}"] for i in (1, 2, 3)} == {0, 1, 2}
    # each server listens on its host's address only: nothing on loopback here answers for it
    port = int(hosts.servers[0].listen.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
    async with await AsyncClient.connect(hosts.url) as c:
        for st in await c.nc.jetstream().streams_info():
            assert st.config.num_replicas == 3, st.config.name
        job = f"spread-{secrets.token_hex(3)}"
        sbs = await _on_every_node(c, job)
        for sb in sbs:
            assert (await sb.exec("echo hi")).stdout == "hi\n"
            await sb.destroy()


@pytest.mark.timeout(900)  # a thousand real sandboxes on a 2-core machine, a third of them made twice
async def test_a_killed_host_loses_nothing(hosts: Stack):
    job = f"hostkill-{secrets.token_hex(3)}"
    victim_node = f"node-{VICTIM + 1}"
    async with await AsyncClient.connect(hosts.url) as c:
        # trajectories until one runs on every node (spread placement), so some run on the host that dies
        trajs = []
        while len(trajs) < 9 and {t.sandbox.info.node for t in trajs} != {"node-1", "node-2", "node-3"}:
            t = c.trajectory(f"{job}-t{len(trajs)}", image="busybox", cpu=0.1, memory_mb=32, job=f"{job}-traj", snapshot_every=3)
            await t.open()
            trajs.append(t)
        assert {t.sandbox.info.node for t in trajs} == {"node-1", "node-2", "node-3"}
        for t in trajs:
            for i in range(7):  # snapshots after steps 2 and 5; step 6 is re-run from the log
                await t.exec(f"echo {i} >> /steps")
        survivors = [sb for sb in await _on_every_node(c, job) if sb.info.node != victim_node]
        workers = list(survivors)
        load = Load(job)
        load.start(workers)
        rid = f"{job}-batch"
        spec = {"image": "busybox", "cpu": 0.01, "memory_mb": 16, "job": job, "request_id": rid}

        placed: list[int] = [0]

        def progress(p) -> None:
            placed.append(p.placed)

        async def batch():
            try:
                # its scheduler may be on the host that dies: then no answer comes, and a timeout
                # is the clear error the caller gets (the retry below settles the request)
                return await c.create_batch_reply(BATCH, timeout=60, progress=progress, **spec)
            except CorralError as e:
                return e

        made_before = _made(hosts, victim_node)
        t_batch = time.monotonic()
        first = asyncio.create_task(batch())

        async def victim_under_way() -> bool:
            """the host dies while its node makes its share (made before it answers, they are lost
            with it: a retry answers those `not_found`, as it should)"""
            return await asyncio.to_thread(_made, hosts, victim_node) - made_before >= BATCH // 30

        await _until(victim_under_way, 120, every=0.1)
        born_before, (published_before, _) = _BORN.get(victim_node, 0.0), _published(hosts, victim_node)
        declared_lost = await c.nc.subscribe(subjects.node_event(victim_node, "lost"))
        killed = hosts.kill_host(VICTIM)
        t_kill = time.time()
        at_kill = placed[-1]
        assert {"nats-server-2", "scheduler-2", "node-2", "loader-2"} <= set(killed), killed

        probes: list[str] = []  # request_ids of the probing creates: one whose answer came too late is settled below

        async def probe(**kw) -> AsyncSandbox | None:
            probes.append(f"{job}-probe-{len(probes)}")
            try:
                sb = await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=32, job=job, request_id=probes[-1], **kw),
                                         timeout=5)
            except CorralError:
                return None
            survivors.append(sb)
            return sb

        async def placing_again() -> bool:
            """a create succeeds again after the host died"""
            return await probe() is not None

        recover_create = await _until(placing_again)
        # a retry asked before the scheduler noticed the host died (stale_after_s) is answered with
        # what the dead node had made, as made: the scheduler cannot know yet; asked after, the
        # dead node's items are made again elsewhere
        await declared_lost.next_msg(timeout=60)
        await declared_lost.unsubscribe()
        outcome = await first
        marks = [("batch answered", time.monotonic())]
        print(f"host kill: at {at_kill} of {BATCH} placed; first batch answered {type(outcome).__name__} "
              f"after {time.monotonic() - t_batch:.1f}s"
              f"{'' if isinstance(outcome, BaseException) else f' with {len(outcome.sandboxes)} made, {len(outcome.failed)} failed'}"
              f"{'' if isinstance(outcome, BaseException) else sorted({f.code for f in outcome.failed})}")
        assert not isinstance(outcome, BaseException) or isinstance(outcome, (Timeout, Unavailable)), outcome
        # the same request again settles it: exactly BATCH sandboxes, on the hosts still up
        r = None
        for _ in range(5):
            try:
                r = await c.create_batch_reply(BATCH, timeout=120, **spec)
            except (Timeout, Unavailable) as e:
                print(f"host kill: batch retry answered {e!r}")
                continue
            if len(r.sandboxes) == BATCH and not r.failed:
                break
            await asyncio.sleep(2)
        if r is None:
            said = {name: lines[-40:] for name, lines in _logged(hosts, [rid]).items() if "scheduler" in name}
            pytest.fail(f"5 retries of the batch went unanswered; the schedulers said: {said}")
        ids = [s.id for s in r.sandboxes]
        assert len(ids) == BATCH == len(set(ids)) and not r.failed, r.failed[:3]
        listed = await c.list(job=job)
        listed_ids = [s.id for s in listed]
        assert len(listed_ids) == len(set(listed_ids)), "a sandbox listed twice"
        if unlisted := [s for s in r.sandboxes if s.id not in set(listed_ids)]:
            await asyncio.sleep(5)
            later = {s.id for s in await c.list(job=job)}
            pytest.fail(f"{len(unlisted)} sandboxes of the settled batch not listed, by node "
                        f"{sorted((n, sum(1 for s in unlisted if s.node == n)) for n in {s.node for s in unlisted})}; "
                        f"listed 5 s later: {sum(1 for s in unlisted if s.id in later)}; "
                        f"the logs name them: {_logged(hosts, [s.id for s in unlisted[:3]])}")
        on_dead = [(s.id, s.state, s.id in ids) for s in listed if s.node == victim_node]
        assert on_dead == [], on_dead[:5]

        # the trajectories of the dead host resume elsewhere from their snapshots; no step twice
        marks.append(("batch settled", time.monotonic()))
        t_resume = time.monotonic()
        for t in trajs:
            was = t.sandbox.info.node
            await t.close()  # the trainer that ran it is preempted; a new one takes the rollout up
            again = c.trajectory(t.id, image="busybox", cpu=0.1, memory_mb=32, job=f"{job}-traj", snapshot_every=3)
            await again.open()
            for i in range(7):
                assert (await again.exec(f"echo {i} >> /steps")).replayed
            assert (await again.exec("cat /steps")).stdout == "".join(f"{i}\n" for i in range(7))
            if was == victim_node:
                assert again.sandbox.info.node != victim_node and again.rerun_steps == 1
            await again.finish(delete_log=True)
        resume_s = time.monotonic() - t_resume
        load.stop.set()
        await load.finish()

        # the host boots again: its node serves and its nats-server is a full member again
        t0 = time.monotonic()
        _BORN[victim_node] = time.time()
        await hosts.restart_host(VICTIM)

        async def node_back() -> bool:
            """the restarted node takes a sandbox"""
            sb = await probe(placement="spread")
            return sb is not None and sb.info.node == victim_node

        await _until(node_back)
        rejoin_s = time.monotonic() - t0

        async def member_again() -> bool:
            """the restarted server holds a current replica of the audit stream again"""
            info = await c.nc.jetstream().stream_info("CORRAL_AUDIT")
            cl = info.cluster
            return cl is not None and (cl.leader == "corral-2" or any(p.name == "corral-2" and p.current for p in cl.replicas or []))

        await _until(member_again, 60)
        # the restarted node cleaned up what died with it, and took nothing of what was made again elsewhere
        gone = set(ids) - {s.id for s in await c.list(job=job)}
        assert not gone, f"after the host came back, {len(gone)} of the batch's sandboxes are no longer listed"
        print(f"host kill: creates again after {recover_create:.2f}s, {len(trajs)} trajectories resumed in {resume_s:.2f}s, "
              f"host back in {rejoin_s:.2f}s; "
              f"{len(load.errors)} exec errors, {len(load.answered)} execs answered")
        marks.append(("host back", time.monotonic()))
        await _audited_once(c, job, set(load.answered))
        marks.append(("audited", time.monotonic()))

        async def dead_agent_stored() -> bool:
            """what the dead host's agent had published before it died is in ClickHouse"""
            return (await _stored(c, victim_node, born_before, t_kill))[1] >= published_before

        await _until(dead_agent_stored)
        rows, distinct = await _stored(c, victim_node, born_before, t_kill)
        assert rows == distinct, f"{victim_node} before the kill: {rows - distinct} audit events stored twice"
        print(f"audit: {victim_node} had published {published_before} when its host died, {distinct} stored once each")
        await _stored_as_published(c, hosts)
        marks.append(("stored as published", time.monotonic()))
        for rid in probes:  # a probe the client gave up on may have been made: asked again, it answers that one
            with contextlib.suppress(CorralError):
                survivors.append(await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=32, job=job, request_id=rid)))
        at_once = asyncio.Semaphore(64)

        refused: list[tuple[str, str, str]] = []

        async def destroy(sb: AsyncSandbox) -> None:
            async with at_once:
                try:
                    await sb.destroy()
                except CorralError as e:  # one of the dead host's sandboxes: already lost
                    refused.append((sb.id, e.code.value, e.message[:200]))

        await asyncio.gather(*(destroy(sb) for sb in [*survivors, *(c.sandbox(i) for i in ids)]))

        deadline = time.monotonic() + 60
        while (left := [*await c.list(job=job), *await c.list(job=f"{job}-traj")]) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert [(s.id, s.node, s.state) for s in left] == [], (
            f"{len(left)} left, by node {sorted((n, sum(1 for s in left if s.node == n)) for n in {s.node for s in left})}; "
            f"destroys refused: {[r for r in refused if r[0] in {s.id for s in left}][:5]}; "
            f"the logs name them: {_logged(hosts, [s.id for s in left[:2]])}")
        marks.append(("cleaned up", time.monotonic()))
        print("host kill phases:", ", ".join(f"{n} +{t - p:.1f}s" for (n, t), (_, p) in zip(marks[1:], marks)))


async def test_a_cut_link_heals_with_nothing_lost(hosts: Stack):
    job = f"cut-{secrets.token_hex(3)}"
    cut_node = f"node-{CUT + 1}"
    async with await AsyncClient.connect(hosts.url) as c:
        sbs = await _on_every_node(c, job)
        assert cut_node in {sb.info.node for sb in sbs}
        load = Load(job)
        load.start(sbs)
        await asyncio.sleep(1)
        hosts.cut_link(CUT)
        await asyncio.sleep(8)  # longer than the scheduler waits before it declares a node lost
        hosts.heal_link(CUT)
        cut_sb = next(sb for sb in sbs if sb.info.node == cut_node)

        async def answers() -> bool:
            """the cut host's sandbox answers again"""
            return await _answers(cut_sb, "back")

        heal_s = await _until(answers)

        async def listed_again() -> bool:
            """the scheduler lists the cut host's sandbox again (the node wrote its placement back
            once told it had been declared lost)"""
            return sorted(s.id for s in await c.list(job=job)) == sorted(sb.id for sb in sbs)

        relist_s = heal_s + await _until(listed_again, 60)
        load.stop.set()
        await load.finish()
        print(f"link cut: the cut host's sandbox answers {heal_s:.2f}s after the heal, is listed again after {relist_s:.2f}s; "
              f"{len(load.errors)} exec errors, {len(load.answered)} answered")
        # answered during the cut, on the hosts still linked; and the cut host's sandbox came back
        assert any(f"-w{w}-" in cmd for cmd in load.answered for w, sb in enumerate(sbs) if sb.info.node != cut_node)
        await _audited_once(c, job, set(load.answered))
        await _stored_as_published(c, hosts)
        for sb in sbs:
            await sb.destroy()


async def test_a_killed_nats_server_of_a_host_loses_nothing(hosts: Stack):
    """Host 1's processes were given only their own server: when it dies they carry on through
    the servers they learnt of from it, and nothing answered is lost."""
    job = f"natskill-{secrets.token_hex(3)}"
    async with await AsyncClient.connect(hosts.url) as c:
        sbs = await _on_every_node(c, job)
        load = Load(job)
        load.start(sbs)
        await asyncio.sleep(1)
        hosts.kill_nats(0)
        on_host1 = next(sb for sb in sbs if sb.info.node == "node-1")

        async def node1_answers() -> bool:
            """node-1 (its own server dead) answers an exec again"""
            return await _answers(on_host1, "again")

        async def creates() -> bool:
            """a create is placed again"""
            try:
                sbs.append(await c.create_spec(SandboxSpec(image="busybox", cpu=0.1, memory_mb=32, job=job), timeout=5))
                return True
            except (Timeout, Unavailable):
                return False

        answer_s = await _until(node1_answers, 60)
        create_s = await _until(creates, 60)
        await asyncio.sleep(2)
        t0 = time.monotonic()
        await hosts.restart_nats(0)
        load.stop.set()
        await load.finish()
        print(f"nats kill: node-1 answers after {answer_s:.2f}s, creates after {create_s:.2f}s more, restarted in "
              f"{time.monotonic() - t0:.2f}s; {len(load.errors)} exec errors, {len(load.answered)} answered")
        await _audited_once(c, job, set(load.answered))
        await _stored_as_published(c, hosts)
        for sb in sbs:
            await sb.destroy()
