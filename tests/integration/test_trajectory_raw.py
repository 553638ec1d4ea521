"""Trajectory steps through the documented JSON contract alone: plain nats-py, no SDK, no
`corral.v1.traj.open`. An outside client that sends `trajectory` and `step` with its execs must get
what the README promises: every step logged, a retried step answered from the log without running
again (also when the retries arrive while the first issue is still running), a different command
at a logged step refused with `conflict`.

The subjects are spelled out as an outside client would spell them: the contract is what is tested."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest

# a command that appends to a file: running it twice shows in the file and in its output
APPEND = "echo {tag} >> /log; wc -l < /log"
# the same, but it then waits until /go exists: the test decides when it ends
APPEND_THEN_WAIT = "echo {tag} >> /log; while [ ! -e /go.{tag} ]; do sleep 0.02; done; wc -l < /log"


async def call(nc, subject: str, body: dict, timeout: float = 60.0) -> dict:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return json.loads(msg.data)


def result(reply: dict) -> dict:
    assert reply.get("ok"), reply
    return reply["result"]


@pytest.fixture
async def raw_sandbox(nc):
    """A busybox sandbox made over the bus; destroyed afterwards (and the test's trajectories deleted)."""
    made: list[str] = []
    trajectories: list[str] = []

    async def make() -> str:
        r = await call(nc, "corral.v1.sandbox.create", {"image": "busybox", "cpu": 0.2, "memory_mb": 64, "ttl_s": 600})
        assert r.get("ok"), r
        made.append(r["sandbox"]["id"])
        return made[-1]

    def traj(name: str) -> str:
        trajectories.append(f"raw-{name}-{uuid.uuid4().hex[:8]}")
        return trajectories[-1]

    yield make, traj
    for sid in made:
        await call(nc, f"corral.v1.sandbox.{sid}.destroy", {})
    for tid in trajectories:
        await call(nc, "corral.v1.traj.delete", {"id": tid})


async def exec_(nc, sid: str, cmd: str, **kw) -> dict:
    return await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": cmd, **kw})


async def plain(nc, sid: str, cmd: str) -> str:
    """An exec outside any trajectory: how the test looks into the sandbox."""
    r = result(await exec_(nc, sid, cmd))
    assert r["exit_code"] == 0, r
    return r["stdout"]


async def test_retried_raw_steps_run_once_and_divergence_is_a_conflict(nc, raw_sandbox):
    make, traj = raw_sandbox
    sid, tid = await make(), traj("retry")
    for step, tag in enumerate(("a", "b")):
        replies = [result(await exec_(nc, sid, APPEND.format(tag=tag), trajectory=tid, step=step)) for _ in range(3)]
        assert [r["replayed"] for r in replies] == [False, True, True], replies
        assert {r["stdout"] for r in replies} == {f"{step + 1}\n"}
    assert await plain(nc, sid, "cat /log") == "a\nb\n", "a retried step ran again"

    # the step is logged: a different command there is refused and does not run
    r = await exec_(nc, sid, "echo other >> /log", trajectory=tid, step=0)
    assert not r["ok"] and r["error"]["code"] == "conflict", r
    assert "echo a >> /log" in r["error"]["message"] and "echo other >> /log" in r["error"]["message"]
    # the same inputs in another session are other inputs: a conflict too
    r = await exec_(nc, sid, APPEND.format(tag="a"), trajectory=tid, step=0, session="s")
    assert not r["ok"] and r["error"]["code"] == "conflict", r
    assert await plain(nc, sid, "cat /log") == "a\nb\n"

    # the first exec opened the trajectory, bound to this sandbox, as `traj.open` would have
    g = await call(nc, "corral.v1.traj.get", {"id": tid})
    assert g["ok"] and g["trajectory"]["sandbox_id"] == sid and g["trajectory"]["last_step"] == 1, g
    assert [e["step"] for e in g["recent"]] == [0, 1]

    # on_divergence "truncate" drops the log from that step on and runs the new command
    r = result(await exec_(nc, sid, "echo B >> /log; wc -l < /log", trajectory=tid, step=1, on_divergence="truncate"))
    assert (r["replayed"], r["stdout"]) == (False, "3\n")
    r = result(await exec_(nc, sid, "echo B >> /log; wc -l < /log", trajectory=tid, step=1))
    assert (r["replayed"], r["stdout"]) == (True, "3\n")
    assert await plain(nc, sid, "cat /log") == "a\nb\nB\n"

    # a gap is refused, and an unknown trajectory is not opened by a step other than 0
    r = await exec_(nc, sid, "true", trajectory=tid, step=5)
    assert not r["ok"] and r["error"]["code"] == "invalid_request" and "skips steps 2..4" in r["error"]["message"], r
    fresh = traj("fresh")
    r = await exec_(nc, sid, "true", trajectory=fresh, step=2)
    assert not r["ok"] and r["error"]["code"] == "invalid_request" and "start at step 0" in r["error"]["message"], r
    g = await call(nc, "corral.v1.traj.get", {"id": fresh})
    assert not g["ok"] and g["error"]["code"] == "not_found", g


async def test_a_new_step_on_another_sandbox_is_refused(nc, raw_sandbox):
    """A trajectory's state lives in the sandbox it is bound to: its next step cannot run in
    another one (which is also what keeps a step from running once on each of two nodes).
    Logged steps still answer from the log wherever they are asked."""
    make, traj = raw_sandbox
    first, other, tid = await make(), await make(), traj("bound")
    assert not result(await exec_(nc, first, APPEND.format(tag="a"), trajectory=tid, step=0))["replayed"]
    r = await exec_(nc, other, APPEND.format(tag="b"), trajectory=tid, step=1)
    assert not r["ok"] and r["error"]["code"] == "conflict" and first in r["error"]["message"], r
    r = result(await exec_(nc, other, APPEND.format(tag="a"), trajectory=tid, step=0))
    assert (r["replayed"], r["stdout"]) == (True, "1\n")
    assert await plain(nc, other, "cat /log 2>/dev/null || true") == ""
    assert await plain(nc, first, "cat /log") == "a\n"


@pytest.mark.parametrize("opened", [False, True], ids=["implicit", "opened"])
async def test_concurrent_retries_of_a_new_step_run_it_once(nc, raw_sandbox, opened):
    """The bad ordering, forced: the step's first issue is running (its line is in /log, and it
    waits for /go.<tag>) when two more issues of the same step arrive; only then may it end.
    Step 0 (of a fresh trajectory, the implicit open races too) and a later step; also on a
    trajectory opened with `traj.open` first, as the SDK does."""
    make, traj = raw_sandbox
    sid, tid = await make(), traj("concurrent")
    if opened:
        spec = {"image": "busybox", "cpu": 0.2, "memory_mb": 64}
        r = await call(nc, "corral.v1.traj.open", {"id": tid, "sandbox_id": sid, "spec": spec, "snapshot_every": 0})
        assert r["ok"], r
    tags = ("a", "b")
    for step, tag in enumerate(tags):
        body = {"cmd": APPEND_THEN_WAIT.format(tag=tag), "trajectory": tid, "step": step}
        first = asyncio.create_task(call(nc, f"corral.v1.sandbox.{sid}.exec", body))
        deadline = asyncio.get_running_loop().time() + 60
        while await plain(nc, sid, "cat /log 2>/dev/null || true") != "".join(f"{t}\n" for t in tags[:step + 1]):
            assert asyncio.get_running_loop().time() < deadline, "the first issue never started"
            assert not first.done(), first.result()
            await asyncio.sleep(0.02)
        retries = [asyncio.create_task(call(nc, f"corral.v1.sandbox.{sid}.exec", body)) for _ in range(2)]
        await nc.flush()
        # published after the retries on the same connection, so the node-agent receives it after them
        r = await call(nc, f"corral.v1.sandbox.{sid}.files.write", {"path": f"/go.{tag}", "content_b64": ""})
        assert r["ok"], r
        replies = [result(r) for r in await asyncio.gather(first, *retries)]
        assert [r["replayed"] for r in replies] == [False, True, True], replies
        assert {r["stdout"] for r in replies} == {f"{step + 1}\n"}
    assert await plain(nc, sid, "cat /log") == "a\nb\n", "a step ran more than once"


async def test_a_step_logged_before_its_metadata_is_replayed(nc, raw_sandbox):
    """The node appends a step to CORRAL_TRAJ, then advances the metadata in KV; a node that dies
    between the two leaves the step logged and the metadata behind. That state, forced by putting
    the metadata back: a retry of the step is answered from the log, not run again."""
    make, traj = raw_sandbox
    sid, tid = await make(), traj("behind")
    assert not result(await exec_(nc, sid, APPEND.format(tag="a"), trajectory=tid, step=0))["replayed"]
    kv = await nc.jetstream().key_value("corral_traj")
    meta = json.loads((await kv.get(tid)).value)
    assert meta["last_step"] == 0
    await kv.put(tid, json.dumps({**meta, "last_step": -1}).encode())
    r = result(await exec_(nc, sid, APPEND.format(tag="a"), trajectory=tid, step=0))
    assert (r["replayed"], r["stdout"]) == (True, "1\n")
    assert json.loads((await kv.get(tid)).value)["last_step"] == 0
    assert not result(await exec_(nc, sid, APPEND.format(tag="b"), trajectory=tid, step=1))["replayed"]
    assert await plain(nc, sid, "cat /log") == "a\nb\n"
