"""CLI of the adapters for other agent tooling:

    corral mcp [--nats URL] [--transport stdio|http] [--host H] [--port P] [--keep-sandboxes]
    corral tools --format openai|mcp

`register(app)` adds them to the `corral` CLI (cli.py calls it, like cli_substrates)."""
from __future__ import annotations

import asyncio
import json
import sys

import typer
from rich.console import Console

from corral_common import config
from corral_common.contract.errors import CorralError

console = Console(stderr=True)


def register(app: typer.Typer) -> None:
    @app.command("mcp")
    def mcp(nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL)"),
            transport: str = typer.Option("stdio", help="stdio (spawned by an MCP client) or http (streamable HTTP at /mcp)"),
            host: str = typer.Option("127.0.0.1", help="http: address to listen on"),
            port: int = typer.Option(8765, help="http: port (0: a free one)"),
            keep_sandboxes: bool = typer.Option(False, "--keep-sandboxes", help="leave the sandboxes the tools created running on exit")) -> None:
        """Serve corral's tools (sandbox_create, env_rollout, exec, read_file, write_file, grade, destroy) over MCP."""
        from corral_common.lifecycle import run_until_signalled

        if transport not in ("stdio", "http"):
            console.print(f"[red]--transport {transport!r}:[/red] expected stdio or http")
            raise typer.Exit(2)
        try:
            from .integrations import mcp_server
        except CorralError as e:
            console.print(f"[red]{e.message}[/red]")
            raise typer.Exit(2) from None
        url = config.nats_url(nats)

        async def run(stop: asyncio.Event) -> None:
            if transport == "stdio":
                await mcp_server.serve_stdio(url, keep_sandboxes, stop=stop)
            else:
                await mcp_server.serve_http(url, host, port, keep_sandboxes, stop=stop,
                                            ready=lambda u: print(f"corral mcp ready {u}", file=sys.stderr, flush=True))

        try:
            run_until_signalled(run)
        except CorralError as e:
            console.print(f"[red]{e}[/red]")
            raise typer.Exit(1) from None

    @app.command("tools")
    def tools(format: str = typer.Option("openai", "--format", help="openai (chat-completions `tools`) or mcp (MCP Tool objects)")) -> None:
        """Print corral's agent tools as JSON function schemas, the same ones `corral mcp` serves."""
        from .integrations.tools import TOOLS, input_schema, openai_tools

        if format == "openai":
            out = openai_tools()
        elif format == "mcp":
            out = [{"name": t.name, "description": t.description, "inputSchema": input_schema(t.args)} for t in TOOLS]
        else:
            console.print(f"[red]--format {format!r}:[/red] expected openai or mcp")
            raise typer.Exit(2)
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    _app = typer.Typer(add_completion=False, no_args_is_help=True)
    register(_app)
    _app()
