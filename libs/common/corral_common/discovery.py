"""NATS service discovery (`$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`) for a `bus.Responder`, so that
standard NATS tooling (`nats micro list/info/stats`, any client of the micro protocol) finds every
corral service, its endpoints and its error counts.

Why not nats-py's `nats.micro` endpoints, which answer the same protocol: `bench/responder.py`
(bench/results/responder.json, this machine, 2 cores under a load average of ~23) serves one
handler both ways. Per request the micro endpoint path is not faster once it does what corral's
ops need: with a task per request and the Prometheus counts (`micro_task`) it costs what the
Responder costs (server CPU per request in bursts 35.0 against 37.2 us, p50 round trip 0.605
against 0.635 ms, throughput 3.7k against 4.0k requests/s: all within 10%, the run-to-run noise
here). A bare micro endpoint is cheaper (16.5 us) only because it does less, and what it leaves out
corral cannot do without:
- it awaits each handler inside the subscription's callback, so an endpoint handles one request
  at a time: 50 concurrent requests to a 20 ms handler take 1.06 s against 0.03 s (a 30 s exec
  would hold up every other op on its subject);
- it counts an error only when a handler raises, replies to it with a `Nats-Service-Error` header
  and an empty body, and keeps `repr(exception)` as the last error; corral's errors are JSON
  replies with a code (`{"ok": false, "error": {"code": ...}}`) that clients decode;
- an endpoint without a queue group gets the queue group `q`; some corral subjects are served by
  every instance on purpose (a node's own subjects need none, and must not share one by accident);
- it lists one endpoint per subscription: a node-agent serves one subscription per sandbox.
The discovery counters cost nothing measurable (the Responder's request path in-process: 4.33 us
with them, 4.37 us without).
So the Responder keeps serving its subjects and this module answers the discovery subjects for it,
with the response shapes of the NATS micro spec (`io.nats.micro.v1.*_response`) and nats-py's own
subject layout, name and version rules (imported from `nats.micro`, not copied).

Endpoints are listed per op: every subscription served under one op counts towards one endpoint,
and an op can be declared with a wildcard subject (`corral.v1.sandbox.*.>`) so a node with
thousands of sandboxes still lists one sandbox-ops endpoint."""
from __future__ import annotations

import asyncio
import datetime
import functools
import importlib.metadata
import logging
import os
import re
import socket
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.service import (
    INFO_RESPONSE_TYPE,
    NAME_REGEX,
    PING_RESPONSE_TYPE,
    SEMVER_REGEX,
    STATS_RESPONSE_TYPE,
    ServiceVerb,
    control_subject,
)
from nats.nuid import NUID

log = logging.getLogger("corral.discovery")
_encoder = msgspec.json.Encoder()
NAME_PREFIX = "corral-"
FALLBACK_VERSION = "0.0.0-unknown"


class EndpointInfo(msgspec.Struct, kw_only=True):
    name: str
    subject: str
    queue_group: str  # "" when every instance gets each request (no queue group)
    metadata: dict[str, str] | None = None


class EndpointData(msgspec.Struct, kw_only=True):
    """The micro spec leaves `data` to the service: here, the error replies per contract code."""

    errors: dict[str, int] = msgspec.field(default_factory=dict)


class EndpointStats(msgspec.Struct, kw_only=True):
    name: str
    subject: str
    queue_group: str
    num_requests: int
    num_errors: int
    last_error: str  # "<code>: <message>" of the last error reply, "" before the first
    processing_time: int  # nanoseconds, all requests together
    average_processing_time: int  # nanoseconds
    data: EndpointData


class PingResponse(msgspec.Struct, kw_only=True):
    type: str = PING_RESPONSE_TYPE
    name: str
    id: str
    version: str
    metadata: dict[str, str]


class InfoResponse(msgspec.Struct, kw_only=True):
    type: str = INFO_RESPONSE_TYPE
    name: str
    id: str
    version: str
    description: str
    metadata: dict[str, str]
    endpoints: list[EndpointInfo]


class StatsResponse(msgspec.Struct, kw_only=True):
    type: str = STATS_RESPONSE_TYPE
    name: str
    id: str
    version: str
    metadata: dict[str, str]
    started: str  # RFC 3339, UTC
    endpoints: list[EndpointStats]


def endpoint_name(op: str) -> str:
    """Ops are dotted (`quota.set`, `traj.open`); micro names allow only [A-Za-z0-9_-]."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", op)


@functools.cache
def package_version(package: str) -> str:
    """The version of the distribution that installs `package`. Looked up on the first discovery
    request, not at start: mapping packages to distributions reads every installed distribution's
    metadata (~0.2 s here), which a service start (and every test stack) need not pay."""
    for dist in importlib.metadata.packages_distributions().get(package, []):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if SEMVER_REGEX.match(version):
            return version
    return FALLBACK_VERSION


class _Endpoint:
    """Counters of one listed endpoint (one op)."""

    __slots__ = ("op", "name", "subject", "queue", "subscriptions", "pinned", "requests", "errors", "last_error", "ns", "by_code")

    def __init__(self, op: str, subject: str, queue: str, pinned: bool):
        self.op = op
        self.name = endpoint_name(op)
        self.subject = subject
        self.queue = queue
        self.subscriptions = 0
        self.pinned = pinned  # declared: listed even while nothing is subscribed (no sandbox yet)
        self.requests = 0
        self.errors = 0
        self.last_error = ""
        self.ns = 0
        self.by_code: dict[str, int] = {}

    def info(self) -> EndpointInfo:
        return EndpointInfo(name=self.name, subject=self.subject, queue_group=self.queue, metadata={"op": self.op})

    def stats(self) -> EndpointStats:
        return EndpointStats(name=self.name, subject=self.subject, queue_group=self.queue, num_requests=self.requests,
                             num_errors=self.errors, last_error=self.last_error, processing_time=self.ns,
                             average_processing_time=self.ns // self.requests if self.requests else 0,
                             data=EndpointData(errors=dict(self.by_code)))


class Discovery:
    """The `$SRV` side of one Responder: its identity, its endpoints and their counters."""

    def __init__(self, nc: NATS, service: str, *, package: str = "corral_common", description: str = "",
                 metadata: dict[str, str] | None = None):
        self.nc = nc
        self.name = NAME_PREFIX + service
        if not NAME_REGEX.match(self.name):
            raise ValueError(f"service name {self.name!r} is not a valid NATS micro name ([A-Za-z0-9_-]+)")
        self.id = NUID().next().decode()  # one per process: a Responder per service process
        self.package = package
        self.version: str | None = None  # see package_version
        self.description = description or f"corral {service}"
        self.metadata = {"host": socket.gethostname(), "pid": str(os.getpid()), **(metadata or {})}
        self.started = datetime.datetime.now(datetime.UTC)
        self.endpoints: dict[str, _Endpoint] = {}
        self.subs: list[Any] = []
        self._starting: asyncio.Lock | None = None

    # ------------------------------------------------------------------ endpoints

    def declare(self, op: str, subject: str, queue: str = "") -> None:
        """List `op` under `subject` (a wildcard for per-instance subscriptions) from now on."""
        ep = self.endpoints.get(op)
        if ep is None:
            self.endpoints[op] = _Endpoint(op, subject, queue, pinned=True)
        else:
            ep.subject, ep.queue, ep.pinned = subject, queue, True

    def add(self, op: str, subject: str, queue: str) -> None:
        ep = self.endpoints.get(op)
        if ep is None:
            ep = self.endpoints[op] = _Endpoint(op, subject, queue, pinned=False)
        ep.subscriptions += 1

    def remove(self, op: str) -> None:
        ep = self.endpoints.get(op)
        if ep is None:
            return
        ep.subscriptions = max(0, ep.subscriptions - 1)
        if not ep.subscriptions and not ep.pinned:
            del self.endpoints[op]

    def record(self, op: str, code: str, message: str, ns: int) -> None:
        ep = self.endpoints.get(op)
        if ep is None:  # a request that arrived just before its subscription went away
            return
        ep.requests += 1
        ep.ns += ns
        if code != "ok":
            ep.errors += 1
            ep.last_error = f"{code}: {message}"
            ep.by_code[code] = ep.by_code.get(code, 0) + 1

    # ------------------------------------------------------------------ $SRV

    async def start(self) -> None:
        """Subscribe the nine control subjects (each verb for all services, for this name, for
        this id). Idempotent: the Responder calls it on every `serve`."""
        if self.subs:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.subs:
                return
            handlers = {ServiceVerb.PING: self._on_ping, ServiceVerb.INFO: self._on_info, ServiceVerb.STATS: self._on_stats}
            subs = []
            for verb, cb in handlers.items():
                for name, sid in ((None, None), (self.name, None), (self.name, self.id)):
                    subs.append(await self.nc.subscribe(control_subject(verb, name=name, id=sid), cb=cb))
            self.subs = subs

    async def stop(self) -> None:
        """Drain the control subscriptions: discovery requests already received are answered."""
        subs, self.subs = self.subs, []
        for sub in subs:
            try:
                await sub.drain()
            except Exception:  # stopping: a subscription whose connection already closed is gone anyway
                pass

    async def _version(self) -> str:
        if self.version is None:
            self.version = await asyncio.to_thread(package_version, self.package)
        return self.version

    def _started(self) -> str:
        return self.started.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    async def ping(self) -> PingResponse:
        return PingResponse(name=self.name, id=self.id, version=await self._version(), metadata=self.metadata)

    async def info(self) -> InfoResponse:
        return InfoResponse(name=self.name, id=self.id, version=await self._version(), description=self.description,
                            metadata=self.metadata, endpoints=[ep.info() for ep in self.endpoints.values()])

    async def stats(self) -> StatsResponse:
        return StatsResponse(name=self.name, id=self.id, version=await self._version(), metadata=self.metadata,
                             started=self._started(), endpoints=[ep.stats() for ep in self.endpoints.values()])

    async def _on_ping(self, msg: Msg) -> None:
        await self._respond(msg, await self.ping())

    async def _on_info(self, msg: Msg) -> None:
        await self._respond(msg, await self.info())

    async def _on_stats(self, msg: Msg) -> None:
        await self._respond(msg, await self.stats())

    async def _respond(self, msg: Msg, body: msgspec.Struct) -> None:
        if not msg.reply:
            return
        try:
            await self.nc.publish(msg.reply, _encoder.encode(body))
        except Exception:
            log.warning("could not publish a discovery reply", exc_info=True)
