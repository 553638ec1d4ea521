"""Every NATS subject, stream and bucket name of corral, in one place."""
from __future__ import annotations

PREFIX = "corral.v1"

SANDBOX_CREATE = f"{PREFIX}.sandbox.create"
SANDBOX_CREATE_BATCH = f"{PREFIX}.sandbox.create_batch"
SANDBOX_LIST = f"{PREFIX}.sandbox.list"
SANDBOX_RUN = f"{PREFIX}.sandbox.run"  # one-shot: create, exec once, destroy (the `function` substrate)

SANDBOX_OPS = ("exec", "files.read", "files.write", "info", "destroy", "snapshot", "pause", "resume", "renew", "restore",
               "changes", "audit")

MONITOR_QUERY = f"{PREFIX}.monitor.query"  # read-only SQL answered by the monitor (embedded ClickHouse)
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


def traj_entry(trajectory: str, step: int) -> str:
    return f"corral.traj.{trajectory}.{step}"


def traj_all(trajectory: str) -> str:
    return f"corral.traj.{trajectory}.>"


def sandbox_op(sandbox_id: str, op: str) -> str:
    return f"{PREFIX}.sandbox.{sandbox_id}.{op}"


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
    return f"corral.alerts.{severity}.{rule}"


STREAMS: dict[str, list[str]] = {
    "CORRAL_EVENTS": ["corral.events.>"],
    "CORRAL_AUDIT": ["corral.audit.>"],
    "CORRAL_ALERTS": ["corral.alerts.>"],
    "CORRAL_TRAJ": ["corral.traj.>"],
}

IMAGE_IMPORT = f"{PREFIX}.image.import"
IMAGE_INSPECT = f"{PREFIX}.image.inspect"
IMAGE_DELETE = f"{PREFIX}.image.delete"

# monitor: read-only ClickHouse SQL; its durable audit consumer (others check how far it got)
MONITOR_QUERY = f"{PREFIX}.monitor.query"
# evaluate one sandbox now: wait until its audit is stored, run the window rules for it, record
# findings other services bring (the grader's), answer its alerts
MONITOR_EVALUATE = f"{PREFIX}.monitor.evaluate"
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
