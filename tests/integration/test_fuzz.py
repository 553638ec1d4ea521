"""Hostile input on every public subject: 10,000+ malformed messages (random bytes, broken JSON,
wrong types, out-of-range and huge values, unknown and missing fields, deep nesting, payloads
near the bus's limit) sent to a full stack. Every one gets a reply in the envelope (an error
code and a message, or `ok` where the body carries nothing to validate), no service restarts,
every service still serves, and the stack leaves nothing behind (running_stack checks)."""
from __future__ import annotations

import asyncio
import json
import os
import random

import msgspec
import nats
import pytest
import pytest_asyncio

from corral_common.contract import operations, subjects
from corral_common.contract.errors import Code
from corral_sdk import AsyncClient

from ..conftest import ensure_builtin_images, running_stack

pytestmark = pytest.mark.timeout(900)

SEED = 20261204
PER_SUBJECT = int(os.environ.get("FUZZ_PER_SUBJECT", "300"))  # x 35 public subjects (sandbox ops twice: a live sandbox and a missing one)
CODES = {c.value for c in Code}
# ops whose body is empty (anything is accepted) and that change the sandbox: sent only to the
# missing sandbox, so the live one stays up for the rest
DESTRUCTIVE_EMPTY = {"destroy", "pause", "resume"}


def scalar(rng: random.Random):
    return rng.choice([
        None, True, False, 0, -1, 1, 2 ** 63, -(2 ** 70), 1e308, -0.0, float("inf") if rng.random() < 0.01 else 3.5,
        "", "x" * rng.randint(1, 64), "../../etc/passwd", "/", "\u0000", "\u202e", "*", ">",
        subjects.SANDBOX_CREATE, "_INBOX.x", "'; DROP TABLE audit; --", "$(reboot)", "%s%n",
        "a" * rng.choice([1000, 100_000]),
    ])


def value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return scalar(rng)
    if r < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {rng.choice(["cmd", "image", "name", "spec", "path", "x", "", "ok", "error"]) + str(rng.randint(0, 3)):
            value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def wrong_for(rng: random.Random, typ) -> object:
    """A value of the wrong type or outside any sane range for a field of type `typ`."""
    text = str(typ)
    if "int" in text or "float" in text:
        return rng.choice(["12", None, [], {}, 2 ** 80, -(2 ** 80), -1, 1e300, True])
    if "str" in text:
        return rng.choice([12, None, [], {}, "x" * 300_000, "\u0000bad", "../" * 50])
    if "bool" in text:
        return rng.choice(["yes", 2, None, []])
    if "list" in text or "dict" in text:
        return rng.choice(["notalist", 5, {"a": {"b": {"c": [None] * 5}}}, ["x" * 70_000] * 20, [[[[[]]]]] * 100])
    return rng.choice([12, "x", [], None])


def mutated(rng: random.Random, typ: type) -> dict:
    """An invalid body for `typ`: its required fields present with junk, then broken one way."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(typ)}
    body = {name: wrong_for(rng, f.type) if rng.random() < 0.5 else value(rng) for name, f in fields.items() if f.required}
    how = rng.randrange(4)
    if how == 0 or not fields:
        body[f"unknown_{rng.randint(0, 9)}"] = value(rng)
    elif how == 1:
        name, f = rng.choice(list(fields.items()))
        body[name] = wrong_for(rng, f.type)
    elif how == 2 and any(f.required for f in fields.values()):
        body.pop(rng.choice([n for n, f in fields.items() if f.required]), None)
        body[f"unknown_{rng.randint(0, 9)}"] = 1  # and something it cannot accept either
    else:
        for name, f in fields.items():
            body[name] = wrong_for(rng, f.type)
    return body


def payload(rng: random.Random, typ: type) -> bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 2000))
    if kind == 1:
        good = json.dumps(value(rng)).encode()
        return good[: rng.randint(0, max(0, len(good) - 1))] + rng.choice([b"", b"{", b"\xff\xfe", b"]]]", b"nul"])
    if kind == 2:
        return json.dumps(scalar(rng) if rng.random() < 0.5 else [value(rng)]).encode()
    if kind == 3:
        return b"[" * 5000 + b"]" * 5000 if rng.random() < 0.5 else b'{"a":' * 3000 + b"1" + b"}" * 3000
    if kind == 4 and rng.random() < 0.05:
        return json.dumps({"x": "y" * (7 * 1024 * 1024)}).encode()  # near the 8 MB max_payload
    if kind == 5:
        return json.dumps({k: value(rng) for k in ("zz", "yy")}).encode()
    return json.dumps(mutated(rng, typ)).encode()


def schema_valid(body: bytes, typ: type) -> bool:
    """The contract's own verdict (the generated JSON Schemas say the same): a body a random
    mutation left valid (every field of a list filter is optional) may be served."""
    try:
        msgspec.json.decode(body or b"{}", type=typ)  # an empty body means `{}` (bus.decode)
        return True
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False


@pytest_asyncio.fixture(scope="module")
async def full_stack():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1) as s:
        yield s


async def test_ten_thousand_hostile_messages_each_get_an_answer_and_break_nothing(full_stack):
    s = full_stack
    c = await AsyncClient.connect(s.url)
    nc = await nats.connect(s.url, max_reconnect_attempts=-1)
    sb = await c.create(image="busybox", memory_mb=64, ttl_s=1800)
    pids = {p.name: p.popen.pid for p in s.procs}
    rng = random.Random(SEED)
    targets: list[tuple[str, type, bool]] = []  # subject, request type, empty body (anything goes)
    for op in operations.public_operations():
        empty = not msgspec.structs.fields(op.request)
        if "{sandbox_id}" in op.subject:
            opname = op.subject.split("{sandbox_id}.", 1)[1]
            targets.append((subjects.sandbox_op("sb-000000000000", opname), op.request, empty))
            if opname not in DESTRUCTIVE_EMPTY:
                targets.append((subjects.sandbox_op(sb.id, opname), op.request, empty))
        else:
            targets.append((op.subject, op.request, empty))
    sent = 0
    problems: list[str] = []
    slow: list[tuple[float, str, bytes]] = []
    sem = asyncio.Semaphore(32)
    # a call on an unknown sandbox is answered `not_found` only after the scheduler has waited out
    # other replicas' placement writes (~0.3 s of waiting, no work): those get more in flight
    unknown_sem = asyncio.Semaphore(128)
    unknown = subjects.sandbox_op("sb-000000000000", "")

    async def one(subject: str, typ: type, empty: bool, body: bytes) -> None:
        async with unknown_sem if subject.startswith(unknown) else sem:
            t0 = asyncio.get_running_loop().time()
            try:
                msg = await nc.request(subject, body, timeout=60)
            except Exception as e:
                slow.append((99.0, subject, body[:100]))
                problems.append(f"{subject}: no answer to {body[:80]!r}...: {type(e).__name__} {e}")
                return
        slow.append((asyncio.get_running_loop().time() - t0, subject, body[:100]))
        try:
            reply = json.loads(msg.data)
        except ValueError:
            problems.append(f"{subject}: a reply that is not JSON: {msg.data[:100]!r}")
            return
        if not isinstance(reply, dict) or "ok" not in reply:
            problems.append(f"{subject}: a reply without `ok`: {msg.data[:100]!r}")
        elif reply["ok"] is False:
            err = reply.get("error") or {}
            if err.get("code") not in CODES or not err.get("message"):
                problems.append(f"{subject}: an error without a known code and a message: {reply}")
            elif err["code"] == "internal":
                problems.append(f"{subject}: `internal` (a crash, not a refusal) for {body[:120]!r}: {err['message'][:300]}")
        elif not empty and not schema_valid(body, typ):
            problems.append(f"{subject}: accepted a body its schema refuses {body[:200]!r}")

    batch = []
    for subject, typ, empty in targets:
        for _ in range(PER_SUBJECT):
            batch.append(one(subject, typ, empty, payload(rng, typ)))
            sent += 1
    await asyncio.gather(*batch)
    if os.environ.get("FUZZ_DEBUG"):  # the slowest answers, to find what holds a service up
        for x in sorted(slow, key=lambda t: -t[0])[:25]:
            print(f"{x[0]:.2f}s {x[1]} {x[2]!r}")
    assert sent >= 10_000
    kinds: dict[str, str] = {}
    for p in problems:
        kinds.setdefault(p.split(":", 2)[0] + ":" + p.split(":", 2)[1][:40], p)
    assert not problems, f"{len(problems)} of {sent} messages went wrong; one of each kind:\n" + "\n".join(list(kinds.values())[:30])

    # nothing restarted, everything still serves
    assert {p.name: p.popen.pid for p in s.procs} == pids
    assert all(p.popen.poll() is None for p in s.procs), [(p.name, p.popen.poll()) for p in s.procs]
    assert (await sb.exec("echo still")).stdout == "still\n"
    assert sb.id in {i.id for i in await c.list()}
    for subject, body in ((subjects.IMAGE_LIST, b"{}"), (subjects.MONITOR_RULES, b"{}"), (subjects.ENV_LIST, b"{}")):
        r = json.loads((await nc.request(subject, body, timeout=30)).data)
        assert r["ok"] is True, (subject, r)
    await sb.destroy()
    await nc.close()
    await c.close()
