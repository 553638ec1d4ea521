"""CLI: `corral eval ENV --policy module:function --rollouts N --concurrency C [--json F --png F]`,
against a running stack (`corral up`, or $CORRAL_NATS_URL)."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from corral_common import config
from corral_common.contract.errors import CorralError

from .client import AsyncClient
from .eval import EvalReport, NamedPolicy, RolloutResult, evaluate, load_policy
from .eval_report import print_report, write_json, write_png


async def run_with_progress(client: AsyncClient, env: str, policies: Sequence[NamedPolicy], rollouts: int, concurrency: int,
                            console: Console, *, version: str = "", job: str = "eval", fail_on: str = "high",
                            substrate: str = "") -> EvalReport:
    """`evaluate` behind a rich progress bar that shows the running mean reward and alert count."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                        TimeElapsedColumn(), console=console)
    done: list[RolloutResult] = []

    def on_done(row: RolloutResult) -> None:
        done.append(row)
        graded = [r for r in done if r.reward is not None]
        mean = sum(r.reward or 0 for r in graded) / max(1, len(graded))
        progress.update(task, advance=1, stats=f"mean reward {mean:.2f}, flagged {sum(bool(r.alerts) for r in done)}, "
                                               f"errors {len(done) - len(graded)}")

    with progress:
        task = progress.add_task(f"{env}: rollouts ({concurrency} at once)", total=rollouts, stats="")
        return await evaluate(client, env, policies, rollouts, concurrency, version=version, job=job, fail_on=fail_on,
                              on_done=on_done, substrate=substrate)


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        env: str = typer.Argument(..., help="environment NAME or NAME:VERSION (see `corral env ls`)"),
        policy: str = typer.Option(..., help="module:function, an async (sandbox, task) -> None"),
        rollouts: int = typer.Option(10, min=1),
        concurrency: int = typer.Option(4, min=1),
        json_path: str = typer.Option(None, "--json", help="write the full report (every rollout, test and alert) here"),
        png: str = typer.Option(None, "--png", help="write a plot of rewards, tests and timings here"),
        job: str = typer.Option("eval", help="quotas and rate limits are per job"),
        fail_on: str = typer.Option("high", help="alerts at or above this severity zero the reward"),
        substrate: str = typer.Option("", help="where the rollouts run (container, gvisor, docker, microvm, vm; default container); "
                                                "one that cannot enforce the environment's canaries and protected paths refuses them"),
        nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL)"),
    ) -> None:
        """Run a policy on an environment N times, C at once, and grade every rollout."""
        name, _, version = env.partition(":")
        console = Console()
        try:
            pol = load_policy(policy)
        except CorralError as e:
            console.print(f"[red]{e.code.value}[/red]: {e.message}")
            raise typer.Exit(2) from None

        async def go() -> EvalReport:
            client = await AsyncClient.connect(config.nats_url(nats))
            try:
                return await run_with_progress(client, name, [pol], rollouts, concurrency, console, version=version, job=job,
                                               fail_on=fail_on, substrate=substrate)
            finally:
                await client.close()

        try:
            rep = asyncio.run(go())
        except CorralError as e:
            console.print(f"[red]{e.code.value}[/red]: {e.message}")
            raise typer.Exit(2) from None
        print_report(rep, console)
        if json_path:
            write_json(rep, json_path)
            console.print(f"report: {json_path}")
        if png:
            write_png(rep, png)
            console.print(f"plot: {png}")
        raise typer.Exit(1 if rep.summary.errors or rep.summary.left_behind else 0)
