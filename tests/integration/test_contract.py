"""The v1 bus contract spoken as raw JSON with plain nats-py (no SDK), on every subject."""
from __future__ import annotations

import base64
import functools
import json
import os
import re

import jsonschema
import pytest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "contract", "asyncapi.json")


@functools.cache
def _published() -> tuple[dict, list[tuple[re.Pattern, str]]]:
    """The committed AsyncAPI document and, per operation, its subject as a regex and its reply type."""
    with open(DOC) as f:
        doc = json.load(f)
    routes = []
    for name, op in doc["operations"].items():
        if op["action"] != "receive":
            continue
        address = doc["channels"][name]["address"]
        pattern = re.escape(address).replace(r"\{", "{").replace(r"\}", "}")
        pattern = re.sub(r"\{[a-z_]+\}", r"[^.]+", pattern)
        reply = op["reply"]["messages"][0]["$ref"].rsplit("/", 1)[-1]
        routes.append((re.compile(pattern + "$"), reply))
    return doc, routes


def conforms(subject: str, reply: dict) -> None:
    """A real reply matches the schema docs/contract publishes for it: the operation's reply type
    when ok, ErrorReply otherwise. A subject the document does not name (a made-up op) must be
    answered with an error."""
    doc, routes = _published()
    types = [t for rx, t in routes if rx.match(subject)]
    name = types[0] if types and reply.get("ok") else "ErrorReply"
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    errors = [f"{list(e.path)}: {e.message[:200]}" for e in jsonschema.Draft202012Validator(schema).iter_errors(reply)]
    assert not errors, (subject, name, errors[:3])


async def call(nc, subject: str, body, timeout: float = 30.0) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(subject, data, timeout=timeout)
    reply = json.loads(msg.data)
    conforms(subject, reply)
    return reply


def assert_error(reply: dict, code: str, *words: str) -> None:
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    msg = reply["error"]["message"]
    assert isinstance(msg, str) and len(msg) > 10, reply
    for w in words:
        assert w in msg, (w, msg)


@pytest.fixture
async def sid(nc):
    r = await call(nc, "corral.v1.sandbox.create", {"image": "busybox", "cpu": 0.25, "memory_mb": 64, "labels": {"t": "contract"}, "job": "contract"})
    assert r["ok"] is True, r
    yield r["sandbox"]["id"]
    await nc.request(f"corral.v1.sandbox.{r['sandbox']['id']}.destroy", b"{}", timeout=30)


async def test_create_reply_shape(nc, sid):
    r = await call(nc, f"corral.v1.sandbox.{sid}.info", {})
    assert r["ok"] is True
    info = r["sandbox"]
    for field in ("id", "node", "state", "substrate", "image", "created_at", "expires_at"):
        assert field in info, field
    assert info["id"] == sid and info["state"] == "running" and info["substrate"] == "container"
    assert info["expires_at"] > info["created_at"]


async def test_exec_string_and_argv(nc, sid):
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "echo $((6*7)); echo err >&2; exit 3"})
    assert r["ok"] is True
    res = r["result"]
    assert res["exit_code"] == 3 and res["stdout"] == "42\n" and res["stderr"] == "err\n"
    assert res["timed_out"] is False and res["truncated"] is False and res["replayed"] is False
    assert res["duration_ms"] > 0
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": ["echo", "a b", "$HOME"], "env": {"X": "1"}, "cwd": "/tmp", "stdin": ""})
    assert r["result"]["stdout"] == "a b $HOME\n"


async def test_exec_stdin_env_cwd(nc, sid):
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "cat; echo $FOO; pwd", "stdin": "in\n", "env": {"FOO": "bar"}, "cwd": "/tmp"})
    assert r["result"]["stdout"] == "in\nbar\n/tmp\n"


async def test_exec_output_cap(nc, sid):
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "head -c 100000 /dev/zero | tr '\\0' x", "max_output_bytes": 1000})
    assert r["result"]["truncated"] is True
    assert len(r["result"]["stdout"]) == 1000


async def test_exec_stream(nc, sid):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"corral.v1.sandbox.{sid}.exec", json.dumps({"cmd": "echo one; sleep 0.3; echo two", "stream": True}).encode(), reply=inbox)
    msgs = []
    while True:
        m = json.loads((await sub.next_msg(timeout=10)).data)
        msgs.append(m)
        if "ok" in m:
            break
    chunks = [m for m in msgs if m.get("kind") == "chunk"]
    assert [c["data"] for c in chunks] == ["one\n", "two\n"]
    assert msgs[-1]["ok"] is True and msgs[-1]["result"]["stdout"] == "one\ntwo\n"


async def test_sessions_keep_cwd_and_exports(nc, sid):
    subj = f"corral.v1.sandbox.{sid}.exec"
    await call(nc, subj, {"cmd": "mkdir -p /w && cd /w && export K=v1", "session": "a"})
    r = await call(nc, subj, {"cmd": "pwd; echo $K", "session": "a"})
    assert r["result"]["stdout"] == "/w\nv1\n"
    r = await call(nc, subj, {"cmd": "pwd; echo ${K:-unset}", "session": "b"})
    assert r["result"]["stdout"] == "/\nunset\n"
    r = await call(nc, subj, {"cmd": "pwd; echo ${K:-unset}"})
    assert r["result"]["stdout"] == "/\nunset\n"
    r = await call(nc, subj, {"cmd": "read x; echo got $x; false", "session": "a", "stdin": "hello\n"})
    assert r["result"]["stdout"] == "got hello\n" and r["result"]["exit_code"] == 1


async def test_files_write_read(nc, sid):
    payload = bytes(range(256)) * 10
    r = await call(nc, f"corral.v1.sandbox.{sid}.files.write", {"path": "/data/x.bin", "content_b64": base64.b64encode(payload).decode(), "mode": 0o600})
    assert r["ok"] is True, r
    r = await call(nc, f"corral.v1.sandbox.{sid}.files.read", {"path": "/data/x.bin"})
    assert r["ok"] is True
    assert base64.b64decode(r["file"]["content_b64"]) == payload
    assert r["file"]["mode"] == 0o600
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "wc -c < /data/x.bin; stat -c %a /data/x.bin"})
    assert r["result"]["stdout"].split() == ["2560", "600"]


async def test_list_filters(nc, sid):
    r = await call(nc, "corral.v1.sandbox.list", {"job": "contract"})
    assert r["ok"] is True and sid in [s["id"] for s in r["sandboxes"]]
    r = await call(nc, "corral.v1.sandbox.list", {"labels": {"t": "contract"}})
    assert sid in [s["id"] for s in r["sandboxes"]]
    r = await call(nc, "corral.v1.sandbox.list", {"job": "no-such-job"})
    assert r["sandboxes"] == []


async def test_pause_resume(nc, sid):
    r = await call(nc, f"corral.v1.sandbox.{sid}.pause", {})
    assert r["ok"] is True and r["sandbox"]["state"] == "paused"
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "true"})
    assert_error(r, "conflict", "paused")
    r = await call(nc, f"corral.v1.sandbox.{sid}.resume", {})
    assert r["ok"] is True and r["sandbox"]["state"] == "running"
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "true"})
    assert r["ok"] is True


async def test_snapshot_then_fork(nc, sid):
    await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "mkdir -p /work && echo state > /work/s.txt && rm /bin/vi"})
    r = await call(nc, f"corral.v1.sandbox.{sid}.snapshot", {"name": "contract-snap", "labels": {"k": "v"}})
    assert r["ok"] is True, r
    assert r["image"]["name"] == "contract-snap" and len(r["image"]["layers"]) == 2
    assert r["image"]["labels"] == {"k": "v", "snapshot_of": sid}
    # registered by the image-cache (the catalog's one writer): listed, its new layer inspectable
    listed = {i["name"]: i for i in (await call(nc, "corral.v1.image.list", {}))["images"]}
    assert listed["contract-snap"]["layers"] == r["image"]["layers"] and listed["contract-snap"]["parent"] == "busybox"
    top = (await call(nc, "corral.v1.image.inspect", {"name": "contract-snap"}))["layers"][-1]
    assert top["digest"] == r["layer"] == r["image"]["layers"][-1] and top["source"] == f"snapshot:{sid}" and top["size"] == r["size"]
    # the source keeps running
    assert (await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "cat /work/s.txt"}))["result"]["stdout"] == "state\n"
    b = await call(nc, "corral.v1.sandbox.create_batch", {"spec": {"image": "contract-snap", "cpu": 0.1, "memory_mb": 32}, "count": 3})
    assert b["ok"] is True, b
    for s in b["sandboxes"]:
        out = await call(nc, f"corral.v1.sandbox.{s['id']}.exec", {"cmd": "cat /work/s.txt; ls /bin/vi 2>&1 || echo gone"})
        assert out["result"]["stdout"].startswith("state\n") and out["result"]["stdout"].endswith("gone\n"), out
        await call(nc, f"corral.v1.sandbox.{s['id']}.destroy", {})
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.snapshot", {"name": "Bad Name"}), "invalid_request", "image name")
    assert (await call(nc, "corral.v1.image.delete", {"name": "contract-snap"}))["ok"] is True


async def test_create_batch_and_destroy(nc):
    r = await call(nc, "corral.v1.sandbox.create_batch", {"spec": {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "job": "batch"}, "count": 5})
    assert r["ok"] is True, r
    ids = [s["id"] for s in r["sandboxes"]]
    assert len(set(ids)) == 5 and r["failed"] == []
    for i in ids:
        r = await call(nc, f"corral.v1.sandbox.{i}.destroy", {})
        assert r["ok"] is True
    r = await call(nc, "corral.v1.sandbox.list", {"job": "batch"})
    assert r["sandboxes"] == []


async def test_request_id_idempotent(nc):
    body = {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "request_id": "contract-idem-1"}
    a = await call(nc, "corral.v1.sandbox.create", body)
    b = await call(nc, "corral.v1.sandbox.create", body)
    assert a["ok"] and b["ok"]
    assert a["sandbox"]["id"] == b["sandbox"]["id"]
    await call(nc, f"corral.v1.sandbox.{a['sandbox']['id']}.destroy", {})


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("body,code,words", [
    (b"{not json", "invalid_request", ["malformed JSON"]),
    (b"[1,2]", "invalid_request", []),
    ({"cpu": -1}, "invalid_request", ["cpu"]),
    ({"cpu": "lots"}, "invalid_request", ["cpu"]),
    ({"memory_mb": 1}, "invalid_request", ["memory_mb"]),
    ({"memroy_mb": 64}, "invalid_request", ["memroy_mb"]),
    ({"image": "no-such-image"}, "not_found", ["no-such-image", "busybox"]),
    ({"image": "../etc"}, "invalid_request", ["image"]),
    ({"substrate": "teleport"}, "invalid_request", ["substrate"]),
    ({"substrate": "microvm"}, "invalid_request", ["microvm"]),
    ({"cpu": 0.1, "memory_mb": 1000000}, "capacity", ["memory_mb"]),
])
async def test_create_bad_input(nc, body, code, words):
    r = await call(nc, "corral.v1.sandbox.create", body)
    assert_error(r, code, *words)


@pytest.mark.parametrize("body,code", [
    (b"", "invalid_request"),
    (b"garbage", "invalid_request"),
    ({"cmd": ""}, "invalid_request"),
    ({"cmd": []}, "invalid_request"),
    ({"cmd": 42}, "invalid_request"),
    ({"cmd": "true", "timeout_s": -5}, "invalid_request"),
    ({"cmd": "true", "session": "../x"}, "invalid_request"),
    ({"cmd": "true", "env": {"A=B": "c"}}, "invalid_request"),
    ({"cmd": ["no-such-binary"]}, None),
])
async def test_exec_bad_input(nc, sid, body, code):
    r = await call(nc, f"corral.v1.sandbox.{sid}.exec", body)
    if code is None:  # a command that does not exist is a result, not a request error
        assert r["ok"] is True and r["result"]["exit_code"] == 127 and "no-such-binary" in r["result"]["stderr"]
    else:
        assert_error(r, code)


async def test_files_bad_input(nc, sid):
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.files.read", {"path": "/nope"}), "not_found", "/nope")
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.files.read", {"path": "/etc"}), "invalid_request", "directory")
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.files.read", {}), "invalid_request", "path")
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.files.write", {"path": "/x", "content_b64": "!!!"}), "invalid_request", "base64")
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.files.write", {"path": "/", "content_b64": ""}), "invalid_request")
    assert_error(await call(nc, f"corral.v1.sandbox.{sid}.nosuchop", {}), "invalid_request", "nosuchop")


async def test_unknown_sandbox_gets_not_found(nc):
    for op in ("exec", "info", "destroy", "files.read", "pause"):
        r = await call(nc, f"corral.v1.sandbox.sb-000000000000.{op}", {"cmd": "true", "path": "/x"})
        assert_error(r, "not_found", "sb-000000000000")


async def test_batch_bad_input(nc):
    assert_error(await call(nc, "corral.v1.sandbox.create_batch", {"spec": {}, "count": 0}), "invalid_request", "count")
    assert_error(await call(nc, "corral.v1.sandbox.create_batch", {"count": 2}), "invalid_request", "spec")
    assert_error(await call(nc, "corral.v1.sandbox.create_batch", {"spec": {"cpu": 0.1, "memory_mb": 20000}, "count": 50}), "capacity", "batch")


async def test_services_survive_bad_input(nc):
    for junk in (b"\xff\xfe", b"{" * 10000, b"null", b'{"cpu": 1e309}'):
        r = await call(nc, "corral.v1.sandbox.create", junk)
        assert r["ok"] is False
    r = await call(nc, "corral.v1.sandbox.create", {"image": "busybox", "cpu": 0.1, "memory_mb": 32})
    assert r["ok"] is True
    r2 = await call(nc, f"corral.v1.sandbox.{r['sandbox']['id']}.exec", {"cmd": "echo alive"})
    assert r2["result"]["stdout"] == "alive\n"
    await call(nc, f"corral.v1.sandbox.{r['sandbox']['id']}.destroy", {})


async def test_create_is_answered_by_the_node_directly(nc):
    """The scheduler forwards the client's reply inbox in its node create (`reply_to`); the node
    that made the sandbox answers there itself, once, and the scheduler only records the
    placement (the sandbox is listed, no second answer comes)."""
    import asyncio

    seen: list[dict] = []
    replies: list[dict] = []

    async def on_node_create(m) -> None:  # an observer next to the node-agent: it answers nothing
        seen.append(json.loads(m.data))

    async def on_reply(m) -> None:
        replies.append(json.loads(m.data))

    watch = await nc.subscribe("corral.node.*.create", cb=on_node_create)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish("corral.v1.sandbox.create", json.dumps({"image": "busybox", "cpu": 0.1, "memory_mb": 32}).encode(), reply=inbox)
    for _ in range(300):
        if replies:
            break
        await asyncio.sleep(0.05)
    assert len(replies) == 1 and replies[0]["ok"] is True, replies
    sid = replies[0]["sandbox"]["id"]
    assert "replied" not in replies[0]  # the client's answer is the plain contract reply
    assert [s["reply_to"] for s in seen if s["sandbox_id"] == sid] == [inbox], seen
    try:
        for _ in range(100):  # the scheduler recorded it (a relay would have gone out before this)
            if sid in {s["id"] for s in (await call(nc, "corral.v1.sandbox.list", {}))["sandboxes"]}:
                break
            await asyncio.sleep(0.05)
        await call(nc, "corral.v1.sandbox.list", {})
        assert len(replies) == 1, replies
        r = await call(nc, f"corral.v1.sandbox.{sid}.exec", {"cmd": "echo direct"})
        assert r["result"]["stdout"] == "direct\n"
    finally:
        await sub.unsubscribe()
        await watch.unsubscribe()
        await call(nc, f"corral.v1.sandbox.{sid}.destroy", {})
