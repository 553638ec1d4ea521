"""`python -m corral_scheduler`: run one scheduler replica."""
from __future__ import annotations

import typer

from corral_common import config, logs
from corral_common.lifecycle import run_until_signalled

from .service import Scheduler, SchedulerConfig

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    node_timeout_s: float = typer.Option(30.0),
    stale_after_s: float = typer.Option(5.0, help="a node not heard from for this long is declared lost"),
    cpu_overcommit: float = typer.Option(config.env_float("CORRAL_CPU_OVERCOMMIT", 8.0),
                                         help="CPU requests may add up to this multiple of a node's cores"),
    hot_cpu: float = typer.Option(0.85, help="stop placing on a node whose observed CPU use exceeds this share of its cores"),
    log_level: str = typer.Option("INFO"),
) -> None:
    logs.setup("scheduler", log_level)
    cfg = SchedulerConfig(nats_url=config.nats_url(nats), metrics_host=metrics_host, metrics_port=metrics_port,
                          node_timeout_s=node_timeout_s, stale_after_s=stale_after_s, cpu_overcommit=cpu_overcommit, hot_cpu=hot_cpu)

    run_until_signalled(lambda stop: Scheduler(cfg).run(stop))  # built inside the loop


if __name__ == "__main__":
    app()
