"""CLI for environments (`corral.v1.env.*`):

    corral env build SPEC [--job J] [--json]   SPEC: .json, .toml or .yaml EnvSpec; progress while it builds
    corral env ls [--prefix P] [--json]
    corral env show NAME[:VERSION] [--json]
    corral env grade SANDBOX [--destroy] [--fail-on high]
    corral env rm NAME[:VERSION]
    corral env import-swebench FILE --repo-dir DIR   SWE-bench instances -> environments (cli_swebench.py)
    corral env-builder ...                     run the service (python -m corral_env_builder)

A spec's `files_dir`, when relative, is read here (relative to the spec file) and sent inline, so
a local directory works without giving the env-builder access to this machine's files."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tomllib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral_common import config
from corral_common.contract.envs import EnvBuildResult, EnvSpec
from corral_common.contract.errors import CorralError, InvalidRequest

if TYPE_CHECKING:
    from .client import AsyncClient

T = TypeVar("T")

console = Console(stderr=True)
env_app = typer.Typer(no_args_is_help=True, help="build, list, show, grade and remove environments")


def _fail(e: Exception, code: int = 1) -> NoReturn:
    console.print(f"[red]{e}[/red]")
    raise typer.Exit(code) from None


def load_spec(path: str) -> EnvSpec:
    """Read an EnvSpec file; inline a relative `files_dir` (read on this machine)."""
    with open(path, "rb") as f:
        raw = f.read()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".toml":
        data: Any = tomllib.loads(raw.decode())
    elif ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise InvalidRequest("YAML specs need PyYAML (pip install pyyaml); JSON and TOML work without it") from None
        data = yaml.safe_load(raw)
    else:
        data = json.loads(raw)
    if not isinstance(data, dict):
        raise InvalidRequest(f"{path}: an EnvSpec must be a mapping")
    fd = data.get("files_dir", "")
    if fd and not os.path.isabs(fd):
        root = os.path.join(os.path.dirname(os.path.abspath(path)), fd)
        if not os.path.isdir(root):
            raise InvalidRequest(f"{path}: files_dir {fd!r} is not a directory next to the spec")
        files = dict(data.get("files") or {})
        for d, _, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                with open(p, "rb") as f:
                    try:
                        files.setdefault(os.path.relpath(p, root), f.read().decode())
                    except UnicodeDecodeError:
                        raise InvalidRequest(f"{p}: only text files can be sent inline") from None
        data["files"], data["files_dir"] = files, ""
    try:
        return msgspec.convert(data, type=EnvSpec)
    except msgspec.ValidationError as e:
        raise InvalidRequest(f"{path}: {e}") from None


def _ref(ref: str) -> tuple[str, str]:
    name, _, version = ref.partition(":")
    return name, version


def _run(fn: Callable[[AsyncClient], Awaitable[T]], nats: str | None) -> T:
    from .client import AsyncClient

    async def go() -> T:
        c = await AsyncClient.connect(config.nats_url(nats))
        try:
            return await fn(c)
        finally:
            await c.close()

    try:
        return asyncio.run(go())
    except CorralError as e:
        _fail(e, 2)


def _json(obj: Any) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")


@env_app.command("build")
def build(spec_file: str, job: str = typer.Option("", help="quotas and rate limits are per job"),
          as_json: bool = typer.Option(False, "--json"), nats: str = typer.Option(None)) -> None:
    """Build and verify an environment; exit 0 if it was accepted into the catalog, 1 if rejected."""
    try:
        spec = load_spec(spec_file)
    except (OSError, ValueError, CorralError) as e:
        _fail(e, 2)

    async def go(c: AsyncClient) -> EnvBuildResult:
        progress = Progress(TextColumn(f"build {spec.name}"), BarColumn(), TextColumn("{task.fields[stage]}"), TimeElapsedColumn(),
                            console=console)
        with progress:
            t = progress.add_task("build", total=1.0, stage="submitted")
            return await c.envs.build(spec, job=job, progress=lambda e: progress.update(
                t, completed=e.fraction, stage=f"{e.stage}: {e.message[:70]}"))

    res = _run(go, nats)
    if as_json:
        _json(res)
    else:
        t = Table("check", "result", "detail", "s", title=f"{spec.name}: {'accepted' if res.accepted else 'REJECTED'}")
        for ch in res.report.checks:
            t.add_row(ch.name, "[green]pass[/green]" if ch.ok else "[red]FAIL[/red]", ch.detail, f"{ch.seconds:.2f}")
        console.print(t)
        for ch in res.report.failed():
            if ch.evidence:
                console.print(f"[bold]{ch.name}[/bold] evidence:\n{ch.evidence}")
        if res.env:
            print(f"{res.env.name}:{res.env.version} {res.env.image}")
    raise typer.Exit(0 if res.accepted else 1)


@env_app.command("ls")
def ls(prefix: str = typer.Option(""), as_json: bool = typer.Option(False, "--json"), nats: str = typer.Option(None)) -> None:
    """Environments in the catalog (every accepted version)."""
    envs = _run(lambda c: c.envs.list(prefix), nats)
    if as_json:
        _json(envs)
        return
    t = Table("name", "version", "image", "workdir", "build s", "job", "description")
    for e in envs:
        t.add_row(e.name, e.version, e.image, e.workdir, f"{e.build_seconds:.1f}", e.job, e.description[:50])
    Console().print(t)


@env_app.command("show")
def show(ref: str, as_json: bool = typer.Option(False, "--json"), nats: str = typer.Option(None)) -> None:
    """One environment (NAME or NAME:VERSION); protected files are shown as path, size and sha256."""
    name, version = _ref(ref)
    env = _run(lambda c: c.envs.get(name, version), nats)
    if as_json:
        _json(env)
        return
    out = Console()
    out.print(f"[bold]{env.name}:{env.version}[/bold]  image {env.image}  workdir {env.workdir}")
    out.print(f"test command: {env.test_command}  (timeout {env.test_timeout_s:g}s)")
    lim = env.limits
    out.print(f"rollout limits: cpu {lim.cpu:g}, memory {lim.memory_mb} MB, disk {lim.disk_mb} MB, pids {lim.pids_max}, ttl {lim.ttl_s:g}s")
    t = Table("protected path", "bytes", "sha256")
    for p in env.protected:
        t.add_row(p.path, str(p.size), p.sha256[:16])
    out.print(t)
    if env.canaries:
        out.print("canaries: " + ", ".join(env.canaries))
    if env.report:
        out.print("checks: " + ", ".join(f"{c.name} {'ok' if c.ok else 'FAIL'}" for c in env.report.checks))


@env_app.command("grade")
def grade(sandbox_id: str, destroy: bool = typer.Option(False, "--destroy"), fail_on: str = typer.Option("high"),
          as_json: bool = typer.Option(False, "--json"), nats: str = typer.Option(None)) -> None:
    """Grade a rollout sandbox with its environment's hidden tests and the monitor's alerts."""
    g = _run(lambda c: c.envs.grade(sandbox_id, destroy=destroy, fail_on=fail_on), nats)
    if as_json:
        _json(g)
    else:
        console.print(f"reward {g.reward:g}: {g.reason}")
        for a in g.alerts:
            console.print(f"  alert {a.rule} ({a.severity}): {a.message[:120]}")
        print(g.reward)


@env_app.command("rm")
def rm(ref: str, nats: str = typer.Option(None)) -> None:
    """Remove an environment version (NAME:VERSION, or NAME for the latest) and its image."""
    name, version = _ref(ref)
    _run(lambda c: c.envs.delete(name, version), nats)
    print(ref)


def register(app: typer.Typer, passthrough: dict[str, object]) -> None:
    from .cli_swebench import register as register_swebench

    register_swebench(env_app)
    app.add_typer(env_app, name="env")
    app.add_typer(env_app, name="envs", hidden=True)  # `corral envs ...` as the issue and some habits spell it

    @app.command("env-builder", context_settings=passthrough)
    def env_builder(ctx: typer.Context) -> None:
        """Run the env-builder service (python -m corral_env_builder)."""
        os.execv(sys.executable, [sys.executable, "-m", "corral_env_builder", *ctx.args])
