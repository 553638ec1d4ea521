"""One exec in a sandbox, for real: output streamed to the caller if asked, audited, limits
checked later. It knows nothing of trajectories: replay (traj.py) wraps it."""
from __future__ import annotations

import asyncio
import codecs
import shlex
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from corral_common import metrics
from corral_common.contract.audit import AuditEvent, event_id
from corral_common.contract.messages import ExecChunk, ExecRequest, ExecResult, encoder

from ..audit.wiring import AuditWiring
from ..substrates import Substrate
from ..substrates.base import Sandbox

EXEC_SECONDS = metrics.histogram(
    "corral_exec_seconds", "Exec duration as seen by the node", ("node", "substrate"),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 300),
)

#: an exec: (the request's message, for its reply subject; the request; sandbox; substrate)
ExecFn = Callable[[Msg, ExecRequest, Sandbox, Substrate], Awaitable[ExecResult]]


def command_line(req: ExecRequest) -> str:
    return req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)


def fit_to_bus(result: ExecResult, limit: int) -> ExecResult:
    """`result` with its output cut from the end (and `truncated` set) until its JSON is at most
    `limit` bytes. max_output_bytes counts raw bytes, but JSON can spell one as six (`\u0000`):
    a reply over the bus's max_payload would never be sent and the caller would wait for nothing.
    The smaller stream is kept whole when it takes at most half the room (a short error message
    next to a flood of output survives)."""
    if len(encoder.encode(result)) <= limit:
        return result
    room = limit - len(encoder.encode(msgspec.structs.replace(result, stdout="", stderr=""))) - 16
    streams = {"stdout": result.stdout, "stderr": result.stderr}
    size = {k: len(encoder.encode(v)) for k, v in streams.items()}
    small, big = sorted(streams, key=lambda k: size[k])
    budget = {small: min(size[small], max(room, 0) // 2)}
    budget[big] = max(room, 0) - budget[small]
    cut = {k: _cut(v, budget[k]) for k, v in streams.items()}
    return msgspec.structs.replace(result, stdout=cut["stdout"], stderr=cut["stderr"], truncated=True)


def _cut(text: str, budget: int) -> str:
    """The longest head of `text` whose JSON string takes at most `budget` bytes."""
    if len(encoder.encode(text)) <= budget:
        return text
    lo, hi = 0, len(text)  # encoded size grows with the head's length: bisect it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encoder.encode(text[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def bus_limit(nc: NATS) -> int:
    """What an exec result may take of a message: half the server's max_payload, so the
    trajectory log's entry (the request and the result) and the reply envelope fit too."""
    return max(64 * 1024, (nc.max_payload or 1 << 20) // 2)


class Exec:
    def __init__(self, nc: NATS, node: str, audit: AuditWiring):
        self.nc = nc
        self.node = node
        self.audit = audit

    async def __call__(self, msg: Msg, req: ExecRequest, sb: Sandbox, sub: Substrate) -> ExecResult:
        on_chunk = None
        pump = None
        queue: asyncio.Queue | None = None
        if req.stream and msg.reply:
            queue = asyncio.Queue()
            decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                        "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
            seq = iter(range(1 << 62))

            def on_chunk(stream: str, data: bytes) -> None:
                text = decoders[stream].decode(data)
                if text:
                    queue.put_nowait(ExecChunk(stream=stream, data=text, seq=next(seq)))  # type: ignore[arg-type]

            async def pump_chunks() -> None:
                while (item := await queue.get()) is not None:
                    await self.nc.publish(msg.reply, encoder.encode(item))

            pump = asyncio.create_task(pump_chunks())
        t0 = time.perf_counter()
        cmd = command_line(req)
        try:
            with self.audit.executing(sb.id, cmd):
                result = await sub.exec(sb, req, on_chunk)
        finally:
            if pump is not None and queue is not None:
                queue.put_nowait(None)
                await pump
        EXEC_SECONDS.labels(self.node, sub.name).observe(time.perf_counter() - t0)
        self.audit.emit(AuditEvent(
            id=event_id(), ts=time.time(), node=self.node, sandbox=sb.id, kind="exec", job=sb.info.job, labels=sb.info.labels,
            cmd=cmd, cwd=req.cwd or sb.spec.workdir, session=req.session,
            exit_code=result.exit_code, duration_ms=round(result.duration_ms, 3), stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr), timed_out=result.timed_out,
            detail={"oom_killed": "1"} if result.oom_killed else {},
        ))
        self.audit.exec_done(sb, sub, cmd)
        return fit_to_bus(result, bus_limit(self.nc))
