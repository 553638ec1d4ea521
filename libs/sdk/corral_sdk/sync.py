"""Synchronous twins of the async client, for scripts and notebooks: one background event loop
thread runs the async client and every method blocks on its result."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from corral_common.contract.messages import AuditState, ChangesReply, ExecChunk, ExecResult, SandboxInfo

from . import ports
from .client import AsyncClient, AsyncSandbox


class _Loop:
    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="corral-sdk-loop", daemon=True).start()
                cls._loop = loop
            return cls._loop


T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, _Loop.get()).result()


async def _next(it: AsyncIterator[T]) -> T:
    """A coroutine for `_run` (an async iterator's `__anext__` is only typed as an Awaitable)."""
    return await it.__anext__()


class Client:
    def __init__(self, url: str | None = None):
        self._c: AsyncClient = _run(AsyncClient.connect(url))

    def create(self, image: str = "busybox", substrate: str = "container", **kw: Any) -> Sandbox:
        return Sandbox(_run(self._c.create(image=image, substrate=substrate, **kw)))

    def create_batch(self, count: int, image: str = "busybox", substrate: str = "container", **kw: Any) -> list[Sandbox]:
        return [Sandbox(s) for s in _run(self._c.create_batch(count, image=image, substrate=substrate, **kw))]

    def run(self, cmd: str | list[str], **kw: Any) -> ExecResult:
        """One command in a fresh, throwaway sandbox (substrate "function" by default)."""
        return _run(self._c.run(cmd, **kw))

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in a fresh sandbox (image "debian" by default); see AsyncClient.call."""
        return _run(self._c.call(fn, *args, **kwargs))

    def list(self, job: str | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return _run(self._c.list(job=job, labels=labels))

    def sandbox(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._c.sandbox(sandbox_id))

    def close(self) -> None:
        _run(self._c.close())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Files:
    def __init__(self, sb: AsyncSandbox):
        self._sb = sb

    def read(self, path: str, max_bytes: int = 16 * 1024 * 1024) -> bytes:
        return _run(self._sb.files.read(path, max_bytes))

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        _run(self._sb.files.write(path, content, mode))


class PortForward:
    """A port forward served by the background loop (see ports.PortForward)."""

    def __init__(self, fwd: ports.PortForward):
        self._f = fwd

    @property
    def local_port(self) -> int:
        return self._f.local_port

    @property
    def address(self) -> str:
        return self._f.address

    def close(self) -> None:
        _run(self._f.close())

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    def __init__(self, asb: AsyncSandbox):
        self._a = asb
        self.files = Files(asb)

    @classmethod
    def create(cls, image: str = "busybox", substrate: str = "container", *, nats_url: str | None = None, **kw: Any) -> Sandbox:
        return cls(_run(AsyncSandbox.create(image=image, substrate=substrate, nats_url=nats_url, **kw)))

    @property
    def id(self) -> str:
        return self._a.id

    @property
    def info(self) -> SandboxInfo:
        return self._a.info

    def exec(self, cmd: str | list[str], **kw: Any) -> ExecResult:
        return _run(self._a.exec(cmd, **kw))

    def exec_stream(self, cmd: str | list[str], **kw: Any) -> Iterator[ExecChunk | ExecResult]:
        agen = self._a.exec_stream(cmd, **kw)
        while True:
            try:
                yield _run(_next(agen))
            except StopAsyncIteration:
                return

    def forward(self, port: int, local_port: int = 0, host: str = "127.0.0.1") -> PortForward:
        """Listen on host:local_port; each connection reaches `port` inside the sandbox (close it when done)."""
        return PortForward(_run(self._a.forward(port, local_port, host)))

    def renew(self, ttl_s: float | None = None) -> SandboxInfo:
        return _run(self._a.renew(ttl_s))

    def snapshot(self, name: str = "", labels: dict[str, str] | None = None, *, memory: bool = False) -> str:
        return _run(self._a.snapshot(name, labels, memory=memory))

    def fork(self, **kw: Any) -> Sandbox:
        return Sandbox(_run(self._a.fork(**kw)))

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) inside this sandbox; see AsyncSandbox.call."""
        return _run(self._a.call(fn, *args, **kwargs))

    def changes(self, include: list[str] | None = None, exclude: list[str] | None = None, **kw: Any) -> ChangesReply:
        return _run(self._a.changes(include, exclude, **kw))

    def audit_state(self) -> AuditState:
        return _run(self._a.audit_state())

    def pause(self) -> None:
        _run(self._a.pause())

    def resume(self) -> None:
        _run(self._a.resume())

    def refresh(self) -> SandboxInfo:
        return _run(self._a.refresh())

    def destroy(self) -> None:
        _run(self._a.destroy())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        _run(self._a.__aexit__(None, None, None))
