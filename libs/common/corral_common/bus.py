"""NATS helpers shared by the services: connecting, idempotent JetStream set-up, and serving
request/reply subjects so that every request gets exactly one reply, whatever goes wrong."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from . import auth, config, logs, metrics
from .contract import envelope, subjects
from .contract.errors import Code, CorralError
from .discovery import Discovery

log = logging.getLogger("corral.bus")
# what a handler meets while a NATS server or a JetStream leader fails over: a publish nobody
# acknowledges yet, a request nobody answers yet, a connection being re-established
_BUS_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError, nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError)
T = TypeVar("T")


async def connect(url: str, name: str, creds: str | None = None, **kw: Any) -> NATS:
    """Connect with reconnects forever (services must outlive a NATS restart), as the identity
    `creds` names, else the environment's credentials (auth.py)."""
    kw = {**auth.connect_options(url, creds), **kw}
    return await nats.connect(
        auth.servers(url),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        pending_size=64 * 1024 * 1024,
        **kw,
    )


async def barrier(nc: NATS, wait_s: float = 10.0) -> bool:
    """Wait until the server has handled every command this connection sent before (a SUB is in
    place, an UNSUB done, and every message the server routed to us before it has been read);
    False when the server did not answer within `wait_s`.

    A message to ourselves: the server handles one connection's commands in order, and what it
    sends us comes back in order. Not `nc.flush()`: nats-py (2.16) writes the PING straight to
    the socket, ahead of the SUBs and UNSUBs still queued for its writer (seen: `subscribe` then
    `flush` puts `PING` on the wire before `SUB`), so its PONG proves nothing about them; and it
    cancels the PING's future on its timeout, after which the late PONG stops the read loop."""
    inbox = nc.new_inbox()
    heard = asyncio.Event()

    async def on_echo(_: Msg) -> None:
        heard.set()

    sub = await nc.subscribe(inbox, cb=on_echo, max_msgs=1)
    try:
        await nc.publish(inbox, b"")
        await asyncio.wait_for(heard.wait(), wait_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def ready(nc: NATS, logger: logging.Logger, line: str, wait_s: float = 30.0, **fields: Any) -> None:
    """Log a service's ready line once the server has its subscriptions: a subscribe only queues
    SUB for the connection's writer, and whoever acts on the line (a test, `corral up`, an
    operator's probe) must not find "no responders" for a subject the service says it serves."""
    if not await barrier(nc, wait_s):
        log.warning("the server did not echo within %ss; ready all the same", wait_s)
    logs.kv(logger, logging.INFO, line, **fields)


async def while_jetstream_recovers(op: Callable[[], Awaitable[T]], what: str, wait_s: float = 60.0) -> T:
    """`op`, retried while JetStream cannot do it yet: a cluster still electing its meta leader or
    a stream's leader, or with too few peers up for the replicas asked for, answers 503 or not at
    all. `op` must be safe to repeat (a publish carries a Nats-Msg-Id, so a stored message whose
    acknowledgement was lost is not stored twice)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await op()
        except _BUS_TRANSIENT as e:
            if time.monotonic() > deadline:
                raise
            log.info("JetStream cannot create %s yet (%s); retrying", what, e)
            await asyncio.sleep(0.5)


async def ensure_streams(js: JetStreamContext) -> None:
    for name, subs in subjects.STREAMS.items():
        cfg = StreamConfig(name=name, subjects=subs, storage=StorageType.FILE, max_age=7 * 86400, num_replicas=config.js_replicas())

        async def put(cfg: StreamConfig = cfg) -> None:
            try:
                await js.add_stream(cfg)
            except BadRequestError:
                await js.update_stream(cfg)

        await while_jetstream_recovers(put, f"stream {name}")


async def ensure_kv(js: JetStreamContext, bucket: str, ttl: float | None = None, history: int = 1) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except Exception:  # not there yet (or unreadable): creating it below raises the real error
        pass
    try:
        return await while_jetstream_recovers(
            lambda: js.create_key_value(KeyValueConfig(bucket=bucket, history=history, ttl=ttl, replicas=config.js_replicas())),
            f"KV bucket {bucket}")
    except BadRequestError:
        # another process created it in between
        return await js.key_value(bucket)


async def kv_get(kv: KeyValue, key: str, what: str, wait_s: float = 10.0) -> KeyValue.Entry | None:
    """The entry of `key`, or None when it is absent or deleted. A bucket that cannot be read (its
    stream is electing a leader after a server failed, or the server is gone) is retried for
    `wait_s`, then `unavailable`: never reported as an absent key, which would tell a caller that
    an image or a sandbox that exists does not."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        except Exception as e:
            if time.monotonic() > deadline:
                raise CorralError(f"{what} cannot be read now ({e or type(e).__name__}); retry", Code.UNAVAILABLE,
                                  retry_after_s=1.0) from None
            await asyncio.sleep(0.2)


async def kv_delete_while(kv: KeyValue, key: str, holds: Callable[[bytes], bool], revision: int | None = None) -> bool:
    """Delete `key` only while its value `holds`: a delete on the revision read (or on `revision`,
    the one the caller last wrote, tried first), read again when something was written in
    between. False when the value no longer holds or kept changing; True once deleted or absent.
    Errors reading or writing the bucket propagate."""
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    for _ in range(3):
        if revision is None:
            try:
                e = await kv.get(key)
            except KeyNotFoundError:
                return True
            if e is None or not e.value:
                return True
            if not holds(e.value):
                return False
            revision = e.revision
        try:
            await kv.delete(key, last=revision)
            return True
        except KeyWrongLastSequenceError:
            revision = None
    return False


class KVWatch:
    """Every change of a KV bucket, as `async for entry in KVWatch(kv)` (None entries, the end of
    the initial values, are left out), across the loss of the server that delivers them.

    nats-py's watch is an ordered push consumer on one server; when that server dies the consumer
    dies with it, and the client notices only after missed heartbeats and recreates it once (if
    the stream is mid-election then, never): a scheduler's placement table then silently stops
    following the bucket (seen: destroyed sandboxes listed for good after a nats-server was
    killed). Here, whenever the watch is idle, the bucket's last sequence is compared with the
    last revision delivered; a watch still behind at the next check is replaced by a new one,
    which replays the latest value (or delete marker) of every key: consumers must take an entry
    seen twice as a no-op."""

    def __init__(self, kv: KeyValue, check_every_s: float = 2.0):
        self.kv = kv
        self.check_every_s = check_every_s
        self.restarts = 0
        self._watcher: Any = None
        self._seen = 0
        self._stopped = False

    async def start(self) -> None:
        self._watcher = await self.kv.watchall()

    async def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:  # shutting down: a watcher that fails to stop is dropped with the connection
                pass

    async def __aiter__(self) -> AsyncIterator[KeyValue.Entry]:
        if self._watcher is None:
            await self.start()
        behind_since: int | None = None
        while not self._stopped:
            try:
                e = await self._watcher.updates(timeout=self.check_every_s)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                behind = await self._behind()
                if behind is None or not behind:
                    behind_since = None
                elif behind_since == self._seen:  # behind, and nothing arrived since the last check
                    await self._restart()
                    behind_since = None
                else:
                    behind_since = self._seen
                continue
            if e is None:
                continue
            if not isinstance(e, KeyValue.Entry):  # the watcher's stop sentinel: stopped under us
                if self._stopped:
                    return
                continue
            self._seen = max(self._seen, e.revision or 0)
            yield e

    async def caught_up(self, timeout: float = 2.0) -> bool:
        """Wait until every change the bucket held when this was called has been delivered (and,
        delivery being synchronous with the consumer's loop body, applied): a reader of a view
        built from the watch then sees what a writer was told is written. False if the stream
        cannot be read or the watch does not get there within `timeout`."""
        try:
            info = await self.kv._js.stream_info(self.kv._stream)
        except Exception:  # failing over: the view is as current as it can be told to be
            return False
        target, deadline = info.state.last_seq or 0, time.monotonic() + timeout
        while self._seen < target:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    async def _behind(self) -> bool | None:
        try:
            info = await self.kv._js.stream_info(self.kv._stream)
        except Exception:  # the stream is failing over: look again at the next idle moment
            return None
        return bool(info.state.last_seq and info.state.last_seq > self._seen)

    async def _restart(self) -> None:
        log.warning("KV watch fell behind its bucket; watching again", extra={"fields": {"stream": self.kv._stream, "seen": self._seen}})
        old = self._watcher
        try:
            self._watcher = await self.kv.watchall()
        except Exception as e:  # still failing over: keep the old one, try again later
            log.warning("KV watch not renewed yet", extra={"fields": {"error": repr(e)}})
            return
        self.restarts += 1
        try:
            await old.stop()
        except Exception:  # its server is gone with it
            pass


async def kv_keys(kv: KeyValue, attempts: int = 3) -> list[str]:
    """Every live key of a bucket, from the server's own list of the bucket stream's subjects.

    nats-py's `kv.keys()` walks an ordered consumer and can miss keys while the bucket changes
    (seen here: the image-cache's GC missed `busybox` and freed its layer). Subjects of deleted or
    purged keys keep a marker message, so each candidate is read once; those gone are left out.
    A listing that fails is retried, then reported as `unavailable`, never as an empty bucket."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError

    err: Exception | None = None
    for attempt in range(attempts):
        try:
            info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
            subjects = info.state.subjects or {}
            break
        except Exception as e:
            err = e
            await asyncio.sleep(0.2 * (attempt + 1))
    else:
        raise CorralError(f"cannot list KV bucket keys: {err}", Code.UNAVAILABLE)
    keys: list[str] = []
    for subj in subjects:
        k = subj[len(kv._pre):]
        try:
            entry = await kv.get(k)
        except (KeyDeletedError, KeyNotFoundError):
            continue
        if entry is not None and entry.value is not None and entry.operation in (None, "PUT"):
            keys.append(k)
    return keys


def decode(data: bytes, typ: type[T]) -> T:
    """Decode a request; malformed JSON or wrong types become `invalid_request` with msgspec's
    message, which names the offending field (`Expected `float` >= 0 - at `$.cpu``)."""
    if not data:
        data = b"{}"
    try:
        return msgspec.json.decode(data, type=typ)
    except msgspec.ValidationError as e:
        raise CorralError(f"invalid request: {e}", Code.INVALID_REQUEST) from None
    except msgspec.DecodeError as e:
        raise CorralError(f"malformed JSON: {e}", Code.INVALID_REQUEST) from None
    except RecursionError:  # skipping an unknown field nested thousands deep
        raise CorralError("malformed request: JSON nested too deeply", Code.INVALID_REQUEST) from None


# a handler answers with a typed reply (encoded here), raw bytes (an already-encoded reply, e.g. a
# batch reply cut to the payload limit), or None when it answered the caller itself
Handler = Callable[[Msg], Awaitable[envelope.Reply | bytes | None]]


LATE_S = 2.0  # how long an unserved subscription still answers what the server routed to it late
LATE_DRAIN_S = 0.1  # the same when the whole service stops


class Responder:
    """Serves request/reply subjects for one service.

    Each request runs in its own task (a slow exec must not hold up the next request), errors are
    turned into contract error replies, and every outcome is counted in Prometheus and in the NATS
    service-discovery stats (`$SRV.*`, see discovery.py), which the Responder answers from its
    first `serve` until `drain`.
    """

    def __init__(self, nc: NATS, service: str, *, package: str = "corral_common", metadata: dict[str, str] | None = None):
        """`package` is the service's top-level package (its distribution's version is the one
        discovery reports); `metadata` goes into every discovery reply (a node-agent's node)."""
        self.nc = nc
        self.service = service
        self.tasks: set[asyncio.Task[None]] = set()
        self.subs: dict[str, Any] = {}
        self.ops: dict[str, str] = {}  # subscription key -> op, for discovery
        self.lingering: set[asyncio.Task[None]] = set()  # unserved, still answering late deliveries
        self.discovery = Discovery(nc, service, package=package, metadata=metadata)

    def declare(self, op: str, subject: str, queue: str = "") -> None:
        """List `op` in discovery under `subject` even while nothing serves it: for an op served
        by one subscription per instance (a sandbox), under the wildcard that covers them all."""
        self.discovery.declare(op, subject, queue)

    async def serve(self, subject: str, handler: Handler, op: str, queue: str = "", key: str | None = None) -> None:
        async def on_msg(msg: Msg) -> None:
            t = asyncio.create_task(self._handle(msg, handler, op))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

        await self.discovery.start()
        self.discovery.add(op, subject, queue)
        self.ops[key or subject] = op
        try:
            self.subs[key or subject] = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        except BaseException:
            self.discovery.remove(self.ops.pop(key or subject))
            raise

    async def unserve(self, key: str) -> None:
        """Stop serving `key`, answering every request the server routed to it: none times out.

        Drained, not dropped (nats-py's `unsubscribe` discards what is in flight or queued for
        the callback): UNSUB, a `barrier`, the queue handled. And then still served for
        `LATE_S`, a margin: nats-py drops a message for a subscription it has forgotten, leaving
        its caller to time out. The late deliveries once seen here (~1 in 35 unserves under a
        flood, requests arriving after the round trip) were that round trip's: `nc.flush()`
        puts its PING on the wire ahead of the queued UNSUB."""
        op = self.ops.pop(key, None)
        if op is not None:
            self.discovery.remove(op)
        sub = self.subs.pop(key, None)
        if sub is None:
            return
        if not self.nc.is_connected:
            try:
                await sub.unsubscribe()
            except Exception:  # stopping: a subscription whose connection already closed is gone anyway
                pass
            return
        try:
            await self.nc._send_unsubscribe(sub._id)
            if not await barrier(self.nc):
                raise TimeoutError("no echo")
            await sub._pending_queue.join()
        except Exception:  # the connection failed meanwhile: what was routed here is lost with it
            self._forget(sub)
            return
        t = asyncio.create_task(self._linger(sub))
        self.lingering.add(t)
        t.add_done_callback(self.lingering.discard)

    async def _linger(self, sub: Any) -> None:
        try:
            await asyncio.sleep(LATE_S)
        finally:
            self._forget(sub)

    def _forget(self, sub: Any) -> None:
        """Stop handling `sub`'s messages and drop it from the connection, so a reconnect does
        not subscribe it again."""
        sub._stop_processing()
        self.nc._remove_sub(sub._id)
        sub._closed = True

    async def _handle(self, msg: Msg, handler: Handler, op: str) -> None:
        t0 = time.perf_counter_ns()
        code = "ok"
        detail = ""  # the error message, for discovery's last_error
        try:
            answer = await handler(msg)
            reply = envelope.encode(answer) if isinstance(answer, envelope.Reply) else answer
        except CorralError as e:
            code, detail = e.code.value, e.message
            reply = envelope.error(e.code.value, e.message, e.retry_after_s)
        except asyncio.CancelledError:
            code, detail = Code.UNAVAILABLE.value, f"{self.service} is shutting down; retry"
            reply = envelope.error(code, detail)
        except _BUS_TRANSIENT as e:  # not a bug: the bus (a stream's leader, a server) is failing over
            code = Code.UNAVAILABLE.value
            detail = (f"{self.service} could not reach the bus ({type(e).__name__}: {e}); a NATS server or stream "
                      "leader is failing over: retry (a create with the same request_id is never done twice)")
            log.warning("bus unavailable while handling", extra={"fields": {"op": op, "error": type(e).__name__}})
            reply = envelope.error(code, detail, 1.0)
        except Exception as e:  # a bug: answer, log, keep serving
            code, detail = Code.INTERNAL.value, f"internal error in {self.service} ({type(e).__name__}: {e})"
            log.exception("handler failed", extra={"fields": {"op": op, "subject": msg.subject}})
            reply = envelope.error(code, detail)
        ns = time.perf_counter_ns() - t0
        metrics.request_done(self.service, op, code, ns / 1e9)
        self.discovery.record(op, code, detail, ns)
        if reply is not None and msg.reply:
            try:
                await self.nc.publish(msg.reply, reply)
            except Exception:
                log.warning("could not publish reply", extra={"fields": {"op": op}})

    async def drain(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(self.unserve(key) for key in list(self.subs)))
        if self.lingering:  # a late delivery is ~1 ms behind its PONG; stopping need not wait LATE_S
            await asyncio.sleep(LATE_DRAIN_S)
            for t in list(self.lingering):
                t.cancel()
            await asyncio.gather(*self.lingering, return_exceptions=True)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        await self.discovery.stop()


def no_responders(msg: Msg) -> bool:
    return msg.headers is not None and msg.headers.get("Status") == "503"


GIVE_UP_CHECK_S = 0.5


class Scatter:
    """Many requests at once, replies handled as they arrive.

    `nc.request` costs a future, a timer and a task per request; sending a thousand at a time
    (a batch spread over a thousand nodes, or a thousand KV writes) spends more time in that than
    in the work. Here one wildcard inbox subscription serves every call: each request is a plain
    publish with a reply subject `<inbox>.<call>.<index>`, and the caller iterates over
    `(index, reply)` pairs, `reply` None for requests unanswered when the timeout ends. A reply
    may be a no-responders status (see `no_responders`)."""

    def __init__(self, nc: NATS):
        self.nc = nc
        self.prefix = ""
        self.sub: Subscription | None = None
        self.calls: dict[str, _Call] = {}
        self._n = 0

    async def start(self) -> Scatter:
        self.prefix = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(f"{self.prefix}.>", cb=self._on_reply)
        return self

    async def _on_reply(self, msg: Msg) -> None:
        _, _, tail = msg.subject.rpartition(self.prefix + ".")
        call, _, idx = tail.partition(".")
        st = self.calls.get(call)
        if st is not None and idx.isdigit():
            st.got.append((int(idx), msg))
            st.wake()

    async def requests(self, reqs: list[tuple[str, bytes, dict[str, str] | None]], timeout: float,
                       give_up: Callable[[int], bool] | None = None) -> AsyncIterator[tuple[int, Msg | None]]:
        """Send every (subject, data, headers) request, then yield (index, Msg | None).
        `give_up(index)`, asked every GIVE_UP_CHECK_S while a request is unanswered: true ends the
        wait for that one (yielded as unanswered) before the timeout, e.g. once its node is lost."""
        if self.sub is None:
            await self.start()
        self._n += 1
        call = str(self._n)
        st = _Call()
        self.calls[call] = st
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout, st.expire)  # one timer per call, not per request
        try:
            for k, (subject, data, headers) in enumerate(reqs):
                await self.nc.publish(subject, data, reply=f"{self.prefix}.{call}.{k}", headers=headers)
            left = [True] * len(reqs)
            n_left = len(reqs)
            while n_left and not st.expired:
                if not st.got:
                    st.waiter = loop.create_future()
                    if give_up is None:
                        await st.waiter
                        continue
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(st.waiter), GIVE_UP_CHECK_S)
                    for k in [k for k, pending in enumerate(left) if pending and give_up(k)]:
                        left[k] = False
                        n_left -= 1
                        yield k, None
                    continue
                got, st.got = st.got, []
                for k, msg in got:
                    if 0 <= k < len(left) and left[k]:
                        left[k] = False
                        n_left -= 1
                        yield k, msg
            for k, pending in enumerate(left):
                if pending:
                    yield k, None
        finally:
            timer.cancel()
            self.calls.pop(call, None)


class _Call:
    def __init__(self) -> None:
        self.got: list[tuple[int, Msg]] = []
        self.waiter: asyncio.Future[None] | None = None
        self.expired = False

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def expire(self) -> None:
        self.expired = True
        self.wake()
