"""CLI for substrates and Docker interop:

    corral run 'CMD' [--image busybox] [--substrate function] [--cpu ...]   one-shot, exits with the command's code
    corral image export NAME --docker [--tag REPO:TAG]                      a corral image as a Docker image
    corral image import-docker IMAGE [--name NAME]                          a local Docker image into corral

`register(app, image_app)` adds them to the `corral` CLI (cli.py calls it, like cli_monitor);
`python -m corral_sdk.cli_substrates ...` runs them on their own."""
from __future__ import annotations

import asyncio
import sys
from typing import NoReturn

import typer
from rich.console import Console

from corral_common import config
from corral_common.contract.errors import CorralError
from corral_common.contract.messages import ExecResult

console = Console(stderr=True)


def _fail(e: Exception | str, code: int = 1) -> NoReturn:
    console.print(f"[red]{e}[/red]")
    raise typer.Exit(code) from None


def register(app: typer.Typer, image_app: typer.Typer) -> None:
    @app.command("run")
    def run(cmd: str, image: str = typer.Option("busybox"), substrate: str = typer.Option("function"),
            cpu: float = typer.Option(1.0), memory_mb: int = typer.Option(512), timeout_s: float = typer.Option(60.0),
            nats: str = typer.Option(None, help="NATS URL (default $CORRAL_NATS_URL)")) -> None:
        """Run one command in a fresh sandbox that is gone afterwards (substrate `function` by default)."""
        from .client import AsyncClient

        async def go() -> ExecResult:
            c = await AsyncClient.connect(config.nats_url(nats))
            try:
                return await c.run(cmd, image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb, timeout_s=timeout_s)
            finally:
                await c.close()

        try:
            r = asyncio.run(go())
        except CorralError as e:
            _fail(e, 2)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        raise typer.Exit(r.exit_code)

    @image_app.command("export")
    def export(name: str, docker: bool = typer.Option(False, "--docker", help="export to the local Docker Engine"),
               tag: str = typer.Option(None, help="Docker image reference (default corral-image/NAME:<layers>)"),
               nats: str = typer.Option(None)) -> None:
        """Export a corral image (root: its layers are mounted here). Only `--docker` for now."""
        if not docker:
            _fail("say where to: --docker (the only export target so far)", 2)
        from .dockerio import export_image

        try:
            with console.status(f"exporting {name} to Docker"):
                ref = asyncio.run(export_image(config.nats_url(nats), name, tag))
        except CorralError as e:
            _fail(e)
        print(ref)

    @image_app.command("import-docker")
    def import_docker(image: str, name: str = typer.Option(None, help="corral image name (default from the Docker reference)"),
                      nats: str = typer.Option(None)) -> None:
        """`docker save IMAGE` and import it into corral's image-cache (one layer per Docker layer)."""
        from .dockerio import import_docker_image

        try:
            with console.status(f"importing Docker image {image}"):
                img = asyncio.run(import_docker_image(config.nats_url(nats), image, name))
        except CorralError as e:
            _fail(e)
        console.print(f"{img.name}: {len(img.layers)} layer(s), {img.size / 2**20:.1f} MiB")
        print(img.name)


def main() -> None:
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    image_app = typer.Typer(no_args_is_help=True)
    app.add_typer(image_app, name="image")
    register(app, image_app)
    app()


if __name__ == "__main__":
    main()
