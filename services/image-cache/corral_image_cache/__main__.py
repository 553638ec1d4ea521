"""`python -m corral_image_cache`: the image registry service (`corral image-cache`)."""
from __future__ import annotations

import os

import typer

from corral_common import config, logs
from corral_common.lifecycle import run_until_signalled

from .service import ImageCache, ImageCacheConfig

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    image_dir: str = typer.Option(None, help="where built-in rootfs trees are built and cached (default $CORRAL_IMAGE_DIR or /var/lib/corral/images)"),
    chunk_backend: str = typer.Option("nats", help="'nats' (JetStream object store) or dir:///path"),
    builtin: list[str] = typer.Option(["busybox", "debian"], help="built-in images to import at start (debian only if already built)"),
    work_dir: str = typer.Option(None, help="scratch space for unpacking and mkfs.erofs"),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    snapshot_grace_s: float = typer.Option(120.0, help="unused snapshot layers younger than this survive a delete's collection"),
    gc_every_s: float = typer.Option(60.0, help="period of the background garbage collection"),
    log_level: str = typer.Option("INFO"),
) -> None:
    logs.setup("image-cache", log_level)
    cfg = ImageCacheConfig(nats_url=config.nats_url(nats), image_dir=image_dir or os.environ.get("CORRAL_IMAGE_DIR") or "/var/lib/corral/images",
                           chunk_backend=chunk_backend, builtins=builtin, work_dir=work_dir, metrics_host=metrics_host, metrics_port=metrics_port,
                           snapshot_grace_s=snapshot_grace_s, gc_every_s=gc_every_s)

    run_until_signalled(lambda stop: ImageCache(cfg).run(stop))  # built inside the loop


if __name__ == "__main__":
    app()
