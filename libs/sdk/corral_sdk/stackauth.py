"""Authentication and authorization of the embedded stack's NATS server (`corral up`).

Every connection authenticates; each service has its own identity (user) in the CORRAL account,
and the server, not the services, enforces what each may do. Identities and their passwords are
generated once per data dir (`<data>/auth/<identity>.creds`, mode 0600, reused on restart so
clients that hold them keep working); `admin` is the local operator's, which the SDK and CLI find
by themselves (corral_common.auth).

What the permissions take away, from the contract (contract/operations.py names each channel's
publisher and each bucket's writer):
  - the environment catalog (hidden tests and solutions) is readable and writable only by the
    env-builder (and the operator);
  - heartbeats (which decide where creates go) are published only by node-agents, audit only by
    node-agents and image loaders, alerts only by the monitor, and no service may delete or purge
    a stored message of the audit, alert or event streams;
  - the SandboxFusion gateway, the one service facing HTTP clients, is not a service of the CORRAL
    account at all but a user of the TENANTS account (below) that may only send sandbox requests:
    it reaches the sandboxes it made and nothing else.

Tenants (`corral tenant add|list|revoke`) are users of the TENANTS account, which imports the
public request subjects (`corral.v1.>`) from CORRAL and nothing else; each may publish requests
and subscribe to its own inboxes only: tenants cannot see each other's traffic, corral's internal
subjects, streams or buckets, and every request they make reaches the services with the
server-set `Nats-Request-Info` header that names them (corral_common.tenancy).
Adding or revoking one rewrites the server's configuration and reloads it (SIGHUP): a revoked
tenant's connections are closed at once.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
from dataclasses import asdict, dataclass
from typing import Any

from corral_common import auth, tenancy
from corral_common.contract import subjects
from corral_common.contract.errors import Conflict, InvalidRequest, NotFound
from corral_common.contract.operations import BUCKETS, CHANNELS

ACCOUNT = "CORRAL"
SERVICES = ("scheduler", "node-agent", "image-cache", "image-loader", "monitor", "env-builder")
EDGE = "gateway"  # a user of the TENANTS account, with tenant rights on its own sandboxes only
# the env-builder's catalog identity, alone in the account that holds the environment catalog
CATALOG = "env-catalog"
CATALOG_ACCOUNT = "CORRAL_CATALOG"
OPERATOR = "admin"
# the services that also publish a channel the contract gives to another (image loaders audit
# their own fetches under the node's audit subjects)
ALSO_PUBLISH = {"audit": ("image-loader",)}
PROTECTED_STREAMS = ("CORRAL_AUDIT", "CORRAL_ALERTS", "CORRAL_EVENTS")
SECRET_BUCKETS = (subjects.KV_ENVS,)
CLUSTER = "corral"  # the cluster name of a stack's nats-servers (`corral up --cluster N`)
ROUTE_USER = "route"  # what the servers of a cluster authenticate their routes to each other with


def _wild(subject: str) -> str:
    """A contract subject template ("corral.audit.{node}.{sandbox_id}") as a NATS wildcard."""
    return ".".join("*" if t.startswith("{") else t for t in subject.split("."))


def permissions(identity: str) -> dict[str, Any] | None:
    """The NATS permissions of a service identity (None: the operator, unrestricted)."""
    if identity == OPERATOR:
        return None
    pub_deny: list[str] = []
    sub_deny: list[str] = []
    for c in CHANNELS:
        if c.publisher != identity and identity not in ALSO_PUBLISH.get(c.name, ()):
            if c.name in ("nodeHeartbeat", "audit", "alerts"):
                pub_deny.append(_wild(c.subject))
    for b in BUCKETS:
        if b.name in SECRET_BUCKETS and b.writer != identity:
            pub_deny += subjects.kv_stream_access(b.name)
            sub_deny.append(subjects.kv_key(b.name, ">"))
    for stream in PROTECTED_STREAMS:
        pub_deny += subjects.stream_erasure(stream)
    return {"publish": {"deny": pub_deny}, "subscribe": {"deny": sub_deny}}


def ensure_credentials(data_dir: str) -> dict[str, str]:
    """identity -> password, generated on first use and kept in the data dir."""
    d = os.path.join(data_dir, auth.AUTH_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    out: dict[str, str] = {}
    for identity in (OPERATOR, *SERVICES, EDGE, CATALOG):
        path = auth.creds_path(identity, data_dir)
        try:
            with open(path) as f:
                user, _, password = f.read().strip().partition(":")
            if user == identity and password:
                out[identity] = password
                continue
        except FileNotFoundError:
            pass
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{identity}:{password}\n")
        out[identity] = password
    return out


def _auth_dir(data_dir: str) -> str:
    return os.path.join(data_dir, auth.AUTH_DIR)


def write_private(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def tenant_creds_path(data_dir: str, name: str) -> str:
    return os.path.join(_auth_dir(data_dir), "tenants", f"{name}.creds")


def tenants(data_dir: str) -> dict[str, str]:
    """tenant -> password."""
    try:
        with open(os.path.join(_auth_dir(data_dir), "tenants.json")) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {}


def _save_tenants(data_dir: str, table: dict[str, str]) -> None:
    write_private(os.path.join(_auth_dir(data_dir), "tenants.json"), json.dumps(table, indent=1, sort_keys=True))


@dataclass(frozen=True)
class Server:
    """One nats-server of the stack: its client listener, its JetStream store, and (in a
    cluster) its route listener, which peers reach with the cluster's own route credentials."""
    name: str
    listen: str
    store: str
    cluster: str = ""


def accounts(corral_users: dict[str, dict[str, Any]], tenant_passwords: dict[str, str]) -> dict[str, Any]:
    """The nats-server `accounts` block: CORRAL (JetStream; each identity's user, `corral_users`:
    identity -> its credentials, {"password": ...} or {"nkey": ...}, given its permissions here;
    the export of the public subjects and of the tenants' alert copies), TENANTS (a user per
    tenant, with a password, importing them; the gateway's among them, if in `tenant_passwords`
    or `corral_users`) and CORRAL_CATALOG (JetStream, the env-builder's catalog identity alone,
    exporting nothing: the hidden tests are in no account another identity is in, so none can
    read them, not even through a stream of its own sourcing the catalog's)."""
    def user(identity: str, cred: dict[str, Any]) -> dict[str, Any]:
        return {"user": identity, **cred} if "password" in cred else dict(cred)

    users = []
    for identity, cred in corral_users.items():
        if identity in (EDGE, CATALOG):
            continue
        entry = user(identity, cred)
        perms = permissions(identity)
        if perms is not None:
            entry["permissions"] = perms
        users.append(entry)
    # stream responses: exec with `stream` answers several messages to one request; the threshold
    # bounds how long a reply route stays open (the longest exec allowed, 24 h)
    public = f"{subjects.PREFIX}.>"
    def tenant(name: str, password: str, may_publish: str) -> dict[str, Any]:
        hears = [f"{tenancy.inbox_prefix(name)}.>", subjects.tenant_alerts(name)]
        return {"user": name, "password": password, "permissions": {
            "publish": {"allow": [may_publish]}, "subscribe": {"allow": hears}}}

    tenant_users = [tenant(name, password, public) for name, password in sorted(tenant_passwords.items()) if name != EDGE]
    edge = tenant_passwords.get(EDGE) or corral_users.get(EDGE, {}).get("password")
    if edge:
        tenant_users.append(tenant(EDGE, edge, f"{subjects.PREFIX}.sandbox.>"))
    catalog = [user(CATALOG, corral_users[CATALOG])] if CATALOG in corral_users else []
    return {
        CATALOG_ACCOUNT: {"jetstream": "enabled", "users": catalog},
        ACCOUNT: {"jetstream": "enabled", "users": users,
                  "exports": [{"service": public, "response_type": "stream", "response_threshold": "24h"},
                              {"stream": subjects.TENANT_ALERTS_ALL}]},
        # present from the start, even with no tenant: users added to it later by a reload work
        tenancy.ACCOUNT: {"users": tenant_users,
                          "imports": [{"service": {"account": ACCOUNT, "subject": public}, "share": True},
                                      {"stream": {"account": ACCOUNT, "subject": subjects.TENANT_ALERTS_ALL}}]},
    }


def server_config(server: Server, peers: list[Server], passwords: dict[str, str], tenant_passwords: dict[str, str],
                  pid_file: str, route_password: str = "") -> str:
    """nats-server configuration: the listener, 8 MB payloads (files.write and exec output travel
    base64/JSON-encoded in one message), JetStream, the CORRAL account with its users and its
    export of the public subjects, and one account per tenant importing them; in a cluster, the
    route listener and the routes to every peer (routes authenticate too: an unauthenticated
    route would be a way around every account permission)."""
    block = accounts({identity: {"password": password} for identity, password in passwords.items()}, tenant_passwords)
    text = (f"server_name: {json.dumps(server.name)}\nlisten: {json.dumps(server.listen)}\nmax_payload: 8MB\n"
            f"pid_file: {json.dumps(pid_file)}\njetstream {{ store_dir: {json.dumps(server.store)} }}\n")
    if server.cluster:
        routes = [f"nats://{ROUTE_USER}:{route_password}@{p.cluster}" for p in peers if p.name != server.name]
        text += "cluster " + json.dumps({"name": CLUSTER, "listen": server.cluster, "routes": routes,
                                         "authorization": {"user": ROUTE_USER, "password": route_password}}) + "\n"
    return text + f"accounts: {json.dumps(block, indent=1)}\n"


def _route_password(data_dir: str) -> str:
    path = os.path.join(_auth_dir(data_dir), "cluster.secret")
    try:
        with open(path) as f:
            if secret := f.read().strip():
                return secret
    except FileNotFoundError:
        pass
    secret = secrets.token_urlsafe(24)
    write_private(path, secret + "\n")
    return secret


def _saved_servers(data_dir: str) -> list[Server]:
    where = os.path.join(_auth_dir(data_dir), "server.json")
    try:
        with open(where) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise NotFound(f"no corral stack has run with data dir {data_dir} (its {where} is missing)") from None
    if "servers" not in saved:  # written by a single-server stack before clusters
        return [Server("corral-1", saved["listen"], saved["store"])]
    return [Server(**s) for s in saved["servers"]]


def _conf_name(server: Server, n: int, ext: str) -> str:
    return f"nats.{ext}" if n == 1 else f"{server.name}.{ext}"


def write_server_config(data_dir: str, servers: list[Server] | None = None) -> list[str]:
    """(Re)write each server's configuration (`<data>/auth/nats.conf`, or `<name>.conf` per server
    of a cluster) from the identities and tenants on record; the servers are remembered from the
    first write. Returns the paths, in the servers' order."""
    d = _auth_dir(data_dir)
    if servers is None:
        servers = _saved_servers(data_dir)
    else:
        write_private(os.path.join(d, "server.json"), json.dumps({"servers": [asdict(s) for s in servers]}))
    passwords, table = ensure_credentials(data_dir), tenants(data_dir)
    route_password = _route_password(data_dir) if len(servers) > 1 else ""
    paths = []
    for server in servers:
        conf = os.path.join(d, _conf_name(server, len(servers), "conf"))
        write_private(conf, server_config(server, servers, passwords, table, os.path.join(d, _conf_name(server, len(servers), "pid")),
                                           route_password))
        paths.append(conf)
    return paths


def reload(data_dir: str) -> bool:
    """Have every running server of the stack take its configuration again (SIGHUP); False if
    none runs."""
    d = _auth_dir(data_dir)
    try:
        servers = _saved_servers(data_dir)
    except NotFound:
        return False
    told = False
    for server in servers:
        try:
            with open(os.path.join(d, _conf_name(server, len(servers), "pid"))) as f:
                os.kill(int(f.read().strip()), signal.SIGHUP)
            told = True
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return told


def add_tenant(data_dir: str, name: str) -> str:
    """A new tenant with generated credentials; returns its credentials file."""
    if name == EDGE:
        raise Conflict(f"{name!r} is the SandboxFusion gateway's own identity; choose another name")
    if not tenancy.NAME.match(name):
        raise InvalidRequest(f"invalid tenant name {name!r}: lowercase letters, digits and '-', starting with a letter, "
                             "at most 32")
    table = tenants(data_dir)
    if name in table:
        raise Conflict(f"tenant {name!r} exists (revoke it first to issue new credentials)")
    table[name] = secrets.token_urlsafe(24)
    os.makedirs(os.path.dirname(tenant_creds_path(data_dir, name)), mode=0o700, exist_ok=True)
    write_private(tenant_creds_path(data_dir, name), f"{name}:{table[name]}\n")
    _save_tenants(data_dir, table)
    write_server_config(data_dir)
    reload(data_dir)
    return tenant_creds_path(data_dir, name)


def revoke_tenant(data_dir: str, name: str) -> None:
    """Remove a tenant: its credentials stop working and its connections are closed. Its
    sandboxes stay until their TTL (the operator can still list and destroy them)."""
    table = tenants(data_dir)
    if table.pop(name, None) is None:
        raise NotFound(f"no tenant {name!r}")
    _save_tenants(data_dir, table)
    try:
        os.unlink(tenant_creds_path(data_dir, name))
    except FileNotFoundError:
        pass
    write_server_config(data_dir)
    reload(data_dir)
