"""`corral`: the command line. Starts the embedded stack or single services, manages sandboxes
and runs the demo job."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import typer
from rich.console import Console
from rich.table import Table

from corral_common import config
from corral_common.errors import CorralError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="corral: sandboxes for training and evaluating AI agents")
sandbox_app = typer.Typer(no_args_is_help=True, help="create, exec in, list and remove sandboxes")
image_app = typer.Typer(no_args_is_help=True, help="build and list the built-in images on this machine")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(image_app, name="image")
console = Console(stderr=True)
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _exec_module(module: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


@app.command(context_settings=PASSTHROUGH)
def scheduler(ctx: typer.Context) -> None:
    """Run a scheduler replica (`corral scheduler --help` for its options)."""
    _exec_module("corral_scheduler", ctx.args)


@app.command("node-agent", context_settings=PASSTHROUGH)
def node_agent(ctx: typer.Context) -> None:
    """Run a node-agent (`corral node-agent --help` for its options)."""
    _exec_module("corral_node_agent", ctx.args)


@app.command()
def up(
    nodes: int = typer.Option(1, help="node-agents to start"),
    nats_port: int = typer.Option(4222, help="port of the embedded NATS server"),
    nats: str = typer.Option(None, help="use this NATS instead of starting one"),
    data_dir: str = typer.Option(None, help="state and logs (default $CORRAL_STATE_DIR or /var/lib/corral)"),
    image_dir: str = typer.Option(None, help="image store (default <data-dir>/images)"),
    metrics_port: int = typer.Option(0, help="first metrics port (0: free ports)"),
) -> None:
    """Start NATS, the scheduler and node-agents on this machine; stop them all on SIGINT/SIGTERM."""
    from .stack import Stack

    stack = Stack(data_dir=config.state_dir(data_dir), nodes=nodes, nats_port=nats_port, nats_url=nats,
                  image_dir=image_dir, metrics_port=metrics_port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        try:
            await stack.start()
        except Exception as e:
            console.print(f"[red]corral up failed:[/red] {e}")
            raise typer.Exit(1) from None
        for p in stack.procs:
            if p.metrics_url:
                console.print(f"metrics {p.name}: {p.metrics_url}")
        console.print(f"logs: {stack.data_dir}/logs")
        print(f"corral ready {stack.url}", flush=True)
        await stop.wait()
        console.print("corral: shutting down")
        await stack.stop()

    asyncio.run(run())


def _client():
    from .sync import Client

    try:
        return Client(config.nats_url(None))
    except CorralError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


def _fail(e: CorralError) -> None:
    console.print(f"[red]{e.code.value}[/red]: {e.message}")
    raise typer.Exit(1)


@sandbox_app.command("create")
def sandbox_create(
    image: str = typer.Option("busybox"), substrate: str = typer.Option("container"), cpu: float = typer.Option(1.0),
    memory_mb: int = typer.Option(512), ttl_s: float = typer.Option(3600.0), job: str = typer.Option(""),
    label: list[str] = typer.Option([], help="key=value"), count: int = typer.Option(1),
) -> None:
    """Create sandboxes and print their ids."""
    labels = dict(kv.split("=", 1) for kv in label)
    c = _client()
    try:
        if count == 1:
            sbs = [c.create(image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb, ttl_s=ttl_s, job=job, labels=labels)]
        else:
            sbs = c.create_batch(count, image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb, ttl_s=ttl_s, job=job, labels=labels)
    except CorralError as e:
        _fail(e)
    for sb in sbs:
        print(sb.id)


@sandbox_app.command("exec")
def sandbox_exec(sandbox_id: str, cmd: str, timeout_s: float = typer.Option(60.0), session: str = typer.Option(""),
                 stream: bool = typer.Option(True, help="print output as it arrives")) -> None:
    """Run a command in a sandbox; exits with its exit code."""
    from corral_common.messages import ExecChunk

    c = _client()
    sb = c.sandbox(sandbox_id)
    try:
        if stream:
            result = None
            for item in sb.exec_stream(cmd, timeout_s=timeout_s, session=session):
                if isinstance(item, ExecChunk):
                    (sys.stdout if item.stream == "stdout" else sys.stderr).write(item.data)
                    (sys.stdout if item.stream == "stdout" else sys.stderr).flush()
                else:
                    result = item
        else:
            result = sb.exec(cmd, timeout_s=timeout_s, session=session)
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
    except CorralError as e:
        _fail(e)
    assert result is not None
    raise typer.Exit(result.exit_code)


@sandbox_app.command("ls")
def sandbox_ls(job: str = typer.Option(None), as_json: bool = typer.Option(False, "--json")) -> None:
    """List live sandboxes."""
    import time

    c = _client()
    try:
        infos = c.list(job=job)
    except CorralError as e:
        _fail(e)
    if as_json:
        import msgspec

        print(msgspec.json.encode(infos).decode())
        return
    t = Table("id", "node", "state", "substrate", "image", "job", "age", "expires in")
    now = time.time()
    for i in infos:
        t.add_row(i.id, i.node, i.state, i.substrate, i.image, i.job, f"{now - i.created_at:.0f}s", f"{i.expires_at - now:.0f}s")
    Console().print(t)


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str], all_: bool = typer.Option(False, "--all", help="remove every sandbox")) -> None:
    """Destroy sandboxes."""
    c = _client()
    ids = list(sandbox_ids)
    if all_:
        ids += [i.id for i in c.list()]
    rc = 0
    for sid in ids:
        try:
            c.sandbox(sid).destroy()
            print(sid)
        except CorralError as e:
            console.print(f"{sid}: [red]{e.code.value}[/red] {e.message}")
            rc = 1
    raise typer.Exit(rc)


@image_app.command("build")
def image_build(name: str, image_dir: str = typer.Option(None)) -> None:
    """Build a built-in image (busybox, debian) into the local image store."""
    root = image_dir or os.environ.get("CORRAL_IMAGE_DIR") or f"{config.state_dir(None)}/images"
    _exec_module("corral_node_agent.images", ["build", name, "--root", root])


@image_app.command("ls")
def image_ls(image_dir: str = typer.Option(None)) -> None:
    """List images in the local image store."""
    root = image_dir or os.environ.get("CORRAL_IMAGE_DIR") or f"{config.state_dir(None)}/images"
    _exec_module("corral_node_agent.images", ["ls", "--root", root])


@app.command()
def demo(
    count: int = typer.Option(32, help="sandboxes to run at once"),
    image: str = typer.Option("debian"),
    nodes: int = typer.Option(1),
    data_dir: str = typer.Option(None),
    nats_port: int = typer.Option(0, help="0: a free port"),
    report: str = typer.Option(None, help="write the summary as JSON here"),
) -> None:
    """The main job: start the embedded stack, run a Python task in a batch of sandboxes, report."""
    from .demo import run_demo

    rc = asyncio.run(run_demo(count=count, image=image, nodes=nodes, data_dir=config.state_dir(data_dir),
                              nats_port=nats_port, report=report, console=Console()))
    raise typer.Exit(rc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
