"""`corral`: the command line. Starts the embedded stack or single services, manages sandboxes
and runs the demo job."""
from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from corral_common import auth, config
from corral_common.contract import subjects
from corral_common.contract.envelope import R
from corral_common.contract.errors import CorralError, InvalidRequest
from corral_common.contract.images import ImageDeleteReply, ImageListReply, ImportReply, ImportRequest, InspectReply, NameRequest
from corral_common.contract.messages import Empty

if TYPE_CHECKING:
    from .client import AsyncClient
    from .sync import Client

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="corral: sandboxes for training and evaluating AI agents")
sandbox_app = typer.Typer(no_args_is_help=True, help="create, exec in, list and remove sandboxes")
image_app = typer.Typer(no_args_is_help=True, help="build, import, list, inspect and remove images")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(image_app, name="image")
traj_app = typer.Typer(no_args_is_help=True, help="list, show and remove trajectory logs")
app.add_typer(traj_app, name="traj")
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
    docker: bool = typer.Option(False, "--docker", help="also offer the docker substrate (needs a running dockerd)"),
    gvisor: bool = typer.Option(False, "--gvisor", help="also offer the gvisor substrate (gVisor's runsc)"),
    microvm: bool = typer.Option(False, "--microvm", help="also offer the microvm substrate (a QEMU guest per sandbox)"),
    vm: bool = typer.Option(False, "--vm", help="also offer the vm substrate (a full q35 QEMU guest per sandbox)"),
    warm_pool: list[str] = typer.Option([], "--warm-pool", help="[SUBSTRATE:]IMAGE=COUNT paused sandboxes each node keeps ready for "
                                                                "creates to claim (repeatable), e.g. --warm-pool busybox=4 or microvm:busybox=2"),
    gateway_port: int = typer.Option(None, help="also serve the SandboxFusion API (`corral gateway`) on this port"),
    cluster: int = typer.Option(1, help="nats-servers: 1, or a cluster of 3 or more (routes on loopback, JetStream at "
                                        "replicas 3); the first listens on --nats-port"),
    hosts: int = typer.Option(0, help="3 or more: run them as hosts on this machine (network namespaces on a bridge, "
                                      "each with its own nats-server of the cluster, node-agents spread over them, "
                                      "2 scheduler replicas); needs root"),
) -> None:
    """Start NATS, the scheduler and node-agents on this machine; stop them all on SIGINT/SIGTERM."""
    from corral_common.lifecycle import run_until_signalled

    from .stack import Stack

    bad = [w for w in warm_pool if not re.fullmatch(r"[^=\s]+(=\d+)?", w)]
    if bad:
        console.print(f"[red]--warm-pool {bad[0]!r}:[/red] expected IMAGE=COUNT, e.g. busybox=4")
        raise typer.Exit(2)
    if cluster < 1 or cluster == 2:
        console.print(f"[red]--cluster {cluster}:[/red] 1, or 3 or more (JetStream needs a majority of its servers up)")
        raise typer.Exit(2)
    if hosts and (hosts < 3 or nats):
        console.print(f"[red]--hosts {hosts}:[/red] 3 or more, each running its own nats-server (not with --nats)")
        raise typer.Exit(2)
    stack = Stack(data_dir=config.state_dir(data_dir), nodes=nodes, nats_port=nats_port, nats_url=nats, cluster=cluster, hosts=hosts,
                  image_dir=image_dir, metrics_port=metrics_port, docker=docker, gvisor=gvisor, microvm=microvm, vm=vm,
                  node_args=[a for w in warm_pool for a in ("--warm-pool", w)], gateway_port=gateway_port)

    async def run(stop: asyncio.Event) -> None:
        try:
            await stack.start()
        except Exception as e:
            console.print(f"[red]corral up failed:[/red] {e}")
            raise typer.Exit(1) from None
        for p in stack.procs:
            if p.metrics_url:
                console.print(f"metrics {p.name}: {p.metrics_url}")
        if stack.gateway_url:
            console.print(f"SandboxFusion gateway: {stack.gateway_url}/run_code")
        console.print(f"logs: {stack.data_dir}/logs")
        if stack.creds:
            console.print(f"credentials: {stack.creds} (found by the SDK and CLI for the default data dir; "
                          f"elsewhere set {auth.CREDS_ENV})")
        print(f"corral ready {stack.bus_url}", flush=True)
        await stop.wait()
        console.print("corral: shutting down")
        await stack.stop()

    run_until_signalled(run)


def _client() -> Client:
    from .sync import Client

    try:
        return Client(config.nats_url(None))
    except CorralError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


def _fail(e: CorralError) -> NoReturn:
    console.print(f"[red]{e.code.value}[/red]: {e.message}")
    raise typer.Exit(1)


@sandbox_app.command("create")
def sandbox_create(
    image: str = typer.Option("busybox"), substrate: str = typer.Option("container"), cpu: float = typer.Option(1.0),
    memory_mb: int = typer.Option(512), ttl_s: float = typer.Option(3600.0), job: str = typer.Option(""),
    label: list[str] = typer.Option([], help="key=value"), count: int = typer.Option(1),
    fork_of: str = typer.Option("", help="fork this running sandbox: its files, on its node and image (with --count N: one batch of N forks)"),
) -> None:
    """Create sandboxes and print their ids."""
    labels = dict(kv.split("=", 1) for kv in label)
    c = _client()
    try:
        if fork_of and count == 1:
            sbs = [c.sandbox(fork_of).fork(cpu=cpu, memory_mb=memory_mb, ttl_s=ttl_s, job=job, labels=labels)]
        elif fork_of:  # one batch: every fork on the source's node
            sbs = c.create_batch(count, fork_of=fork_of, cpu=cpu, memory_mb=memory_mb, ttl_s=ttl_s, job=job, labels=labels)
        elif count == 1:
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
    from corral_common.contract.messages import ExecChunk

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


@sandbox_app.command("port-forward")
def sandbox_port_forward(sandbox_id: str, port: int,
                         local_port: int = typer.Option(0, help="local port to listen on (0: any free one)"),
                         host: str = typer.Option("127.0.0.1", help="local address to listen on")) -> None:
    """Forward a local port to a port on the sandbox's loopback, over the bus (until Ctrl-C).

    E.g. `corral sandbox port-forward sb-123 9222 --local-port 9222`, then point a DevTools
    client (Playwright's connect_over_cdp) at http://127.0.0.1:9222."""
    from corral_common.lifecycle import run_until_signalled

    from .client import AsyncClient

    async def run(stop: asyncio.Event) -> None:
        c = await AsyncClient.connect(config.nats_url(None))
        try:
            sb = c.sandbox(sandbox_id)
            await sb.refresh()  # a missing sandbox fails here, not at the first connection
            fwd = await sb.forward(port, local_port, host)
            console.print(f"forwarding {fwd.address} -> {sandbox_id}:127.0.0.1:{port} (Ctrl-C to stop)")
            try:
                await stop.wait()
            finally:
                await fwd.close()
        finally:
            await c.close()

    try:
        run_until_signalled(run)
    except CorralError as e:
        _fail(e)
    except OSError as e:
        console.print(f"[red]cannot listen on {host}:{local_port}[/red]: {e}")
        raise typer.Exit(1) from None


@app.command(context_settings=PASSTHROUGH)
def gateway(ctx: typer.Context) -> None:
    """Serve the SandboxFusion API (POST /run_code) over HTTP, run on corral (`corral gateway --help` for its options)."""
    from corral_common import extras
    from corral_common.contract.errors import Unavailable

    try:
        extras.require_installed(["aiohttp"], "gateway", "the SandboxFusion gateway")
    except Unavailable as e:
        console.print(f"[red]{e.message}[/red]")
        raise typer.Exit(1) from None
    _exec_module("corral_gateway", ctx.args)


@app.command("image-cache", context_settings=PASSTHROUGH)
def image_cache(ctx: typer.Context) -> None:
    """Run the image registry service (`corral image-cache --help` for its options)."""
    _exec_module("corral_image_cache", ctx.args)


@app.command("image-loader", context_settings=PASSTHROUGH)
def image_loader(ctx: typer.Context) -> None:
    """Run a node's lazy image loader (`corral image-loader --help` for its options)."""
    _exec_module("corral_image_cache.loader", ctx.args)


def _image_root(image_dir: str | None) -> str:
    return image_dir or os.environ.get("CORRAL_IMAGE_DIR") or "/var/lib/corral/images"


def _image_call(subject: str, body: Any, typ: type[R], timeout: float = 600.0) -> R:
    import asyncio

    from .client import AsyncClient

    async def go() -> R:
        c = await AsyncClient.connect(config.nats_url(None))
        try:
            return await c.request(subject, body, typ, timeout)
        finally:
            await c.close()

    try:
        return asyncio.run(go())
    except CorralError as e:
        _fail(e)
    except Exception as e:
        console.print(f"[red]{e}[/red] (is the corral stack running? CORRAL_NATS_URL={config.nats_url(None)})")
        raise typer.Exit(2) from None


@image_app.command("build")
def image_build(name: str, image_dir: str = typer.Option(None), load: bool = typer.Option(
        True, help="import into the running stack's image-cache afterwards (if one answers)")) -> None:
    """Build a built-in image (busybox, debian, browser, toolchain) on this machine, with progress, and import it."""
    import subprocess

    rc = subprocess.call([sys.executable, "-m", "corral_image_cache.builtin", "build", name, "--root", _image_root(image_dir)])
    if rc != 0 or not load:
        raise typer.Exit(rc)
    try:
        from .sync import Client

        Client(config.nats_url(None)).close()
    except Exception:
        console.print("no stack running: the image-cache imports it when it starts")
        raise typer.Exit(0) from None
    r = _image_call(subjects.IMAGE_IMPORT, ImportRequest(name=name, source="builtin"), ImportReply)
    console.print(f"imported {name}: {len(r.image.layers)} layer(s), {r.image.size / 2**20:.1f} MiB")


@image_app.command("import")
def image_import(name: str, path: str, source: str = typer.Option("dir", help="dir, tar, docker_archive, upper"),
                 base: str = typer.Option("", help="compose on top of this image"),
                 label: list[str] = typer.Option([], help="key=value")) -> None:
    """Import a directory, tarball or `docker save` archive as a layered image."""
    try:
        req = msgspec.convert({"name": name, "source": source, "path": os.path.abspath(path), "base": base,
                               "labels": dict(kv.split("=", 1) for kv in label)}, ImportRequest)
    except (msgspec.ValidationError, ValueError) as e:
        _fail(InvalidRequest(f"invalid import: {e}"))
    with console.status(f"importing {path}"):
        r = _image_call(subjects.IMAGE_IMPORT, req, ImportReply)
    console.print(f"{name}: {len(r.image.layers)} layer(s), {r.image.size / 2**20:.1f} MiB, uploaded {r.uploaded_bytes / 2**20:.1f} MiB")


@image_app.command("ls")
def image_ls() -> None:
    """List images in the catalog."""
    r = _image_call(subjects.IMAGE_LIST, Empty(), ImageListReply)
    t = Table("name", "layers", "size MiB", "parent", "labels")
    for i in r.images:
        t.add_row(i.name, str(len(i.layers)), f"{i.size / 2**20:.1f}", i.parent, ",".join(f"{k}={v}" for k, v in i.labels.items()))
    Console().print(t)


@image_app.command("inspect")
def image_inspect(name: str) -> None:
    """Show an image's layers and chunks."""
    r = _image_call(subjects.IMAGE_INSPECT, NameRequest(name=name), InspectReply)
    print(msgspec.json.format(msgspec.json.encode(r), indent=2).decode())


@image_app.command("rm")
def image_rm(names: list[str]) -> None:
    """Delete images (and the layers and chunks nothing else uses)."""
    for n in names:
        r = _image_call(subjects.IMAGE_DELETE, NameRequest(name=n), ImageDeleteReply)
        print(f"{n}: freed {r.freed_layers} layer(s), {r.freed_chunks} chunk(s)")


def _traj_run(coro_fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
    import asyncio

    from .client import AsyncClient

    async def go() -> T:
        c = await AsyncClient.connect(config.nats_url(None))
        try:
            return await coro_fn(c)
        finally:
            await c.close()

    try:
        return asyncio.run(go())
    except CorralError as e:
        _fail(e)


@traj_app.command("ls")
def traj_ls(prefix: str = typer.Option("", help="only ids starting with this")) -> None:
    """List trajectories."""
    import time

    metas = _traj_run(lambda c: c.trajectories.list(prefix))
    t = Table("id", "sandbox", "node", "steps", "snapshots", "updated")
    for m in metas:
        t.add_row(m.id, m.sandbox_id, m.node, str(m.last_step + 1), ",".join(str(s.step) for s in m.snapshots),
                  f"{time.time() - m.updated_at:.0f}s ago")
    Console().print(t)


@traj_app.command("show")
def traj_show(trajectory_id: str) -> None:
    """Show a trajectory and its most recent steps."""
    meta, recent = _traj_run(lambda c: c.trajectories.get(trajectory_id))
    Console().print(f"[bold]{meta.id}[/bold] sandbox {meta.sandbox_id} on {meta.node}, {meta.last_step + 1} steps, "
                    f"snapshot every {meta.snapshot_every}, snapshots at {[s.step for s in meta.snapshots]}")
    t = Table("step", "command", "exit", "ms", "stdout")
    for e in recent:
        cmd = e.request.cmd if isinstance(e.request.cmd, str) else " ".join(e.request.cmd)
        t.add_row(str(e.step), cmd[:60], str(e.result.exit_code), f"{e.result.duration_ms:.1f}", e.result.stdout[:60].replace("\n", " "))
    Console().print(t)


@traj_app.command("rm")
def traj_rm(trajectory_ids: list[str]) -> None:
    """Delete trajectory logs (and their snapshot images)."""
    for tid in trajectory_ids:
        _traj_run(lambda c: c.trajectories.delete(tid))  # run to completion here, before the loop rebinds tid
        print(tid)


@app.command()
def demo(
    count: int = typer.Option(40, help="rollouts (policies are dealt round-robin)"),
    parallel: int = typer.Option(0, help="rollouts in flight at once (0: 8; on microvm or vm 2, where a guest without KVM "
                                          "emulates every instruction)"),
    nodes: int = typer.Option(1),
    data_dir: str = typer.Option(None),
    nats_port: int = typer.Option(0, help="0: a free port"),
    report: str = typer.Option(None, help="JSON report path (a PNG plot is written beside it); default <data-dir>/demo-report.json"),
    web_rollouts: int = typer.Option(4, help="rollouts of the web environment (a browser agent's task; 0: leave it out)"),
    substrate: str = typer.Option("container", help="where the rollouts run: container, gvisor, docker, microvm or vm (the stack "
                                                     "offers it too); one that cannot enforce canaries and protected paths refuses them"),
) -> None:
    """The main job: build and verify environments, run scripted honest and cheating agents in them, grade them."""
    from .demo import run_demo

    rc = asyncio.run(run_demo(count=count, nodes=nodes, data_dir=config.state_dir(data_dir), nats_port=nats_port,
                              report=report, parallel=parallel, console=Console(), web_rollouts=web_rollouts, substrate=substrate))
    raise typer.Exit(rc)


@app.command()
def contract(out: str = typer.Option("docs/contract", help="directory to write asyncapi.json and schemas/ into"),
             check: bool = typer.Option(False, help="write nothing; exit 1 if the files in OUT differ from the code")) -> None:
    """The bus contract as documents: an AsyncAPI 3 document of every subject and a JSON Schema per message."""
    from corral_common.contract import asyncapi

    want = asyncapi.files()
    if check:
        stale = []
        for rel, text in want.items():
            try:
                with open(os.path.join(out, rel), encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(rel)
            except FileNotFoundError:
                stale.append(rel)
        have = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs}
        extra = sorted(have - set(want))
        if stale or extra:
            console.print(f"[red]{out} is out of date[/red]: {len(stale)} changed or missing, {len(extra)} no longer generated "
                          f"({', '.join((stale + extra)[:8])}); run `corral contract --out {out}`")
            raise typer.Exit(1)
        console.print(f"{out}: {len(want)} files, current")
        return
    import shutil

    shutil.rmtree(os.path.join(out, "schemas"), ignore_errors=True)
    for rel, text in want.items():
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    console.print(f"wrote {len(want)} files into {out}")

from .cli_monitor import register as _register_monitor  # noqa: E402  (alerts, report, monitor)

_register_monitor(app, PASSTHROUGH)

from .cli_envs import register as _register_envs  # noqa: E402  (env build|ls|show|grade|rm, env-builder)

_register_envs(app, PASSTHROUGH)

from .cli_substrates import register as _register_substrates  # noqa: E402  (run, image export/import-docker)

_register_substrates(app, image_app)

from .cli_tenants import register as _register_tenants  # noqa: E402  (tenant add|list|revoke)

_register_tenants(app)

from .cli_integrations import register as _register_integrations  # noqa: E402  (mcp, tools)

_register_integrations(app)


from .cli_eval import register as _register_eval  # noqa: E402  (eval)

_register_eval(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
