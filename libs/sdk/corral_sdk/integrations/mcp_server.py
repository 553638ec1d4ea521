"""`corral mcp`: corral's tools (tools.py) served over the Model Context Protocol with the official
`mcp` package, on stdio (an MCP client spawns `corral mcp --nats URL`) or streamable HTTP
(`corral mcp --transport http --port 8765`, endpoint `/mcp`).

The low-level `Server` is used rather than the decorator API so that the schemas a client lists
are exactly `tools.input_schema` of the shared Structs (the ones `corral tools --format openai`
prints), and a failed tool is an `isError` result carrying corral's code and message (also as
`structuredContent.error`), which the model can read, rather than a protocol error it cannot."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from corral_common.extras import require

require("mcp", "mcp", "the MCP server (`corral mcp`)")

import mcp.types as types  # noqa: E402
from mcp.server.lowlevel import Server  # noqa: E402

from ..client import AsyncClient  # noqa: E402
from .tools import TOOLS, Toolbox, input_schema  # noqa: E402

INSTRUCTIONS = ("corral runs isolated Linux sandboxes. Create one (sandbox_create) or start a task of an environment "
                "(env_rollout), run commands (exec; pass session to keep cwd and variables), read and write files, "
                "grade an environment rollout, and destroy the sandbox when done.")


def mcp_tools() -> list[types.Tool]:
    return [types.Tool(name=t.name, description=t.description, input_schema=input_schema(t.args)) for t in TOOLS]


def build_server(toolbox: Toolbox) -> Server[Any]:
    """An MCP server whose tools run in `toolbox` (one corral connection, shared by every client
    of an HTTP server)."""
    listed = types.ListToolsResult(tools=mcp_tools())

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return listed

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        r = await toolbox.call(params.name, params.arguments)
        return types.CallToolResult(content=[types.TextContent(text=r.text)], structured_content=r.data, is_error=r.error is not None)

    try:
        ver = version("corral")
    except PackageNotFoundError:  # run from a source tree without an install
        ver = "0"
    return Server("corral", version=ver, instructions=INSTRUCTIONS, on_list_tools=list_tools, on_call_tool=call_tool)


@contextlib.asynccontextmanager
async def toolbox(nats_url: str | None, keep_sandboxes: bool = False) -> AsyncIterator[Toolbox]:
    """A connected Toolbox; on exit the sandboxes it made are destroyed (unless kept) and it disconnects."""
    client = await AsyncClient.connect(nats_url)
    tb = Toolbox(client, keep_sandboxes=keep_sandboxes)
    try:
        yield tb
    finally:
        try:
            await tb.close()
        finally:
            await client.close()


@contextlib.contextmanager
def _no_signal_capture() -> Iterator[None]:
    """uvicorn's capture_signals for a server whose caller owns SIGINT/SIGTERM: leaves them alone."""
    yield


async def _until(work: asyncio.Task[None], stop: asyncio.Event | None) -> None:
    """Wait for `work`; when `stop` is set first, cancel it (its cleanup still runs)."""
    waiter = asyncio.create_task(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait([work, *([waiter] if waiter else [])], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if waiter is not None:
            waiter.cancel()
        if not work.done():
            work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work


async def serve_stdio(nats_url: str | None, keep_sandboxes: bool = False, stop: asyncio.Event | None = None) -> None:
    """MCP on this process's stdin/stdout until the client closes them (or `stop` is set)."""
    from mcp.server.stdio import stdio_server

    async with toolbox(nats_url, keep_sandboxes) as tb:
        server = build_server(tb)

        async def run() -> None:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        await _until(asyncio.create_task(run()), stop)


async def serve_http(nats_url: str | None, host: str, port: int, keep_sandboxes: bool = False,
                     ready: Callable[[str], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Streamable HTTP on http://host:port/mcp until `stop` is set; `ready(url)` is called once
    the socket listens (port 0: a free port)."""
    import uvicorn

    async with toolbox(nats_url, keep_sandboxes) as tb:
        app = build_server(tb).streamable_http_app(host=host)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        server.capture_signals = _no_signal_capture  # type: ignore[method-assign]  # the caller owns SIGINT/SIGTERM
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)  # uvicorn offers no started event
        if server.started and ready is not None:
            ready(f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}/mcp")
        if stop is None:
            await task
            return
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        server.should_exit = True  # a graceful stop: open streams end, then the lifespan
        await task
