"""`python -m corral_image_cache.loader`: run the lazy loader of one node."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import traceback

import typer

from corral_common import config, logs
from corral_common.contract import subjects

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    node: str = typer.Option(..., help=f"node name: serves {subjects.node_loader('<node>', '*')}"),
    mount: str = typer.Option(..., help="FUSE mount point presenting <mount>/<layer digest>"),
    cache_dir: str = typer.Option(..., help="node cache: per layer a sparse data file and a chunk bitmap"),
    cache_max_mb: int = typer.Option(0, help="cache size cap; unused layers are evicted LRU (0: no cap)"),
    fetch_parallel: int = typer.Option(8, help="concurrent chunk fetches"),
    chunk_backend: str = typer.Option("nats", help="'nats' (JetStream object store) or dir:///path"),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    trace_window_s: float = typer.Option(10.0, help="how long a first start's reads are recorded as its prefetch trace"),
    fetch_timeout_s: float = typer.Option(10.0, help="timeout of one fetch attempt"),
    fetch_retries: int = typer.Option(2, help="retries after a failed or timed-out fetch (not after not-found)"),
    read_timeout_s: float = typer.Option(60.0, help="a FUSE read waiting longer than this for its chunks gets EIO"),
    background_fill_after_s: float = typer.Option(0.0, help="fetch the rest of in-use layers after this many quiet seconds (0: off)"),
    shutdown_grace_s: float = typer.Option(5.0, help="on stop, how long to keep serving mounts that still use the FUSE mount"),
    auto_unmount: bool = typer.Option(True, help="let fusermount3 unmount the FUSE mount if the loader dies"),
    readahead_chunks: int = typer.Option(2, help="chunks fetched ahead of a sequential reader (0: off)"),
    fuse_threads: int = typer.Option(64, help="libfuse worker threads, also the kernel's limit of background FUSE requests"),
    log_level: str = typer.Option("INFO"),
) -> None:
    node = config.node_id(node)  # spelled as its node-agent spells it
    logs.setup("loader", log_level, node=node)
    from .service import Loader, LoaderConfig

    cfg = LoaderConfig(nats_url=config.nats_url(nats), node=node, mount=mount, cache_dir=cache_dir, cache_max_mb=cache_max_mb,
                       fetch_parallel=fetch_parallel, chunk_backend=chunk_backend, metrics_host=metrics_host,
                       metrics_port=metrics_port, trace_window_s=trace_window_s, fetch_timeout_s=fetch_timeout_s,
                       fetch_retries=fetch_retries, read_timeout_s=read_timeout_s,
                       background_fill_after_s=background_fill_after_s, shutdown_grace_s=shutdown_grace_s,
                       auto_unmount=auto_unmount, fuse_threads=fuse_threads,
                       readahead_chunks=readahead_chunks)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # installed before libfuse starts, so libfuse leaves these signals to us
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(s, stop.set)
        await Loader(cfg).run(stop)

    code = 0
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(run())
    except Exception as e:
        from corral_common.contract.errors import CorralError

        code = 1
        if isinstance(e, CorralError):
            print(f"loader: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
    finally:
        # a chunk backend stuck in a system call (a hung network filesystem under dir://) holds a
        # worker thread that Python would wait for at exit; the loader has cleaned up by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    app()
