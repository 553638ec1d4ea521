"""`corral.v1.sandbox.run` at most once per `spec.request_id`.

A client whose reply was lost retries with the same request_id; the command must not run twice
(an agent's step, a grader's submission). The first attempt claims the id in the requests KV
bucket (`kv.create`, atomic across scheduler replicas) with a `running` entry and, once the node
has answered, replaces it with a `done` entry holding the reply. A duplicate (a retry, or a
concurrent copy reaching another replica) finds the entry and waits for `done`, then answers with
the stored reply, its result marked `replayed`. The bucket's TTL (24 h) bounds how long a reply is
kept.

What counts as "ran": a reply from a node (success or the node's error) is the outcome. Errors
before any node took the call (no room anywhere, no node answering) delete the claim, so a
retry runs it. A node that never answered leaves the outcome unknown (the command may have run):
that is stored as a `timeout` outcome, not run again. A scheduler that dies mid-run leaves a
`running` entry whose deadline passes; duplicates then get that same `timeout` answer. The same
request_id with a different request is `conflict`."""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common import bus, metrics
from corral_common.contract import envelope, subjects
from corral_common.contract.errors import Code, Conflict, CorralError, InvalidRequest, Unavailable, from_code
from corral_common.contract.messages import NodeRun, RunRequest, SandboxSpec, encoder
from corral_common.contract.replies import RunReply

from . import placement, tenants
from .counters import PLACEMENTS, REJECTIONS
from .registry import Policy, Registry

REPLAYS = metrics.counter("corral_scheduler_run_replays_total", "Runs answered from an earlier attempt with the same request_id", ())
UNKNOWN_OUTCOME_GRACE_S = 5.0
RUN_SLACK_S = 30.0  # beyond the exec's own timeout: image set-up, runc, teardown of a timed-out call

# reads only a reply's `ok`: whether the node ran the call (its reply is then the outcome, even
# one that does not decode) or refused it (nothing ran)
_outcome_decoder = msgspec.json.Decoder(envelope.Reply)
_error_decoder = msgspec.json.Decoder(envelope.ErrorReply)


class Entry(msgspec.Struct, kw_only=True, omit_defaults=True):
    state: Literal["running", "done"]
    digest: str
    deadline: float = 0.0  # running: after this the attempt is presumed lost
    reply: msgspec.Raw = msgspec.Raw(b"null")  # done: the reply as sent to the first caller


class BeforeRun(CorralError):
    """Wraps an error raised before any node took the call: the claim is released for a retry."""

    def __init__(self, err: CorralError):
        super().__init__(err.message, err.code, err.retry_after_s)
        self.err = err


def digest_of(request: msgspec.Struct) -> str:
    """What identifies the request behind a request_id: every field, defaults included (a client
    that spells out a default sends the same request as one that leaves it out)."""
    def canon(x: object) -> object:
        if isinstance(x, msgspec.Struct):
            return {f: canon(getattr(x, f)) for f in x.__struct_fields__}
        if isinstance(x, dict):
            return {k: canon(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [canon(v) for v in x]
        return x

    return hashlib.sha256(msgspec.json.encode(canon(request), order="sorted")).hexdigest()[:32]


def key_of(request_id: str) -> str:
    return "u" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def _exists(e: Exception) -> bool:
    return isinstance(e, KeyWrongLastSequenceError) or "wrong last sequence" in str(e).lower() or "key exists" in str(e).lower()


def _error_reply(e: CorralError) -> bytes:
    return envelope.encode(envelope.ErrorReply(error=envelope.error_of(e)))


def _refusal(node: str, data: bytes) -> CorralError:
    """A node's error reply (`ok` false) as the error it stands for."""
    try:
        body = _error_decoder.decode(data).error
    except msgspec.DecodeError as e:
        return CorralError(f"node {node} sent a malformed error reply: {e}", Code.INTERNAL)
    return from_code(body.code, body.message, body.retry_after_s)


def _replayed(stored: bytes) -> RunReply:
    """The first attempt's reply with `result.replayed` set, so the caller can tell; its error
    raised if it failed."""
    reply = envelope.decode_reply(stored, RunReply)
    reply.result.replayed = True
    return reply


class RunOnce:
    def __init__(self, kv: KeyValue):
        self.kv = kv

    async def run(self, request_id: str, request: msgspec.Struct, wait_s: float, fn: Callable[[], Awaitable[RunReply]]) -> RunReply:
        """`fn()` once for this request_id; its reply, or the first attempt's (marked replayed).
        `fn` raises BeforeRun for errors that leave nothing run; any other CorralError is the
        outcome (stored); other exceptions leave the claim to expire."""
        key = key_of(request_id)
        digest = digest_of(request)
        while True:
            claim = Entry(state="running", digest=digest, deadline=time.time() + wait_s)
            try:
                await self.kv.create(key, encoder.encode(claim))
            except Exception as e:
                if not _exists(e):
                    raise
                stored = await self._wait(key, request_id, digest)
                if stored is None:
                    continue  # the earlier attempt ended before running anything: ours to run
                REPLAYS.inc()
                return _replayed(stored)
            try:
                reply = await fn()
            except BeforeRun as e:
                try:
                    await self.kv.delete(key)
                except Exception:  # a claim left behind only costs a retry its deadline wait: never a second run
                    pass
                raise e.err from None
            except CorralError as e:
                await self._store(key, digest, _error_reply(e))
                raise
            await self._store(key, digest, envelope.encode(reply))
            return reply

    async def _store(self, key: str, digest: str, reply: bytes) -> None:
        try:
            await self.kv.put(key, encoder.encode(Entry(state="done", digest=digest, reply=msgspec.Raw(reply))))
        except Exception as e:  # too large for the bus, or JetStream trouble: keep what retries must know
            note = CorralError(f"an earlier attempt with this request_id ran, but its reply ({len(reply)} bytes) could not be "
                               f"kept for retries ({e}); it is not run again", Code.CONFLICT)
            try:
                await self.kv.put(key, encoder.encode(Entry(state="done", digest=digest, reply=msgspec.Raw(_error_reply(note)))))
            except Exception:  # the caller gets `note`; a retry waits out the claim: never a second run
                pass

    async def _wait(self, key: str, request_id: str, digest: str) -> bytes | None:
        """The stored reply once the attempt holding the claim is done; None if it released it."""
        delay = 0.005
        while True:
            try:
                e = await self.kv.get(key)
            except KeyNotFoundError:
                return None
            if e is None or not e.value:
                return None
            entry = msgspec.json.decode(e.value, type=Entry)
            if entry.digest != digest:
                raise Conflict(f"request_id {request_id!r} was already used for a different run request; "
                               f"use a new request_id for a new command")
            if entry.state == "done":
                return bytes(entry.reply)
            if time.time() > entry.deadline + UNKNOWN_OUTCOME_GRACE_S:
                raise CorralError(f"an earlier attempt with request_id {request_id!r} did not finish by its deadline; its outcome "
                                  f"is unknown (the command may have run), so it is not run again", Code.TIMEOUT)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)


class Runs:
    """`corral.v1.sandbox.run`: place a one-shot call on a node offering its substrate (spread,
    like create; the next candidate on `capacity`/`unavailable`) and relay the node's answer
    `{"ok", "result", "sandbox_id", "node"}`. No sandbox is recorded: it is gone when the reply
    arrives. With `spec.request_id` the call runs at most once (RunOnce): a retry gets the first
    attempt's reply, marked `replayed`."""

    def __init__(self, nc: NATS, kv_requests: KeyValue, registry: Registry, policy: Policy):
        self.nc = nc
        self.registry = registry
        self.policy = policy
        self.once = RunOnce(kv_requests)

    async def on_run(self, msg: Msg) -> RunReply:
        req = bus.decode(msg.data, RunRequest)
        spec = tenants.stamp(msg, req.spec.to_spec())
        placement.check_substrate(self.registry, spec, one_shot=True)
        if isinstance(req.exec.cmd, str) and not req.exec.cmd.strip():
            raise InvalidRequest("exec.cmd is empty")
        if req.exec.stream or req.exec.session or req.exec.trajectory:
            raise InvalidRequest("a one-shot run answers with one message and keeps nothing: exec.stream, exec.session "
                                 "and exec.trajectory need a sandbox (create one, then exec)")
        if not spec.request_id:
            try:
                return await self._run(spec, req)
            except BeforeRun as e:
                raise e.err from None
        return await self.once.run(spec.request_id, req, req.exec.timeout_s + RUN_SLACK_S, lambda: self._run(spec, req))

    async def _run(self, spec: SandboxSpec, req: RunRequest) -> RunReply:
        """The node's reply to the run; BeforeRun for errors that leave nothing to keep (no room,
        a node's error reply), a plain `timeout` when a node took the call and never answered."""
        alive = self.registry.alive()
        data = encoder.encode(NodeRun(spec=spec, exec=req.exec))
        tried: list[str] = []
        last: CorralError | None = None
        wait_s = req.exec.timeout_s + RUN_SLACK_S
        for st, res in placement.attempts(alive, spec, self.policy):
            tried.append(st.hb.node)
            try:
                resp = await self.nc.request(subjects.node_run(st.hb.node), data, timeout=wait_s)
            except NoRespondersError:
                last = Unavailable(f"node {st.hb.node} is not answering")
                continue
            except NatsTimeout:
                raise CorralError(f"node {st.hb.node} did not answer the run within {wait_s:g}s", Code.TIMEOUT) from None
            finally:
                st.reservations.remove(res)
            if _outcome_decoder.decode(resp.data).ok:
                PLACEMENTS.labels(st.hb.node).inc()
                return envelope.decode_reply(resp.data, RunReply)  # one that does not match raises `internal`: the outcome
            e = _refusal(st.hb.node, resp.data)
            if e.code in (Code.CAPACITY, Code.UNAVAILABLE):
                last = e
                continue
            REJECTIONS.labels(e.code.value).inc()
            raise BeforeRun(e)
        raise BeforeRun(placement.no_room("a run", spec, alive, self.policy, tried, last, retry_after_s=0.5))
