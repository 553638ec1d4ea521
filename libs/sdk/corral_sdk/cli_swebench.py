"""CLI: `corral env import-swebench FILE --repo-dir DIR` (also `corral envs import-swebench`):
SWE-bench-format instances (JSONL) plus a local git repository -> environments, built and
verified by the env-builder. One row per instance: its environment, or why it was refused."""
from __future__ import annotations

import asyncio
import os
import sys

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from corral_common import config
from corral_common.contract.envs import EnvBuildResult
from corral_common.contract.errors import CorralError

from .swebench_import import ImportOutcome, read_instances


class ImportRow(msgspec.Struct, kw_only=True):
    line: int
    instance_id: str
    env: str = ""  # name:version when accepted
    accepted: bool = False
    error: str = ""  # the instance's problem, or the build's rejection summary


async def build_all(outcomes: list[ImportOutcome], nats: str | None, job: str, parallel: int,
                    console: Console) -> list[ImportRow]:
    from .client import AsyncClient

    sem = asyncio.Semaphore(parallel)
    client = await AsyncClient.connect(config.nats_url(nats))

    async def one(o: ImportOutcome) -> ImportRow:
        row = ImportRow(line=o.line, instance_id=o.instance_id, error=o.error)
        if o.spec is None:
            return row
        async with sem:
            with console.status(f"building {o.spec.name} ({o.instance_id})"):
                try:
                    res: EnvBuildResult = await client.envs.build(o.spec, job=job)
                except CorralError as e:
                    row.error = f"build: {e.code.value}: {e.message}"
                    return row
        row.accepted = res.accepted
        if res.env is not None:
            row.env = f"{res.env.name}:{res.env.version}"
        if not res.accepted:
            row.error = f"rejected: {res.report.summary()}"
        return row

    try:
        return list(await asyncio.gather(*(one(o) for o in outcomes)))
    finally:
        await client.close()


def register(env_app: typer.Typer) -> None:
    @env_app.command("import-swebench")
    def import_swebench(
        file: str = typer.Argument(..., help="JSONL of SWE-bench instances (instance_id, repo, base_commit, patch, test_patch, "
                                             "FAIL_TO_PASS, PASS_TO_PASS; optional pre_install, install, test_cmd)"),
        repo_dir: str = typer.Option(..., help="the git repository (or a directory of clones named owner__name or name)"),
        prefix: str = typer.Option("", help="put before every environment name"),
        job: str = typer.Option("", help="quotas and rate limits are per job"),
        parallel: int = typer.Option(2, min=1, help="builds at once"),
        out: str = typer.Option(None, help="also write each EnvSpec as NAME.json into this directory"),
        build: bool = typer.Option(True, help="build and verify (--no-build: only check the instances and write --out)"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON row per instance instead of a table"),
        nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL)"),
    ) -> None:
        """Import SWE-bench-format instances as environments; exit 0 only if every one was accepted."""
        console = Console(stderr=True)
        try:
            with open(file) as f:
                outcomes = read_instances(f, os.path.abspath(repo_dir), prefix=prefix)
        except (OSError, CorralError) as e:
            console.print(f"[red]{e}[/red]")
            raise typer.Exit(2) from None
        if out:
            os.makedirs(out, exist_ok=True)
            for o in outcomes:
                if o.spec is not None:
                    with open(os.path.join(out, f"{o.spec.name}.json"), "wb") as f:
                        f.write(msgspec.json.format(msgspec.json.encode(o.spec), indent=2))
        if build:
            try:
                rows = asyncio.run(build_all(outcomes, nats, job, parallel, console))
            except CorralError as e:
                console.print(f"[red]{e.code.value}[/red]: {e.message}")
                raise typer.Exit(2) from None
        else:
            rows = [ImportRow(line=o.line, instance_id=o.instance_id, error=o.error, accepted=o.spec is not None,
                              env=o.spec.name if o.spec else "") for o in outcomes]
        if as_json:
            for r in rows:
                sys.stdout.write(msgspec.json.encode(r).decode() + "\n")
        else:
            t = Table("line", "instance", "environment", "result", title=f"{file}: {sum(r.accepted for r in rows)}/{len(rows)} imported")
            for r in rows:
                t.add_row(str(r.line), r.instance_id or "-", r.env or "-",
                          "[green]accepted[/green]" if r.accepted else f"[red]{r.error[:160]}[/red]")
            Console().print(t)
        raise typer.Exit(0 if rows and all(r.accepted for r in rows) else 1)
