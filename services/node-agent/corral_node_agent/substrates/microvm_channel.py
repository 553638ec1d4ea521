"""The node's end of a microvm guest's agent (guest/agent.sh): one line per request and per answer
over the virtio-serial port QEMU exposes as a unix socket, binary fields base64 behind a "-".

Requests carry ids; answers come back in any order and are matched by id, so execs, file reads
and writes run concurrently in the guest. The guest's agent outlives a host that goes away (a
node-agent restart): a new channel may first get answers to its predecessor's requests, whose
ids it never used, and the guard's reports of the meantime, which it keeps until `on_guard` is
set."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable

import msgspec

from corral_common.contract.errors import Internal, Unavailable

from .base import GuardedOpen

log = logging.getLogger("corral.node.microvm")

HOST_GRACE_S = 5.0
GUARD_KINDS = ("p", "c", "open", "write", "exec", "dropped", "overflow")  # what the guard's E lines report
STREAMS = {"o": "stdout", "e": "stderr"}
LINE_LIMIT = 64 << 20  # an answer's line: base64 of up to two outputs of max_output_bytes
HELD_REPORTS = 10_000  # the guard's reports kept while nobody takes them (an adopted guest's, before its wiring)


class ExecDone(msgspec.Struct, frozen=True):
    exit_code: int
    timed_out: bool
    out_size: int
    err_size: int
    stdout: bytes
    stderr: bytes
    oom_killed: bool = False  # the guest's OOM killer ended a process of it


class SessionCall(msgspec.Struct, frozen=True):
    name: str
    start: str  # the guest-side script that becomes the session's shell, when it has none
    pre: str  # shell run before the command, in the session (cd, exports); "true" for nothing
    uid: int = 0  # whose the call's files in the root are: the session's user (HARNESS_UID for a harness session)


class FileAnswer(msgspec.Struct, frozen=True):
    rc: int  # 0 done, 1 no such file (or parent), 2 a directory, 3 failed (see data: its error), 4 not a regular file
    mode: int
    data: bytes


def b64(data: bytes) -> str:
    return "-" + base64.b64encode(data).decode()


def raw(data: bytes) -> str:
    """The field of bytes sent raw after the request's line (GuestChannel.send)."""
    return f"={len(data)}"


def _strict_b64(field: str) -> str:
    """A report's text field: "-" and base64, or ValueError."""
    if not field.startswith("-"):
        raise ValueError(field)
    return base64.b64decode(field[1:], validate=True).decode(errors="replace")


def unb64(field: str) -> bytes:
    return base64.b64decode(field[1:]) if len(field) > 1 else b""


class GuestChannel:
    def __init__(self, sock: str):
        self.sock = sock
        # ids start anywhere: a guest resumed from a memory snapshot may still answer its
        # source's requests that were in flight, and must not be taken for ours
        self.ids = itertools.count(secrets.randbelow(1 << 48) + 1)
        self.waiting: dict[str, asyncio.Future[list[str]]] = {}
        self.streams: dict[str, Callable[[str, bytes], None]] = {}  # exec id -> its output chunks, as they come
        self.blobs: dict[str, Callable[[str, bytes], None]] = {}  # request id -> the chunks of its answer (C lines)
        self._on_guard: Callable[[GuardedOpen], None] | None = None  # the guard's reports (E lines)
        self.held: list[GuardedOpen] = []  # reports that came before anyone took them
        self.writer: asyncio.StreamWriter | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.closed = False

    @property
    def on_guard(self) -> Callable[[GuardedOpen], None] | None:
        return self._on_guard

    @on_guard.setter
    def on_guard(self, callback: Callable[[GuardedOpen], None] | None) -> None:
        """Who takes the guard's reports from now on; it gets those held so far first."""
        self._on_guard = callback
        held, self.held = self.held, []
        for report in held if callback is not None else ():
            self._hand_on(report)

    async def connect(self, timeout: float, ping: bool = True) -> None:
        """Connect (the socket appears once QEMU runs) and wait for the agent's first answer: it
        is asked until it answers, since a greeting sent before we connected is lost. A newline
        first ends whatever line a predecessor's channel was cut off in (the agent drops it).
        Without `ping` (a stopped guest cannot answer), connected is enough."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, self.writer = await asyncio.open_unix_connection(self.sock, limit=LINE_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise Unavailable(f"the microvm's agent socket {self.sock} did not appear in {timeout:g}s") from None
                await asyncio.sleep(0.01)
        self.reader_task = asyncio.create_task(self._read(reader))
        self.writer.write(b"\n")
        if not ping:
            return
        while True:
            try:
                await asyncio.wait_for(self.call("P"), 0.5)
                return
            except TimeoutError:
                if loop.time() > deadline or self.closed:
                    raise Unavailable(f"the microvm's guest agent did not answer within {timeout:g}s") from None

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                parts = line.decode(errors="replace").split()
                if len(parts) < 2:
                    continue
                if parts[0] in ("O", "C"):  # output of a streaming exec, or a chunk of an answer, before the answer
                    on_chunk = (self.streams if parts[0] == "O" else self.blobs).get(parts[1])
                    if on_chunk is not None and len(parts) == 4:
                        on_chunk(STREAMS.get(parts[2], parts[2]), unb64(parts[3]))
                    continue
                if parts[0] == "E":
                    self._guarded(parts)
                    continue
                fut = self.waiting.pop(parts[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(parts)
        except (OSError, ValueError) as e:  # ValueError: a line past LINE_LIMIT
            log.warning("microvm channel broke", extra={"fields": {"sock": self.sock, "error": str(e)}})
        finally:
            self.closed = True
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(Internal("the microvm's guest agent went away"))
            self.waiting.clear()

    def _guarded(self, parts: list[str]) -> None:
        if len(parts) != 8 or parts[2] not in GUARD_KINDS:
            return
        try:
            report = GuardedOpen(kind=parts[2], pid=int(parts[3]), denied=parts[4] == "1", who=parts[5],
                                 comm=_strict_b64(parts[6]), path=_strict_b64(parts[7]))
        except ValueError:  # (binascii.Error is one)
            log.warning("a malformed guard report from the guest", extra={"fields": {"sock": self.sock}})
            return
        if self._on_guard is None:
            if len(self.held) < HELD_REPORTS:
                self.held.append(report)
            return
        self._hand_on(report)

    def _hand_on(self, report: GuardedOpen) -> None:
        assert self._on_guard is not None
        try:
            self._on_guard(report)
        except Exception:
            log.exception("a guard report's callback failed")

    async def send(self, op: str, rid: str, *fields: str, payload: bytes = b"") -> None:
        """One request line, then `payload`: the bytes of its raw field (RAW), which the agent
        reads off the port by count right after the line (the shell's `read` takes a line one
        byte at a time: megabytes of base64 in one took seconds under TCG)."""
        if self.closed or self.writer is None:
            raise Internal("the microvm's guest agent went away")
        async with self.lock:
            self.writer.write(" ".join((op, rid, *fields)).encode() + b"\n" + payload)
            await self.writer.drain()

    async def call(self, op: str, *fields: str, rid: str = "", payload: bytes = b"") -> list[str]:
        """Send one request; the answer's fields after its op and id."""
        rid = rid or str(next(self.ids))
        fut: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        try:
            await self.send(op, rid, *fields, payload=payload)
            return (await fut)[2:]
        finally:
            self.waiting.pop(rid, None)

    async def exec(self, script: str, stdin: bytes, timeout_s: float, max_bytes: int,
                   on_chunk: Callable[[str, bytes], None] | None = None, session: SessionCall | None = None) -> ExecDone:
        """The guest kills the exec's process group at `timeout_s`; the node does not count on it
        (code inside may kill the guest's timer, or stall its clock): past HOST_GRACE_S more it
        has the group killed and reports a timeout with what it has (nothing). With `on_chunk`,
        output is handed to it as the guest sends it (every ~0.1 s), and the rest at the end:
        each stream once, up to `max_bytes`. With `session`, `script` is sourced in that
        session's shell (started by `session.start` when it has none)."""
        rid = str(next(self.ids))
        limits = (f"{max(timeout_s, 0.001):.3f}", str(max_bytes))
        if session is None:
            op, fields = "X", (*limits, b64(script.encode()), raw(stdin), "1" if on_chunk else "0")
        else:
            op, fields = "S", (session.name, *limits, "1" if on_chunk else "0", b64(session.start.encode()), b64(session.pre.encode()),
                               b64(script.encode()), raw(stdin), str(session.uid))
        sent = {"stdout": 0, "stderr": 0}
        if on_chunk is not None:
            def chunk(name: str, data: bytes) -> None:
                sent[name] += len(data)
                on_chunk(name, data)

            self.streams[rid] = chunk
        try:
            a = await asyncio.wait_for(self.call(op, *fields, rid=rid, payload=stdin), timeout_s + HOST_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await self.send("K", rid)
            return ExecDone(exit_code=137, timed_out=True, out_size=0, err_size=0, stdout=b"", stderr=b"")
        finally:
            self.streams.pop(rid, None)
        done = ExecDone(exit_code=int(a[0]), timed_out=a[1] == "1", out_size=int(a[2]), err_size=int(a[3]),
                        stdout=unb64(a[4]), stderr=unb64(a[5]), oom_killed=len(a) > 6 and a[6].isdigit() and int(a[6]) > 0)
        if on_chunk is not None:  # what the guest had not streamed yet
            for name, data in (("stdout", done.stdout), ("stderr", done.stderr)):
                if len(data) > sent[name]:
                    on_chunk(name, data[sent[name]:])
        return done

    async def upper(self, tar_path: str, timeout_s: float) -> bytes:
        """The guest's writable layer, read by its agent with the sandbox's processes frozen: a
        tar of it written to `tar_path` as it comes; returns the opaque directories' list
        (NUL-separated paths relative to it), which a tar does not carry."""
        rid = str(next(self.ids))
        opaque = bytearray()
        with open(tar_path, "wb") as f:
            def chunk(kind: str, data: bytes) -> None:
                if kind == "t":
                    f.write(data)
                else:
                    opaque.extend(data)

            self.blobs[rid] = chunk
            try:
                a = await asyncio.wait_for(self.call("U", rid=rid), timeout_s)
            finally:
                self.blobs.pop(rid, None)
        if a[0] != "0":
            raise Internal("the guest agent could not read the sandbox's writable layer")
        return bytes(opaque)

    async def read_file(self, path: str, max_bytes: int) -> FileAnswer:
        a = await self.call("R", str(max_bytes), b64(path.encode()))
        return FileAnswer(rc=int(a[0]), mode=int(a[1], 8), data=unb64(a[2]))

    async def write_file(self, path: str, data: bytes, mode: int, make_parents: bool) -> FileAnswer:
        a = await self.call("W", format(mode & 0o7777, "o"), "1" if make_parents else "0", b64(path.encode()), raw(data), payload=data)
        return FileAnswer(rc=int(a[0]), mode=0, data=unb64(a[2]))

    async def guard(self, protected: list[str], canaries: list[str], activity: tuple[float, float] | None) -> FileAnswer:
        """Have the guest guard these paths (corral-guest guard) and, with `activity` (events/s,
        burst), report the sandbox's file activity; answered once every mark is set."""
        payload = b"".join(b"p" + p.encode() + b"\0" for p in protected) + b"".join(b"c" + c.encode() + b"\0" for c in canaries)
        rate, burst = activity or (0.0, 0.0)
        a = await self.call("G", f"{rate:g}", f"{burst:g}", raw(payload), payload=payload)
        return FileAnswer(rc=int(a[0]), mode=0, data=unb64(a[2]))

    async def close(self) -> None:
        self.closed = True
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        if self.reader_task is not None:
            self.reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self.reader_task
