"""Every NATS subject, stream and bucket name of corral, in one place.

Nothing else in the tree spells a `corral.` subject (or a `$KV.` one corral builds):
tests/unit/test_subjects_in_one_place.py fails on a literal outside this module, so a subject
renamed here is renamed everywhere and the contract can be read off this file.
"""
from __future__ import annotations

PREFIX = "corral.v1"

SANDBOX_CREATE = f"{PREFIX}.sandbox.create"
SANDBOX_CREATE_BATCH = f"{PREFIX}.sandbox.create_batch"
SANDBOX_LIST = f"{PREFIX}.sandbox.list"
SANDBOX_RUN = f"{PREFIX}.sandbox.run"  # one-shot: create, exec once, destroy (the `function` substrate)

SANDBOX_OPS = ("exec", "files.read", "files.write", "info", "destroy", "snapshot", "pause", "resume", "renew", "restore",
               "changes", "audit", "port.open")

# audit messages the monitor could not decode or kept failing on, with headers saying why
DEADLETTER = "corral.monitor.deadletter"
DEADLETTER_STREAM = "CORRAL_DEADLETTER"

TRAJ_OPEN = f"{PREFIX}.traj.open"
TRAJ_GET = f"{PREFIX}.traj.get"
TRAJ_LIST = f"{PREFIX}.traj.list"
TRAJ_DELETE = f"{PREFIX}.traj.delete"
TRAJ_QUEUE = "corral-traj"
KV_TRAJ = "corral_traj"
TRAJ_STREAM = "CORRAL_TRAJ"


def traj_entry(trajectory: str, step: int | str) -> str:
    return f"corral.traj.{trajectory}.{step}"


def traj_all(trajectory: str) -> str:
    return f"corral.traj.{trajectory}.>"


def sandbox_op(sandbox_id: str, op: str) -> str:
    return f"{PREFIX}.sandbox.{sandbox_id}.{op}"


def tunnel(token: str) -> str:
    """Where a port forward's client sends its bytes; the node holding the sandbox listens
    (`port.open` answers it; frames in corral_common/tunnel.py)."""
    return f"{PREFIX}.tunnel.{token}"


def sandbox_all(sandbox_id: str) -> str:
    return f"{PREFIX}.sandbox.{sandbox_id}.>"


# node-internal subjects: the scheduler asks a chosen node to create a sandbox
def node_create(node: str) -> str:
    return f"corral.node.{node}.create"


def node_create_batch(node: str) -> str:
    return f"corral.node.{node}.create_batch"


def node_run(node: str) -> str:
    return f"corral.node.{node}.run"


def node_ping(node: str) -> str:
    return f"corral.node.{node}.ping"


NODE_HEARTBEAT = "corral.node.heartbeat"


def event(sandbox_id: str, kind: str) -> str:
    return f"corral.events.sandbox.{sandbox_id}.{kind}"


def node_event(node: str, kind: str) -> str:
    return f"corral.events.node.{node}.{kind}"


def batch_event(batch_id: str, kind: str) -> str:
    """`progress` while a create_batch runs, `done` once at its end (see messages.BatchProgress)."""
    return f"corral.events.batch.{batch_id}.{kind}"


def audit(node: str, sandbox_id: str) -> str:
    return f"corral.audit.{node}.{sandbox_id}"


def alert(severity: str, rule: str) -> str:
    return f"{ALERTS_PREFIX}.{severity}.{rule}"


def tenant_alert(tenant: str, severity: str, rule: str) -> str:
    """Where a tenant hears the alerts on its own sandboxes (a copy of `alert`, core NATS; the one
    alert subject a tenant may subscribe to: its own)."""
    return f"corral.tenant.{tenant}.alerts.{severity}.{rule}"


def tenant_alerts(tenant: str) -> str:
    """Every alert subject of one tenant (what it may subscribe to)."""
    return f"corral.tenant.{tenant}.alerts.>"


TENANT_ALERTS_ALL = tenant_alerts("*")


def node_loader(node: str, op: str) -> str:
    """`corral.node.<node>.loader.<op>`: request/reply subjects of a node's lazy loader."""
    return f"corral.node.{node}.loader.{op}"


# everything a stream holds; also what a watcher subscribes to see all of one kind
EVENTS_ALL = "corral.events.>"
SANDBOX_EVENTS_ALL = "corral.events.sandbox.>"
NODE_EVENTS_ALL = "corral.events.node.>"
AUDIT_ALL = "corral.audit.>"
ALERTS_PREFIX = "corral.alerts"  # alert(severity, rule) is f"{ALERTS_PREFIX}.{severity}.{rule}"
ALERTS_ALL = f"{ALERTS_PREFIX}.>"
TRAJ_ALL = "corral.traj.>"

STREAMS: dict[str, list[str]] = {
    "CORRAL_EVENTS": [EVENTS_ALL],
    "CORRAL_AUDIT": [AUDIT_ALL],
    "CORRAL_ALERTS": [ALERTS_ALL],
    "CORRAL_TRAJ": [TRAJ_ALL],
}

def image_op(op: str) -> str:
    """`corral.v1.image.<op>`: the image-cache registry's requests (import, list, inspect, delete)."""
    return f"{PREFIX}.image.{op}"


IMAGE_IMPORT = image_op("import")
IMAGE_LIST = image_op("list")
IMAGE_INSPECT = image_op("inspect")
IMAGE_DELETE = image_op("delete")

# monitor: read-only ClickHouse SQL; its durable audit consumer (others check how far it got)
MONITOR_QUERY = f"{PREFIX}.monitor.query"
# evaluate one sandbox now: wait until its audit is stored, run the window rules for it, record
# findings other services bring (the grader's), answer its alerts
MONITOR_EVALUATE = f"{PREFIX}.monitor.evaluate"
MONITOR_RULES = f"{PREFIX}.monitor.rules"  # the detection rules the monitor runs, with their settings
MONITOR_AUDIT_DURABLE = "corral-monitor-audit"

# env-builder
ENV_BUILD = f"{PREFIX}.env.build"
ENV_LIST = f"{PREFIX}.env.list"
ENV_GET = f"{PREFIX}.env.get"
ENV_GRADE = f"{PREFIX}.env.grade"
ENV_DELETE = f"{PREFIX}.env.delete"
ENV_QUEUE = "corral-env-builder"
KV_ENVS = "corral_envs"


def env_progress(build_id: str) -> str:
    """Build progress, core NATS (not stored): a watcher subscribes before it asks for the build."""
    return f"corral.env.progress.{build_id}"


KV_NODES = "corral_nodes"
KV_PLACEMENTS = "corral_placements"
KV_REQUESTS = "corral_requests"

SCHEDULER_QUEUE = "corral-scheduler"
# per-job quotas, answered by the scheduler
QUOTA_SET = f"{PREFIX}.quota.set"
QUOTA_GET = f"{PREFIX}.quota.get"


def kv_key(bucket: str, key: str) -> str:
    """The subject a KV bucket stores `key` under (`>`/`*` to watch): a plain publish there is a
    put without waiting for the ack; a subscription there sees every put."""
    return f"$KV.{bucket}.{key}"


# JetStream's own API subjects, for the server's permissions (who may read a bucket's stream,
# delete or purge a stream); see the JetStream API reference
def js_api(verb: str, stream: str) -> str:
    """`$JS.API.<verb>.<stream>`, e.g. js_api("STREAM.INFO", "KV_corral_envs")."""
    return f"$JS.API.{verb}.{stream}"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_stream_access(bucket: str) -> list[str]:
    """Every subject that reads or changes a KV bucket: its keys, and any JetStream API call naming
    its stream (info, direct and message gets, consumers of any kind, purge, delete)."""
    s = kv_stream(bucket)
    return [kv_key(bucket, ">"), f"$JS.API.*.*.{s}", f"$JS.API.*.*.{s}.>", f"$JS.API.*.*.*.{s}", f"$JS.API.*.*.*.{s}.>"]


def stream_erasure(stream: str) -> list[str]:
    """The JetStream API calls that remove stored messages of `stream`."""
    return [js_api("STREAM.DELETE", stream), js_api("STREAM.PURGE", stream), js_api("STREAM.MSG.DELETE", stream)]
