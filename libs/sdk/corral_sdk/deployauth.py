"""Bus credentials and nats-server authorization for a deployment (deploy/), made by
`corral deploy-auth DIR`.

The accounts, users and permissions are the embedded stack's (stackauth.accounts): the CORRAL
account with one identity per service and the operator (`admin`), TENANTS with the gateway and a
user per tenant. What differs is how they authenticate: corral's own identities with nkeys (an
ed25519 key pair each; the server's configuration holds only the public keys, each service its
own seed, `<identity>.nk`), tenants and the gateway with generated passwords (`<name>.creds`),
because a tenant is named to the services by the `user` of the server-set request info. The
routes between the servers authenticate with their own secret.

Files written into DIR (mode 0600; keys and passwords already there are kept, so running it again,
e.g. with one more `--tenant`, changes nothing else; reload the servers after):
  accounts.conf  `accounts { ... }`, included by every server's nats.conf
  cluster.conf   `cluster { ... }` with the routes (`--route host:port`, each server's), authenticated
  <identity>.nk  nkey seeds of admin, every service, and env-catalog (the env-builder's second
                 identity, alone in the catalog's account: CORRAL_CATALOG_CREDS)
  <name>.creds   `name:password` of the gateway and of each tenant
  secrets.json   with `--k8s`: a List (kubectl apply -f) of the Secret `corral-nats-auth` (the two
                 .conf files, for the NATS pods) and one Secret `corral-nats-creds-<identity>` per
                 identity (key `creds`)
"""
from __future__ import annotations

import base64
import json
import os
import secrets
from typing import Any

import nkeys  # type: ignore[import-untyped]  # (no type information shipped)

from corral_common import tenancy
from corral_common.contract.errors import InvalidRequest

from .stackauth import CATALOG, CLUSTER, EDGE, OPERATOR, ROUTE_USER, SERVICES, accounts
from .stackauth import write_private as _write

NKEY_IDENTITIES = (OPERATOR, *SERVICES, CATALOG)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def user_seed(out: str, identity: str) -> str:
    """The identity's nkey seed (SU...), made on first use."""
    path = os.path.join(out, f"{identity}.nk")
    seed = _read(path)
    if not seed:
        seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode()
        _write(path, seed + "\n")
    return seed


def public_key(seed: str) -> str:
    key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return key.decode()


def password(out: str, name: str) -> str:
    path = os.path.join(out, f"{name}.creds")
    user, _, pw = _read(path).partition(":")
    if user != name or not pw:
        pw = secrets.token_urlsafe(24)
        _write(path, f"{name}:{pw}\n")
    return pw


def render(out: str, tenants: list[str] | tuple[str, ...] = (), routes: list[str] | tuple[str, ...] = (),
           k8s: bool = False) -> list[str]:
    """Write the deployment's credentials and server authorization into `out`; returns the files."""
    for name in tenants:
        if name in (EDGE, *NKEY_IDENTITIES) or not tenancy.NAME.match(name):
            raise InvalidRequest(f"invalid tenant name {name!r}: lowercase letters, digits and '-', starting with a "
                                 f"letter, at most 32, and not one of corral's own identities")
    os.makedirs(out, mode=0o700, exist_ok=True)
    os.chmod(out, 0o700)
    seeds = {identity: user_seed(out, identity) for identity in NKEY_IDENTITIES}
    users = {identity: {"nkey": public_key(seed)} for identity, seed in seeds.items()}
    tenant_pw = {name: password(out, name) for name in (EDGE, *tenants)}
    files = [os.path.join(out, f"{i}.nk") for i in NKEY_IDENTITIES] + [os.path.join(out, f"{n}.creds") for n in tenant_pw]
    conf = os.path.join(out, "accounts.conf")
    _write(conf, f"accounts: {json.dumps(accounts(users, tenant_pw), indent=1)}\n")
    files.append(conf)
    route_secret = _read(os.path.join(out, "route.secret"))
    if not route_secret:
        route_secret = secrets.token_urlsafe(24)
        _write(os.path.join(out, "route.secret"), route_secret + "\n")
    cluster = os.path.join(out, "cluster.conf")
    block = {"name": CLUSTER, "listen": "0.0.0.0:6222", "no_advertise": True,
             "routes": [f"nats://{ROUTE_USER}:{route_secret}@{r}" for r in routes],
             "authorization": {"user": ROUTE_USER, "password": route_secret}}
    _write(cluster, f"cluster {json.dumps(block, indent=1)}\n")
    files.append(cluster)
    if k8s:
        path = os.path.join(out, "secrets.json")
        _write(path, k8s_secrets(out, [*NKEY_IDENTITIES, *tenant_pw]))
        files.append(path)
    return files


def k8s_secrets(out: str, identities: list[str]) -> str:
    def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "corral"}},
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}

    docs = [secret("corral-nats-auth", {f: _read(os.path.join(out, f)) + "\n" for f in ("accounts.conf", "cluster.conf")})]
    for identity in identities:
        ext = "nk" if identity in NKEY_IDENTITIES else "creds"
        docs.append(secret(f"corral-nats-creds-{identity}", {"creds": _read(os.path.join(out, f"{identity}.{ext}")) + "\n"}))
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=1) + "\n"
