"""Every subject of the bus with the message types it carries: the table `corral contract` turns
into JSON Schemas and an AsyncAPI document (docs/contract/), and the unit tests hold against
subjects.py so that a subject added there without its types fails CI.

Subjects with a variable part are built by subjects.py's own functions with `{name}`
placeholders as arguments (AsyncAPI channel parameters), so the templates here cannot drift from
the subjects the services use.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import audit, envs, images, messages, replies, subjects
from .envelope import ErrorReply


@dataclass(frozen=True)
class Operation:
    """A request/reply subject: `request` in, one `reply` (or an ErrorReply) back."""

    name: str  # operationId: camelCase, unique
    subject: str
    request: type
    reply: type
    service: str  # who serves it
    summary: str
    queue: str = ""  # queue group of the serving replicas, if any
    public: bool = True  # False: between corral's own services (node-internal)
    streams: tuple[type, ...] = ()  # messages sent to the reply inbox before the reply (exec with stream)
    errors: type = ErrorReply


@dataclass(frozen=True)
class Channel:
    """A subject services publish on for whoever listens (stored in `stream` when it has one)."""

    name: str
    subject: str
    message: type
    publisher: str
    summary: str
    stream: str = ""


@dataclass(frozen=True)
class Bucket:
    """A JetStream KV bucket; `value` is the stored type when it is part of the contract."""

    name: str
    summary: str
    writer: str
    value: type | None = None
    key: str = "key"


SB = "{sandbox_id}"
NODE = "{node}"
_sandbox_ops: list[tuple[str, type, type, str]] = [
    ("exec", messages.ExecRequest, replies.ExecReply,
     "Run a command (or a step of a trajectory, or in a named session); with `stream`, ExecChunk messages precede the reply"),
    ("files.read", messages.FileReadRequest, replies.FileReadReply, "Read a file, resolved inside the sandbox's root"),
    ("files.write", messages.FileWriteRequest, replies.FileWriteReply, "Write a file, resolved inside the sandbox's root"),
    ("info", messages.Empty, replies.InfoReply, "The sandbox and its resource use"),
    ("destroy", messages.Empty, replies.DestroyReply, "Destroy the sandbox and everything it held"),
    ("snapshot", messages.SnapshotRequest, replies.SnapshotReply, "The sandbox's filesystem as a new image"),
    ("pause", messages.Empty, replies.SandboxReply, "Freeze every process of the sandbox"),
    ("resume", messages.Empty, replies.SandboxReply, "Thaw a paused sandbox"),
    ("renew", messages.RenewRequest, replies.SandboxReply, "Extend the sandbox's lease"),
    ("restore", messages.RestoreRequest, replies.RestoreReply, "Re-run a trajectory's logged steps after its last snapshot"),
    ("changes", messages.ChangesRequest, messages.ChangesReply, "What the sandbox changed against its image, read outside it"),
    ("audit", messages.Empty, messages.AuditState, "Publish the sandbox's audit so far; how far and what was lost"),
    ("port.open", messages.PortOpenRequest, replies.PortOpenReply,
     "Open a TCP stream to a port on the sandbox's loopback, carried over the bus (container substrate)"),
]


def _camel(*parts: str) -> str:
    words = [w for p in parts for w in p.replace(".", "_").split("_") if w]
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


OPERATIONS: list[Operation] = [
    Operation("sandboxCreate", subjects.SANDBOX_CREATE, messages.SandboxSpec, replies.SandboxReply, "scheduler",
              "Place and create one sandbox", subjects.SCHEDULER_QUEUE),
    Operation("sandboxCreateBatch", subjects.SANDBOX_CREATE_BATCH, messages.CreateBatchRequest, replies.CreateBatchReply,
              "scheduler", "Create many sandboxes of one spec (idempotent with spec.request_id)", subjects.SCHEDULER_QUEUE),
    Operation("sandboxList", subjects.SANDBOX_LIST, messages.ListRequest, replies.SandboxListReply, "scheduler",
              "Live sandboxes, by job, labels or node", subjects.SCHEDULER_QUEUE),
    Operation("sandboxRun", subjects.SANDBOX_RUN, messages.RunRequest, replies.RunReply, "scheduler",
              "One-shot: create, exec once, destroy", subjects.SCHEDULER_QUEUE),
    Operation("quotaSet", subjects.QUOTA_SET, messages.QuotaSetRequest, replies.QuotaReply, "scheduler",
              "Set a job's quota (sandboxes, cpu, memory_mb; `_default` for jobs without their own)", subjects.SCHEDULER_QUEUE),
    Operation("quotaGet", subjects.QUOTA_GET, messages.QuotaGetRequest, replies.QuotaGetReply, "scheduler",
              "A job's quota and what it holds now", subjects.SCHEDULER_QUEUE),
    *[Operation(_camel("sandbox", op), subjects.sandbox_op(SB, op), req, rep, "node-agent", summary,
                streams=(messages.ExecChunk,) if op == "exec" else ())
      for op, req, rep, summary in _sandbox_ops],
    Operation("trajOpen", subjects.TRAJ_OPEN, messages.TrajOpenRequest, replies.TrajReply, "node-agent",
              "Start (or find) a trajectory: its steps are logged and replayed", subjects.TRAJ_QUEUE),
    Operation("trajGet", subjects.TRAJ_GET, messages.TrajGetRequest, replies.TrajGetReply, "node-agent",
              "A trajectory and a page of its steps", subjects.TRAJ_QUEUE),
    Operation("trajList", subjects.TRAJ_LIST, messages.TrajListRequest, replies.TrajListReply, "node-agent",
              "Trajectories by id prefix", subjects.TRAJ_QUEUE),
    Operation("trajDelete", subjects.TRAJ_DELETE, messages.TrajRef, replies.TrajDeleteReply, "node-agent",
              "Delete a trajectory, its log and its snapshots", subjects.TRAJ_QUEUE),
    Operation("imageImport", subjects.IMAGE_IMPORT, images.ImportRequest, images.ImportReply, "image-cache",
              "Import a directory, tarball, docker archive, built-in or composed image"),
    Operation("imageList", subjects.IMAGE_LIST, messages.Empty, images.ImageListReply, "image-cache", "Every image"),
    Operation("imageInspect", subjects.IMAGE_INSPECT, images.NameRequest, images.InspectReply, "image-cache",
              "An image's layers and prefetch trace"),
    Operation("imageDelete", subjects.IMAGE_DELETE, images.NameRequest, images.ImageDeleteReply, "image-cache",
              "Delete an image (and the layers and chunks nothing else uses)"),
    Operation("monitorQuery", subjects.MONITOR_QUERY, audit.QueryRequest, audit.QueryReply, "monitor",
              "Read-only ClickHouse SQL over audit events, alerts and sandbox events"),
    Operation("monitorEvaluate", subjects.MONITOR_EVALUATE, audit.EvaluateRequest, audit.EvaluateReply, "monitor",
              "Wait until a sandbox's audit is stored, run the window rules for it, answer its alerts"),
    Operation("monitorRules", subjects.MONITOR_RULES, messages.Empty, audit.RulesReply, "monitor", "The detection rules"),
    Operation("envBuild", subjects.ENV_BUILD, envs.EnvBuildRequest, envs.EnvBuildReply, "env-builder",
              "Build and verify an environment", subjects.ENV_QUEUE),
    Operation("envList", subjects.ENV_LIST, envs.EnvListRequest, envs.EnvListReply, "env-builder",
              "Accepted environments", subjects.ENV_QUEUE),
    Operation("envGet", subjects.ENV_GET, envs.EnvRef, envs.EnvGetReply, "env-builder",
              "One environment (latest or given version)", subjects.ENV_QUEUE),
    Operation("envGrade", subjects.ENV_GRADE, envs.EnvGradeRequest, envs.EnvGradeReply, "env-builder",
              "Grade a rollout sandbox in a clean grading sandbox", subjects.ENV_QUEUE),
    Operation("envDelete", subjects.ENV_DELETE, envs.EnvRef, envs.EnvDeleteReply, "env-builder",
              "Delete an environment version and its image", subjects.ENV_QUEUE),
    # between corral's own services
    Operation("nodeCreate", subjects.node_create(NODE), messages.NodeCreate, replies.NodeCreateReply, "node-agent",
              "The scheduler asks a chosen node to create a sandbox", public=False),
    Operation("nodeCreateBatch", subjects.node_create_batch(NODE), messages.NodeCreateBatch, replies.NodeBatchReply,
              "node-agent", "Several creates on one node in one request", public=False),
    Operation("nodeRun", subjects.node_run(NODE), messages.NodeRun, replies.RunReply, "node-agent",
              "A one-shot run on a chosen node", public=False),
    Operation("nodePing", subjects.node_ping(NODE), messages.Empty, replies.NodePingReply, "node-agent",
              "Is this node alive", public=False),
    Operation("loaderPrepare", subjects.node_loader(NODE, "prepare"), images.LoaderPrepare, images.PrepareReply, "image-loader",
              "Make layers visible on the node (lazily loaded)", public=False),
    Operation("loaderRelease", subjects.node_loader(NODE, "release"), images.LoaderRelease, images.ReleaseReply, "image-loader",
              "Drop one use of each layer", public=False),
    Operation("loaderStats", subjects.node_loader(NODE, "stats"), messages.Empty, images.LoaderStats, "image-loader",
              "The loader's cache and fetch statistics", public=False),
    Operation("loaderEvict", subjects.node_loader(NODE, "evict"), images.LoaderEvict, images.EvictReply, "image-loader",
              "Drop unused layers from the node's cache", public=False),
]

CHANNELS: list[Channel] = [
    Channel("sandboxEvents", subjects.event(SB, "{kind}"), messages.Event, "node-agent",
            "A sandbox's lifecycle: created, exited, destroyed, failed, ...", "CORRAL_EVENTS"),
    Channel("nodeEvents", subjects.node_event(NODE, "{kind}"), messages.Event, "scheduler",
            "A node's lifecycle: joined, lost, ...", "CORRAL_EVENTS"),
    Channel("batchEvents", subjects.batch_event("{batch_id}", "{kind}"), messages.BatchProgress, "scheduler",
            "A create_batch's progress (`progress`) and its end (`done`)", "CORRAL_EVENTS"),
    Channel("audit", subjects.audit(NODE, SB), audit.AuditBatch, "node-agent",
            "Audit events of a sandbox: exec, file, syscall, net, signal, canary, loss", "CORRAL_AUDIT"),
    Channel("alerts", subjects.alert("{severity}", "{rule}"), audit.Alert, "monitor",
            "Misbehaviour the monitor's rules flagged", "CORRAL_ALERTS"),
    Channel("tenantAlerts", subjects.tenant_alert("{tenant}", "{severity}", "{rule}"), audit.Alert, "monitor",
            "A tenant's copy of the alerts on its own sandboxes (core NATS: live only)"),
    Channel("trajectorySteps", subjects.traj_entry("{trajectory}", "{step}"), messages.TrajEntry, "node-agent",
            "One logged step of a trajectory (its request and result)", "CORRAL_TRAJ"),
    Channel("envProgress", subjects.env_progress("{build_id}"), envs.EnvProgress, "env-builder",
            "A build's progress (core NATS, not stored: subscribe before asking for the build)"),
    Channel("nodeHeartbeat", subjects.NODE_HEARTBEAT, messages.Heartbeat, "node-agent",
            "Every node's capacity, use and images, several times a second"),
]

BUCKETS: list[Bucket] = [
    Bucket(subjects.KV_PLACEMENTS, "Where each sandbox lives (written by its node)", "node-agent", messages.SandboxInfo, "sandbox id"),
    Bucket(subjects.KV_NODES, "The node registry, from heartbeats", "scheduler", messages.Heartbeat, "node"),
    Bucket(subjects.KV_REQUESTS, "Create request ids, for idempotent retries (24 h)", "scheduler", key="request id"),
    Bucket(subjects.KV_TRAJ, "Trajectory metadata", "node-agent", messages.TrajMeta, "trajectory id"),
    Bucket(subjects.KV_ENVS, "The environment catalog (hidden tests included: env-builder only)", "env-builder",
           key="name.version"),
    Bucket(images.KV_IMAGES, "Image manifests", "image-cache", images.ImageManifest, "image name"),
    Bucket(images.KV_LAYERS, "Layer manifests (chunk digests)", "image-cache", images.LayerManifest, "layer digest"),
    Bucket(images.KV_TRACES, "Prefetch traces: the chunks an image's first start read", "image-loader", images.Trace, "image name"),
]

STREAMS = subjects.STREAMS


def public_operations() -> list[Operation]:
    return [o for o in OPERATIONS if o.public]


def all_types() -> list[type]:
    """Every message type the contract names, in a stable order."""
    seen: dict[str, type] = {}
    for o in OPERATIONS:
        for t in (o.request, o.reply, o.errors, *o.streams):
            seen.setdefault(t.__name__, t)
    for c in CHANNELS:
        seen.setdefault(c.message.__name__, c.message)
    for b in BUCKETS:
        if b.value is not None:
            seen.setdefault(b.value.__name__, b.value)
    return list(seen.values())


__all__ = ["BUCKETS", "CHANNELS", "OPERATIONS", "STREAMS", "Bucket", "Channel", "Operation", "all_types"]
