"""`python -m corral_node_agent`: run one node-agent (the CLI's `corral node-agent` execs this)."""
from __future__ import annotations

import typer

from corral_common import config, logs
from corral_common.lifecycle import run_until_signalled

from .agent import AgentConfig, NodeAgent
from .warmpool import PoolConfig, parse_pools

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL or nats://127.0.0.1:4222)"),
    node: str = typer.Option(None, help="node id (default $CORRAL_NODE or the host name)"),
    state_dir: str = typer.Option(None, help="state directory (default $CORRAL_STATE_DIR or /var/lib/corral)"),
    substrate: list[str] = typer.Option(["container"], help="substrates to enable"),
    cpu: float = typer.Option(0.0, help="CPU cores to offer (0: the machine's cores)"),
    cpu_overcommit: float = typer.Option(config.env_float("CORRAL_CPU_OVERCOMMIT", 8.0),
                                         help="the most CPU requests may add up to, as a multiple of --cpu"),
    memory_mb: int = typer.Option(0, help="schedulable memory in MiB (0: 90% of RAM)"),
    max_sandboxes: int = typer.Option(4096),
    heartbeat_s: float = typer.Option(1.0),
    metrics_host: str = typer.Option("127.0.0.1", envvar="CORRAL_METRICS_HOST", help="address the metrics listen on (0.0.0.0 in a pod)"),
    metrics_port: int = typer.Option(config.env_int("CORRAL_METRICS_PORT", 0)),
    keep_sandboxes_on_exit: bool = typer.Option(False, help="leave sandboxes running on SIGTERM (adopted on restart)"),
    loader_wait_s: float = typer.Option(60.0, help="how long to wait for the node's image loader at start"),
    usage_top: int = typer.Option(256, help="sandboxes listed one by one in heartbeats (busiest first; all count in the totals)"),
    warm_pool: list[str] = typer.Option([], help="keep [SUBSTRATE:]IMAGE=COUNT paused sandboxes ready (repeatable; container unless named, e.g. microvm:busybox=2); creates claim them"),
    warm_pool_learn: bool = typer.Option(False, help="also give warm pools to images created often recently, sized by their create rate"),
    warm_pool_max: int = typer.Option(8, help="most warm sandboxes per image"),
    warm_pool_total: int = typer.Option(32, help="most warm sandboxes on the node"),
    warm_pool_idle_s: float = typer.Option(60.0, help="an image not created for this long shrinks back to its configured pool"),
    no_audit: bool = typer.Option(False, "--no-audit", help="publish no audit events (to measure what auditing costs); "
                                  "protected paths stay enforced"),
    file_events_rate: float = typer.Option(2000.0, help="file-activity audit events per second per sandbox, beyond the burst"),
    file_events_burst: float = typer.Option(10000.0, help="file-activity audit events a sandbox may burst before the rate applies"),
    log_level: str = typer.Option("INFO"),
) -> None:
    node = config.node_id(node)
    sdir = config.state_dir(state_dir)
    logs.setup("node-agent", log_level, node=node)
    cfg = AgentConfig(
        nats_url=config.nats_url(nats), node=node, state_dir=sdir,
        substrates=substrate, cpu=cpu, cpu_overcommit=cpu_overcommit, memory_mb=memory_mb, max_sandboxes=max_sandboxes,
        heartbeat_s=heartbeat_s, metrics_host=metrics_host, metrics_port=metrics_port,
        keep_sandboxes_on_exit=keep_sandboxes_on_exit, loader_wait_s=loader_wait_s,
        usage_top=usage_top,
        warm_pool=PoolConfig(configured=parse_pools(warm_pool), learn=warm_pool_learn, max_per_image=warm_pool_max,
                             max_total=warm_pool_total, idle_s=warm_pool_idle_s, window_s=max(warm_pool_idle_s, 1.0)),
        audit=not no_audit,
        file_events_rate=file_events_rate, file_events_burst=file_events_burst,
    )

    run_until_signalled(lambda stop: NodeAgent(cfg).run(stop))  # built inside the loop


if __name__ == "__main__":
    app()
