"""kill -9 a node-agent with live sandboxes, start it again: live sandboxes are adopted and keep
working, half-made leftovers are cleaned, events say what happened, nothing is orphaned."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess

import nats

from corral_common.contract import subjects
from corral_sdk import AsyncClient

from ..conftest import make_stack, running_stack
from ..hostview import uid_base
from ..leaks import UID_CLAIMS, assert_clean, cgroup_parent, cgroups_under, mounts_under, uid_ranges_of


async def _wait_node(url: str, node: str, timeout: float = 30) -> None:
    nc = await nats.connect(url)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                await nc.request(subjects.node_ping(node), b"{}", timeout=1)
                return
            except Exception:
                await asyncio.sleep(0.2)
        raise TimeoutError(node)
    finally:
        await nc.close()


async def test_kill9_node_agent_then_restart():
    async with running_stack(nodes=1) as stack:
        node = "node-1"
        sdir = f"{stack.data_dir}/nodes/{node}/sandboxes"
        c = await AsyncClient.connect(stack.url)
        keep = await c.create(image="busybox", cpu=0.1, memory_mb=32)
        await keep.files.write("/state.txt", "before crash")
        await keep.exec("sleep 600 &")
        short = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=3)
        keep_base, short_base = uid_base(f"{sdir}/{keep.id}"), uid_base(f"{sdir}/{short.id}")

        agent = stack.proc(node).popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()

        # leftovers of a create that was interrupted half-way: a tmpfs mount and a cgroup, no container
        fake = f"{sdir}/sb-deadbeef0000"
        os.makedirs(f"{fake}/rw")
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", f"{fake}/rw"], check=True)
        parent = cgroup_parent(stack.data_dir, node)
        os.makedirs(f"/sys/fs/cgroup/pids{parent}/sb-deadbeef0000", exist_ok=True)
        # and a host uid range it claimed for a sandbox it never got to make
        stale = _free_base()
        with open(f"{UID_CLAIMS}/{stale}", "w") as f:
            f.write(f"{sdir}\nsb-feedface0000\n")
        await asyncio.sleep(3.5)  # `short` expires while its agent is down

        nc = await nats.connect(stack.url)
        got: list[tuple[str, dict]] = []

        async def on_msg(m) -> None:
            got.append((m.subject, json.loads(m.data)))

        await nc.subscribe(subjects.EVENTS_ALL, cb=on_msg)
        stack.restart(node)
        await _wait_node(stack.url, node)
        await asyncio.sleep(1.0)

        # the surviving sandbox was adopted and works, with its state and background process
        r = await keep.exec("cat /state.txt; ps | grep -c '[s]leep 600'")
        assert r.exit_code == 0 and r.stdout == "before crash1\n", r
        ready = [e for s, e in got if e.get("sandbox_id") == keep.id and e.get("kind") == "ready"]
        assert ready and "adopted" in ready[0]["reason"]

        # the fake leftover and (after its ttl) the expired sandbox are gone, with events saying so
        reconciled = [e for s, e in got if s == subjects.node_event(node, "reconciled")]
        assert reconciled and "sb-deadbeef0000" in reconciled[0]["cleaned"], got
        assert not os.path.exists(fake)
        assert not mounts_under(fake)
        assert not [p for p in cgroups_under(parent) if "sb-deadbeef0000" in p]
        for _ in range(50):
            if any(e.get("sandbox_id") == short.id and e.get("kind") == "destroyed" for _, e in got):
                break
            await asyncio.sleep(0.1)
        assert any(e.get("sandbox_id") == short.id and e.get("kind") == "destroyed" for _, e in got)
        assert {i.id for i in await c.list()} == {keep.id}
        # the adopted sandbox keeps its range (and the files API writes as its root); the expired
        # one's and the stale claim are released
        assert uid_ranges_of(sdir) == [keep_base], (uid_ranges_of(sdir), keep_base, short_base, stale)
        await keep.files.write("/after.txt", "after")
        r = await keep.exec("stat -c %u /after.txt; cat /proc/self/uid_map")
        assert r.stdout.split()[:3] == ["0", "0", str(keep_base)], r

        await keep.destroy()
        await nc.close()
        await c.close()


async def test_a_call_while_the_node_agent_is_down_gets_unavailable_and_a_paused_one_still_answers():
    """A plain nats-py client calls a sandbox whose node-agent is down (killed, not yet declared
    lost): the scheduler answers `unavailable` as soon as the node's heartbeats are overdue and
    no agent answers the node's ping, instead of leaving the call to the client's timeout. A
    paused agent (SIGSTOP) keeps its subscriptions and answers when resumed: no `unavailable`."""
    async with running_stack(nodes=1, monitor=False, env_builder=False) as stack:
        c = await AsyncClient.connect(stack.url)
        sb = await c.create(image="busybox", cpu=0.1, memory_mb=32)
        nc = await nats.connect(stack.url)
        subject = subjects.sandbox_op(sb.id, "exec")
        agent = stack.proc("node-1").popen
        try:
            os.kill(agent.pid, signal.SIGSTOP)
            call = asyncio.ensure_future(nc.request(subject, json.dumps({"cmd": "echo resumed"}).encode(), timeout=30))
            await asyncio.sleep(3.5)  # heartbeats overdue: the scheduler pings, the paused agent cannot answer it
            os.kill(agent.pid, signal.SIGCONT)
            body = json.loads((await call).data)
            assert body["ok"] is True and body["result"]["stdout"] == "resumed\n", body

            agent.send_signal(signal.SIGKILL)
            agent.wait()
            replies: list[dict] = []
            inbox = nc.new_inbox()

            async def on_reply(m) -> None:
                replies.append(json.loads(m.data))

            await nc.subscribe(inbox, cb=on_reply)
            await nc.publish(subject, json.dumps({"cmd": "echo lost"}).encode(), reply=inbox)
            for _ in range(150):  # 15 s: the client's own timeout for this call would be ~70 s
                if replies:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            assert len(replies) == 1, replies  # one answer, from the scheduler
            err = replies[0]
            assert err["ok"] is False and err["error"]["code"] == "unavailable", err
            assert "node-1" in err["error"]["message"] and "not running" in err["error"]["message"], err

            stack.restart("node-1")
            await _wait_node(stack.url, "node-1")
            r = await sb.exec("echo back")  # adopted by the new agent
            assert r.stdout == "back\n", r
            await sb.destroy()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGCONT)
            await nc.close()
            await c.close()


async def test_sandbox_that_dies_on_its_own_is_reported_and_cleaned(stack, client):
    nc = await nats.connect(stack.url)
    got: list[dict] = []

    async def on_msg(m) -> None:
        got.append(json.loads(m.data))

    await nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_msg)
    try:
        sb = await client.create(image="busybox", cpu=0.1, memory_mb=32)
        sdir = f"{stack.data_dir}/nodes/node-1/sandboxes/{sb.id}"
        with open(f"{sdir}/init.pid") as f:
            os.kill(int(f.read()), signal.SIGKILL)  # e.g. the host OOM killer, or an operator
        for _ in range(100):
            if any(e["sandbox_id"] == sb.id and e["kind"] == "destroyed" for e in got):
                break
            await asyncio.sleep(0.05)
        kinds = [e["kind"] for e in got if e["sandbox_id"] == sb.id]
        assert kinds[-2:] == ["exited", "destroyed"], kinds
        assert not os.path.exists(sdir)
        assert not [p for p in cgroups_under(cgroup_parent(stack.data_dir, "node-1")) if sb.id in p]
    finally:
        await nc.close()


async def test_stack_stop_leaves_nothing_of_a_node_agent_killed_for_good():
    """A node-agent killed with -9 and never restarted (a crashed test, a lost machine) leaves its
    sandboxes' inits running under PID 1; stopping the stack kills them and removes the node's
    cgroups, its parent included, and the mounts."""
    stack = make_stack(nodes=1, monitor=False, env_builder=False)
    await stack.start()
    try:
        c = await AsyncClient.connect(stack.url)
        sbs = [await c.create(image="busybox", memory_mb=32) for _ in range(2)]
        await c.close()
        parent = cgroup_parent(stack.data_dir, "node-1")
        agent = stack.proc("node-1").popen
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        inits = [p for p in _procs_in(parent)]
        assert len(inits) >= 2  # still running without their agent
    finally:
        await stack.stop()
    assert not _procs_in(parent) and not cgroups_under(parent), cgroups_under(parent)
    assert not uid_ranges_of(f"{stack.data_dir}/nodes/node-1/sandboxes"), "claims of the killed agent's sandboxes"
    assert not [d for d in os.listdir("/sys/fs/cgroup") if os.path.isdir(f"/sys/fs/cgroup/{d}/{parent}")]
    assert not mounts_under(stack.data_dir)
    assert sbs
    shutil.rmtree(stack.data_dir, ignore_errors=True)


async def test_a_node_agent_stopped_for_good_removes_its_cgroup_parent():
    """A node-agent that stops (SIGTERM) destroys its sandboxes and leaves nothing on the host, its
    cgroup parent included (deploy/compose_check.py found it left behind once compose was down:
    no stack guard sweeps there)."""
    stack = make_stack(nodes=1, monitor=False, env_builder=False)
    await stack.start()
    try:
        async with await AsyncClient.connect(stack.url) as c:
            sb = await c.create(image="busybox", memory_mb=32)
            assert (await sb.exec("echo hi")).stdout == "hi\n"
        parent = cgroup_parent(stack.data_dir, "node-1")
        assert [d for d in os.listdir("/sys/fs/cgroup") if os.path.isdir(f"/sys/fs/cgroup/{d}/{parent}")]
        agent = stack.proc("node-1").popen
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
        assert not [d for d in os.listdir("/sys/fs/cgroup") if os.path.isdir(f"/sys/fs/cgroup/{d}/{parent}")]
    finally:
        await stack.stop()
    shutil.rmtree(stack.data_dir, ignore_errors=True)


def _procs_in(parent: str) -> list[int]:
    from ..leaks import cgroup_pids

    return cgroup_pids(f"/sys/fs/cgroup/pids/{parent}")


async def _until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll an async condition until it holds (or fail naming it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_node_declared_lost_while_alive_keeps_its_sandboxes():
    """A node-agent that is only stopped (SIGSTOP: paused, overloaded) long enough to be declared
    lost: the scheduler deletes its placements and then says so; once it runs again it writes
    the placements of its live sandboxes back, and they are listed and usable again."""
    stack = make_stack(nodes=1, monitor=False, env_builder=False, node_args=["--heartbeat-s", "0.5"],
                       scheduler_args=["--stale-after-s", "2"])
    await stack.start()
    node = "node-1"
    try:
        c = await AsyncClient.connect(stack.url)
        sbs = [await c.create(image="busybox", cpu=0.1, memory_mb=32) for _ in range(2)]
        ids = {sb.id for sb in sbs}
        await sbs[0].files.write("/state.txt", "still here")
        nc = await nats.connect(stack.url)
        kv = await nc.jetstream().key_value("corral_placements")
        got: list[tuple[str, dict]] = []
        at_lost: dict[str, bool] = {}  # sandbox -> its placement was in KV when the node-lost event came

        async def on_msg(m) -> None:
            got.append((m.subject, json.loads(m.data)))
            if m.subject == subjects.node_event(node, "lost"):
                for sid in ids:
                    try:
                        await kv.get(sid)
                        at_lost[sid] = True
                    except Exception:
                        at_lost[sid] = False

        await nc.subscribe(subjects.EVENTS_ALL, cb=on_msg)
        agent = stack.proc(node).popen
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            async def declared() -> bool:
                return len(at_lost) == len(ids)

            await _until(declared, what="the node-lost event")
            assert at_lost == {sid: False for sid in ids}  # the placements were deleted before the event

            async def unlisted() -> bool:
                return not ids & {i.id for i in await c.list()}

            await _until(unlisted, what="the sandboxes to drop out of the list")
            lost = {e["sandbox_id"] for s, e in got if s.startswith(subjects.SANDBOX_EVENTS_ALL.removesuffix(">")) and e.get("kind") == "lost"}
            assert lost == ids
        finally:
            os.kill(agent.pid, signal.SIGCONT)

        async def listed() -> bool:
            return ids <= {i.id for i in await c.list()}

        await _until(listed, what="the sandboxes to be listed again")
        r = await sbs[0].exec("cat /state.txt")
        assert r.exit_code == 0 and r.stdout == "still here", r
        assert (await sbs[1].exec("echo ok")).stdout == "ok\n"
        back = {e["sandbox_id"] for s, e in got if e.get("kind") == "ready" and "written back" in e.get("reason", "")}
        assert back == ids, got
        for sid in ids:  # placements are in KV again, naming the node
            assert json.loads((await kv.get(sid)).value)["node"] == node
        for sb in sbs:
            await sb.destroy()
        await nc.close()
        await c.close()
    finally:
        try:
            os.kill(stack.proc(node).popen.pid, signal.SIGCONT)
        except Exception:
            pass
        await stack.stop()
    assert_clean(stack.data_dir, node)
    shutil.rmtree(stack.data_dir, ignore_errors=True)


async def test_batch_claims_of_an_agent_killed_mid_batch_are_removed():
    """A node-agent killed -9 in the middle of a node batch leaves `creating` claims in the
    placements KV; the next agent on the node removes them (compare-and-set: only while the key
    still holds that claim) and their notes on disk; finished sandboxes are adopted."""
    import secrets

    # the restarted agent must be the one that finds the claims: with the default 5 s, a restart
    # slower than that under load lets the scheduler declare the node lost first and delete them
    # itself (reported as `lost`, not `failed`), which is test_node_lost's subject, not this one's
    async with running_stack(nodes=1, monitor=False, env_builder=False, scheduler_args=["--stale-after-s", "120"]) as stack:
        node = "node-1"
        notes = f"{stack.data_dir}/nodes/{node}/claims"
        nc = await nats.connect(stack.url)
        kv = await nc.jetstream().key_value("corral_placements")
        creating: list[str] = []

        async def on_kv(m) -> None:
            if m.data and json.loads(m.data).get("state") == "creating":
                creating.append(m.subject.rsplit(".", 1)[1])

        await nc.subscribe(subjects.kv_key(subjects.KV_PLACEMENTS, ">"), cb=on_kv)
        ids = [f"sb-{secrets.token_hex(6)}" for _ in range(12)]
        body = {"items": [{"sandbox_id": sid, "spec": {"image": "busybox", "cpu": 0.05, "memory_mb": 32}} for sid in ids]}
        call = asyncio.ensure_future(nc.request(subjects.node_create_batch(node), json.dumps(body).encode(), timeout=60))

        async def claimed() -> bool:
            return bool(creating)

        await _until(claimed, what="a creating claim")
        agent = stack.proc(node).popen
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        call.cancel()
        # creates the kill interrupted (their claims are in KV); a note the kill caught while it was
        # being written is still `<id>.tmp` (notes are written before the claim, so it has none)
        left = {name.removesuffix(".tmp") for name in os.listdir(notes)}
        assert left and left <= set(ids), left

        # and two notes planted as a predecessor killed between its claim and its create would
        # leave them: one whose claim is still in KV, one whose key was written since (a retried
        # batch placed it on another node): only the first may be deleted
        stale, taken = f"sb-{secrets.token_hex(6)}", f"sb-{secrets.token_hex(6)}"
        claim = json.dumps({"id": stale, "node": node, "state": "creating", "substrate": "container", "image": "busybox",
                            "created_at": 1.0, "expires_at": 2.0}).encode()
        await kv.create(stale, claim)
        with open(f"{notes}/{stale}", "wb") as f:
            f.write(claim)
        other = json.dumps({"id": taken, "node": "node-elsewhere", "state": "running", "substrate": "container",
                            "image": "busybox", "created_at": 1.0, "expires_at": 2.0}).encode()
        await kv.create(taken, claim.replace(stale.encode(), taken.encode()))
        with open(f"{notes}/{taken}", "wb") as f:
            f.write(claim.replace(stale.encode(), taken.encode()))
        await kv.put(taken, other)

        got: list[dict] = []

        async def on_ev(m) -> None:
            got.append(json.loads(m.data))

        await nc.subscribe(subjects.SANDBOX_EVENTS_ALL, cb=on_ev)
        stack.restart(node)
        await _wait_node(stack.url, node)

        assert os.listdir(notes) == []
        c = await AsyncClient.connect(stack.url)
        adopted = {i.id for i in await c.list() if i.node == node}
        for sid in left - adopted:  # an interrupted create that was not adopted: its claim is gone
            try:
                await kv.get(sid)
                raise AssertionError(f"claim of {sid} is still there")
            except Exception as e:
                assert "not found" in str(e).lower() or "deleted" in type(e).__name__.lower(), e
        async def claims_settled() -> bool:
            """No claim is left in `creating`: each is gone or the running sandbox's placement. A
            sandbox made just before the kill, whose placement write (in the background) the kill
            cut off, is adopted and written back after the new agent's first heartbeat."""
            for sid in ids + [stale]:
                try:
                    e = await kv.get(sid)
                except Exception:
                    continue
                info = json.loads(e.value)
                if not (info["state"] == "running" and info["node"] == node):
                    settled.append(info)
                    return False
            return True

        settled: list[dict] = []
        try:
            await _until(claims_settled, timeout=20, what="claims settled")
        except AssertionError:
            raise AssertionError(f"a claim is left in `creating`: {settled[-1]} (interrupted {left}, adopted {adopted})") from None
        assert json.loads((await kv.get(taken)).value)["node"] == "node-elsewhere"
        try:
            await kv.get(stale)
            raise AssertionError("the stale claim is still there")
        except Exception as e:
            assert "not found" in str(e).lower() or "deleted" in type(e).__name__.lower(), e

        async def failed_event() -> bool:
            return any(e.get("sandbox_id") == stale and e.get("kind") == "failed" for e in got)

        await _until(failed_event, what="the failed event of the stale claim")
        # what the killed batch finished was adopted and works
        listed = {i.id for i in await c.list() if i.node == node}
        assert listed <= set(ids), listed
        for sid in listed:
            sb = c.sandbox(sid)
            assert (await sb.exec("echo ok")).stdout == "ok\n"
            await sb.destroy()
        await kv.delete(taken)
        await c.close()
        await nc.close()


def _free_base() -> int:
    """A host uid range base no claim holds (services/node-agent .../userns.py's layout)."""
    taken = set(os.listdir(UID_CLAIMS))
    return next(b for b in range(0x6FFF0000 - 65536, 0x80000, -65536) if str(b) not in taken)
