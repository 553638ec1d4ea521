"""`python -m corral_gateway` (`corral gateway`): serve the SandboxFusion API over HTTP until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging

import typer
from aiohttp import web

from corral_common import config, logs, metrics
from corral_common.lifecycle import run_until_signalled
from corral_sdk.client import AsyncClient

from .runner import Runner, RunnerConfig
from .server import Gateway

app = typer.Typer(add_completion=False)
log = logging.getLogger("corral.gateway")


async def serve(stop: asyncio.Event, nats_url: str, host: str, port: int, cfg: RunnerConfig) -> None:
    client = await AsyncClient.connect(nats_url)
    runner = web.AppRunner(Gateway(Runner(client, cfg)).app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        metrics.UP.labels("gateway").set(1)
        logs.kv(log, logging.INFO, "serving", url=f"http://{host}:{bound}", nats=nats_url, image=cfg.image,
                toolchain_image=cfg.toolchain_image)
        print(f"corral gateway ready http://{host}:{bound}", flush=True)
        await stop.wait()
        metrics.UP.labels("gateway").set(0)
    finally:
        await runner.cleanup()  # stops accepting, lets in-flight requests finish
        await client.close()


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    port: int = typer.Option(8080, help="HTTP port (SandboxFusion's default is 8080; 0 picks a free one)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for every interface)"),
    image: str = typer.Option("debian", help="image of python, pytest and bash runs: it must have python3, pytest and bash"),
    toolchain_image: str = typer.Option("toolchain", help="image of cpp, rust and nodejs runs: it must have g++, rustc and node "
                                        "(the built-in `toolchain`: corral image build toolchain)"),
    cpu: float = typer.Option(1.0, help="CPU cores of each run's sandbox"),
    memory_mb: int = typer.Option(1024, help="memory of a run's sandbox when the request sets no memory_limit_MB"),
    disk_mb: int = typer.Option(1024, help="disk (writable layer) of each run's sandbox"),
    job: str = typer.Option("sandbox-fusion", help="job the runs' sandboxes belong to (audit, quotas, listing)"),
    capacity_wait_s: float = typer.Option(120.0, help="how long a run waits for room, first come first served, before the gateway answers 429"),
    log_level: str = typer.Option("INFO"),
) -> None:
    logs.setup("gateway", log_level)
    cfg = RunnerConfig(image=image, toolchain_image=toolchain_image, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, job=job, capacity_wait_s=capacity_wait_s)
    run_until_signalled(lambda stop: serve(stop, config.nats_url(nats), host, port, cfg))


if __name__ == "__main__":
    app()
