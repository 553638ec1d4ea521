"""`corral tenant add|list|revoke`: the tenants of the stack `corral up` runs with a data dir.

A tenant is an identity on the bus (a NATS account of its own) that reaches only the public
request subjects and sees only its own sandboxes, trajectories and grades; see stackauth.py."""
from __future__ import annotations

import typer
from rich.console import Console

from corral_common import auth, config
from corral_common.contract.errors import CorralError

from . import deployauth, stackauth

console = Console(stderr=True)
tenant_app = typer.Typer(no_args_is_help=True, help="add, list and revoke the tenants of a local stack")
DATA_DIR = typer.Option(None, "--data-dir", help="the stack's data dir (default $CORRAL_STATE_DIR or /var/lib/corral)")


def _fail(e: CorralError) -> None:
    console.print(f"[red]{e.code}:[/red] {e}")
    raise typer.Exit(1)


@tenant_app.command("add")
def add(name: str, data_dir: str = DATA_DIR) -> None:
    """Create tenant NAME; prints the path of its credentials file (give it to the tenant, who sets
    $CORRAL_NATS_CREDS to it or passes it to the SDK as `creds=`)."""
    try:
        path = stackauth.add_tenant(config.state_dir(data_dir), name)
    except CorralError as e:
        _fail(e)
    console.print(f"tenant {name} added; connect with {auth.CREDS_ENV}={path}")
    print(path)


@tenant_app.command("list")
def list_(data_dir: str = DATA_DIR) -> None:
    """The tenants, one per line."""
    for name in sorted(stackauth.tenants(config.state_dir(data_dir))):
        print(name)


@tenant_app.command("revoke")
def revoke(name: str, data_dir: str = DATA_DIR) -> None:
    """Remove tenant NAME: its credentials stop working and its connections are closed."""
    try:
        stackauth.revoke_tenant(config.state_dir(data_dir), name)
    except CorralError as e:
        _fail(e)
    console.print(f"tenant {name} revoked")


def deploy_auth(out: str = typer.Argument(..., help="directory to write into (created, mode 0700)"),
                tenant: list[str] = typer.Option([], "--tenant", help="a tenant to add (repeat)"),
                route: list[str] = typer.Option([], "--route", help="host:port of a server's route listener (repeat, every server)"),
                k8s: bool = typer.Option(False, "--k8s", help="also write secrets.json: the Kubernetes Secrets")) -> None:
    """Bus credentials and nats-server authorization for a deployment (deploy/): nkeys for corral's
    identities, passwords for tenants and the gateway, authenticated routes. Keys already in OUT
    are kept; reload the servers after adding a tenant."""
    try:
        files = deployauth.render(out, tenant, route, k8s)
    except CorralError as e:
        _fail(e)
    for f in files:
        print(f)


def register(app: typer.Typer) -> None:
    app.add_typer(tenant_app, name="tenant")
    app.command("deploy-auth")(deploy_auth)
