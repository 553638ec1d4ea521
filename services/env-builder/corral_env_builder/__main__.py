"""`python -m corral_env_builder`: run one env-builder replica."""
from __future__ import annotations

import os

import typer

from corral_common import auth, config, logs
from corral_common.lifecycle import run_until_signalled

from .service import EnvBuilder, EnvBuilderConfig

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    parallel_builds: int = typer.Option(2, help="builds running at once; more wait in the backlog"),
    files_root: list[str] = typer.Option([], help="directories an EnvSpec's files_dir may be under (default: none)"),
    per_job_concurrent: int = typer.Option(2, help="builds one job may have running"),
    per_job_per_minute: float = typer.Option(30.0, help="builds one job may start per minute (token bucket)"),
    max_backlog: int = typer.Option(64, help="builds in flight (running + waiting) before new ones are refused"),
    log_level: str = typer.Option("INFO"),
) -> None:
    logs.setup("env-builder", log_level)
    cfg = EnvBuilderConfig(nats_url=config.nats_url(nats), metrics_host=metrics_host, metrics_port=metrics_port,
                           parallel_builds=parallel_builds, files_roots=list(files_root), per_job_concurrent=per_job_concurrent,
                           per_job_per_minute=per_job_per_minute, max_backlog=max_backlog,
                           catalog_creds=os.environ.get(auth.CATALOG_CREDS_ENV, ""))

    run_until_signalled(lambda stop: EnvBuilder(cfg).run(stop))  # built inside the loop


if __name__ == "__main__":
    app()
