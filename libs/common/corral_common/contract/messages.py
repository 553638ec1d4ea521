"""msgspec Structs for the whole v1 bus contract, plus the node-internal messages.

Requests forbid unknown fields so that a typo (`memroy_mb`) is an `invalid_request` naming the
field instead of a silently ignored setting.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .envelope import ErrorBody, Reply

SUBSTRATES = ("container", "function", "docker", "gvisor", "microvm", "vm")
Substrate = Literal["container", "function", "docker", "gvisor", "microvm", "vm"]
SandboxState = Literal["creating", "running", "paused", "exited", "destroyed", "failed"]

Name = Annotated[str, Meta(min_length=1, max_length=256)]
LabelMap = Annotated[dict[str, str], Meta(max_length=64)]
EnvMap = Annotated[dict[str, str], Meta(max_length=1024)]


class Request(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class SandboxSpec(Request, kw_only=True):
    image: Name = "busybox"
    substrate: Substrate = "container"
    cpu: Annotated[float, Meta(gt=0, le=256)] = 1.0
    memory_mb: Annotated[int, Meta(ge=16, le=1_048_576)] = 512
    disk_mb: Annotated[int, Meta(ge=1, le=1_048_576)] = 1024
    ttl_s: Annotated[float, Meta(gt=0, le=7 * 86400)] = 3600.0
    # "none": loopback only. "allowlist": a route out to exactly the `egress` entries (container
    # substrate), enforced by the node outside the sandbox; everything else, the host and the bus
    # included, stays unreachable, and refused attempts are audited
    network: Literal["none", "allowlist"] = "none"
    # with "allowlist": IPv4 addresses, CIDRs or hostnames (resolved by the node at create, written
    # into the sandbox's /etc/hosts; no DNS server is reachable), each optionally with ":port" (TCP)
    egress: Annotated[list[Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:/_-]+$")]],
                      Meta(max_length=64)] = []
    env: EnvMap = {}
    labels: LabelMap = {}
    job: Annotated[str, Meta(max_length=128)] = ""
    workdir: Annotated[str, Meta(max_length=4096)] = "/"
    protected_paths: Annotated[list[str], Meta(max_length=256)] = []
    # decoy files planted at create (path -> content); any open of one is audited (kind "canary")
    canaries: Annotated[dict[str, str], Meta(max_length=64)] = {}
    request_id: Annotated[str, Meta(max_length=256)] = ""
    pids_max: Annotated[int, Meta(ge=8, le=65536)] = 1024
    placement: Literal["spread", "pack"] = "spread"
    # the tenant it is for: set by the scheduler from the caller's authenticated account (what a
    # tenant writes here is replaced); the operator may create for a tenant
    tenant: Annotated[str, Meta(max_length=32, pattern=r"^([a-z][a-z0-9-]*)?$")] = ""
    # a fork: the new sandbox starts with a copy of this running sandbox's files (its writable
    # layer, taken while it is frozen for that moment) on the same image, on the same node; its
    # processes and memory are not copied (container substrate). `image` is the source's
    fork_of: Annotated[str, Meta(max_length=64, pattern=r"^([A-Za-z0-9_-]+)?$")] = ""


class SandboxInfo(Struct, kw_only=True, omit_defaults=True, gc=False):
    """(gc=False: holds no reference cycles; a scheduler keeps hundreds of thousands of these, which
    the cycle collector would otherwise walk again and again.)"""

    id: str
    node: str
    state: SandboxState
    substrate: Substrate
    image: str
    created_at: float
    expires_at: float
    job: str = ""
    labels: dict[str, str] = {}
    cpu: float = 0.0
    memory_mb: int = 0
    request_id: str = ""
    tenant: str = ""  # who created it (from the bus's authentication); "" for the operator's


class RunSpec(SandboxSpec, kw_only=True):
    """The sandbox part of a one-shot `corral.v1.sandbox.run`: a SandboxSpec whose substrate
    defaults to `function` (the lightest path); `container` and `docker` work too (created,
    exec'd once and destroyed)."""

    substrate: Substrate = "function"

    def to_spec(self) -> SandboxSpec:
        return SandboxSpec(**msgspec.structs.asdict(self))


BatchId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class CreateBatchRequest(Request, kw_only=True):
    """`spec.request_id` makes the batch idempotent: item i gets a sandbox id derived from it, so a
    retry (after a timeout or a scheduler replica dying mid-batch) returns the same sandboxes and
    places only what is missing. `batch_id` names the progress events
    (`corral.events.batch.<batch_id>.progress|done`); default: derived from the request_id, else new.
    `stream_progress`: every progress event (BatchProgress, the `done` one last) is also sent to the
    request's reply subject, before the reply, for a requester that may not subscribe to
    `corral.events` (a tenant): the reply is then the one message with `ok`."""

    spec: SandboxSpec
    count: Annotated[int, Meta(ge=1, le=100_000)]
    batch_id: BatchId | None = None
    stream_progress: bool = False


class BatchProgress(Struct, kw_only=True):
    """`corral.events.batch.<batch_id>.progress` (every `every` items or `interval_s` while a batch
    runs) and `.done` (once, last): counts so far out of `total`."""

    batch_id: str
    total: int
    placed: int
    failed: int
    done: bool
    ts: float
    job: str = ""
    request_id: str = ""


class ListRequest(Request, kw_only=True):
    job: str | None = None
    labels: dict[str, str] | None = None
    node: str | None = None


# the uid (and gid) harness commands run as inside a sandbox (ExecRequest.harness): not root, so
# the agent's capability-less root can neither read, signal nor impersonate them, nor write what
# they own (a file of this uid in a rollout was written by the harness, never by the agent)
HARNESS_UID = 64222


class ExecRequest(Request, kw_only=True):
    cmd: str | Annotated[list[str], Meta(min_length=1)]
    stdin: str = ""
    env: EnvMap = {}
    cwd: str | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 60.0
    session: Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9_.-]*$")] = ""
    # the program a new session runs: `/bin/sh` (POSIX), or `/bin/bash` for agents written against
    # bash (SWE-ReX, SWE-agent: `source`, `[[ ]]`, arrays); a live session keeps the shell it started with
    shell: Literal["sh", "bash"] = "sh"
    # run as the harness (uid 64222), not as the agent (root without capabilities): the agent's
    # processes cannot read its /proc (fds, memory, environment), signal it, or read its scripts
    # and stdin; for a grader's or trainer's own commands in a rollout (a session keeps the user it
    # started with)
    harness: bool = False
    stream: bool = False
    max_output_bytes: Annotated[int, Meta(ge=0, le=64 * 1024 * 1024)] = 1024 * 1024
    trajectory: Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9_-]*$")] = ""
    step: Annotated[int, Meta(ge=0)] | None = None
    # a logged step issued again with a different command: "error" (conflict) or "truncate" the
    # log from this step on and run it
    on_divergence: Literal["error", "truncate"] = "error"


class RunRequest(Request, kw_only=True):
    """`corral.v1.sandbox.run`: place `spec` on a node, run `exec` once in a fresh sandbox, destroy
    it. Reply: `{"ok", "result": ExecResult, "sandbox_id", "node"}`. `exec.stream` and
    `exec.session` are refused (one message back, nothing kept)."""

    spec: RunSpec = msgspec.field(default_factory=RunSpec)
    exec: ExecRequest


class ExecResult(Struct, kw_only=True):
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration_ms: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    replayed: bool = False
    oom_killed: bool = False
    signal: int | None = None


class ExecChunk(Struct, kw_only=True, tag="chunk", tag_field="kind"):
    """One piece of streamed output, sent to the reply inbox before the final reply."""

    stream: Literal["stdout", "stderr"]
    data: str
    seq: int


class FileReadRequest(Request, kw_only=True):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    max_bytes: Annotated[int, Meta(ge=0, le=64 * 1024 * 1024)] = 16 * 1024 * 1024


class FileWriteRequest(Request, kw_only=True):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    content_b64: str
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o644
    make_parents: bool = True


class FileContent(Struct, kw_only=True):
    path: str
    content_b64: str
    size: int
    mode: int


class Empty(Request):
    pass


class RenewRequest(Request, kw_only=True):
    ttl_s: Annotated[float, Meta(gt=0, le=7 * 86400)] | None = None  # default: the sandbox's own ttl_s


# ----- port forwarding: a TCP stream to a port inside a sandbox, over the bus -----

#: a client's own inbox (what every NATS client's new_inbox() makes): the node publishes the
#: sandbox's bytes there, so it can never be pointed at a corral subject or a stream's
InboxSubject = Annotated[str, Meta(max_length=256, pattern=r"^_INBOX(\.[A-Za-z0-9_-]+)+$")]


class PortOpenRequest(Request, kw_only=True):
    port: Annotated[int, Meta(ge=1, le=65535)]  # on 127.0.0.1 inside the sandbox
    # where the node sends its frames: subscribe it first (frames may arrive before the reply). Empty:
    # the request's own reply subject, then frames on it after the reply (what tenants must use:
    # only the reply route crosses from corral's account into theirs)
    reply_to: InboxSubject | Literal[""] = ""


# ----- trajectories (resume after preemption) -----

TrajId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


class TrajSnapshot(Struct, kw_only=True):
    step: int  # the snapshot holds the effects of steps 0..step
    image: str


class TrajMeta(Struct, kw_only=True):
    id: str
    sandbox_id: str
    spec: SandboxSpec
    created_at: float
    updated_at: float
    node: str = ""
    last_step: int = -1
    snapshot_every: int = 10
    snapshots: list[TrajSnapshot] = []


class TrajEntry(Struct, kw_only=True):
    """One logged step: the request as issued (minus trajectory fields) and its result."""

    trajectory: str
    step: int
    input_hash: str
    request: ExecRequest
    result: ExecResult
    sandbox_id: str
    ts: float


class TrajOpenRequest(Request, kw_only=True):
    id: TrajId
    sandbox_id: str
    spec: SandboxSpec
    snapshot_every: Annotated[int, Meta(ge=0, le=100_000)] = 10  # 0: no automatic snapshots


class TrajRef(Request, kw_only=True):
    id: TrajId


class TrajGetRequest(Request, kw_only=True):
    id: TrajId
    from_step: Annotated[int, Meta(ge=0)] | None = None  # None: the 20 most recent steps
    limit: Annotated[int, Meta(ge=1, le=10_000)] = 1000


class TrajListRequest(Request, kw_only=True):
    prefix: str = ""


class RestoreRequest(Request, kw_only=True):
    trajectory: TrajId


class SnapshotRequest(Request, kw_only=True):
    name: str = ""  # image name for the snapshot; default snap-<sandbox>-<ms>
    labels: LabelMap = {}
    # the processes' memory too (a create of the image resumes them): microvm and vm guests, whose
    # files (a tmpfs in their RAM) come with it; others answer invalid_request
    memory: bool = False


# ----- what a sandbox changed, and how complete its audit is (the grader's consistent point) -----

ChangeKind = Literal["file", "dir", "symlink", "deleted", "other"]


class ChangesRequest(Request, kw_only=True):
    """`corral.v1.sandbox.<id>.changes`: the entries of the sandbox's writable layer, read on the
    host (nothing inside the sandbox is trusted to list or pack them). The sandbox is frozen while
    its layer is walked (and thawed after, unless it was paused before)."""

    # absolute paths (files or directories) whose changed regular files and symlinks are packed
    # into `archive_b64`; empty: list only
    include: Annotated[list[Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^/")]], Meta(max_length=256)] = []
    # absolute path prefixes left out of the listing and the archive (e.g. a trajectory's own files)
    exclude: Annotated[list[Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^/")]], Meta(max_length=256)] = []
    max_archive_bytes: Annotated[int, Meta(ge=0, le=6 * 1024 * 1024)] = 4 * 1024 * 1024
    max_entries: Annotated[int, Meta(ge=1, le=200_000)] = 50_000


class Change(Struct, kw_only=True, omit_defaults=True):
    path: str  # absolute, inside the sandbox
    kind: ChangeKind  # deleted: an overlay whiteout (the path existed in the image and was removed)
    size: int = 0
    mode: int = 0  # permission bits
    opaque: bool = False  # a directory that replaced the image's one: nothing of the image's remains below
    target: str = ""  # a symlink's target
    # the owner as seen inside the sandbox (HARNESS_UID: written by a harness process; the agent
    # cannot make a file of that uid)
    uid: int = 0


class ChangesReply(Reply, kw_only=True):
    changes: list[Change] = []
    # gzip'd tar (paths relative to /) of the regular files and symlinks under `include`
    archive_b64: str = ""
    packed: int = 0  # entries in the archive
    truncated: bool = False  # more than max_entries entries: the listing stops there
    too_large: list[str] = []  # included paths left out because the archive would pass max_archive_bytes


class AuditState(Reply, kw_only=True):
    """`corral.v1.sandbox.<id>.audit`: the node drains its audit sources for the sandbox (fanotify
    queue, seccomp listener, buffered events), publishes what it holds, then answers."""

    last_seq: int = 0  # CORRAL_AUDIT stream sequence of the last batch published for this sandbox (0: none yet)
    published: int = 0  # events of this sandbox published so far
    lost: int = 0  # events of this sandbox that never reached the stream (dropped, throttled, overflowed)
    reasons: list[str] = []  # why events were lost, or why the record has a gap (a node-agent restart)


# ----- per-job quotas (corral.v1.quota.*, answered by the scheduler) -----

JobName = Annotated[str, Meta(max_length=128)]


class QuotaSetRequest(Request, kw_only=True):
    job: JobName  # "_default" (or empty) applies to jobs without their own quota
    sandboxes: Annotated[int, Meta(ge=0)] | None = None  # None: no limit
    cpu: Annotated[float, Meta(ge=0)] | None = None
    memory_mb: Annotated[int, Meta(ge=0)] | None = None


class QuotaGetRequest(Request, kw_only=True):
    job: JobName


class JobQuota(Struct, kw_only=True):
    sandboxes: int | None = None
    cpu: float | None = None
    memory_mb: int | None = None


# ----- node-internal messages (scheduler <-> node-agent) -----


class NodeCapacity(Struct, kw_only=True):
    cpu: float  # real cores; the scheduler overcommits by observed use up to cpu_overcommit_max
    memory_mb: int
    sandboxes: int
    cpu_overcommit_max: float = 1.0


class SandboxUsage(Struct, array_like=True):
    """One sandbox's observed use over the last heartbeat interval, encoded as a 3-element array
    (`["sb-...", cpu, memory_mb]`, ~35 bytes) so that a 2,000-sandbox node's heartbeat stays small."""

    id: str
    cpu: float  # cores (CPU seconds per second) since the previous heartbeat
    memory_mb: float  # memory cgroup usage (page cache and tmpfs upper included)


class NodeUsage(Struct, kw_only=True):
    cpu: float = 0.0  # observed, all sandboxes (warm pool included)
    memory_mb: int = 0  # observed, all sandboxes (warm pool included)
    sandboxes: int = 0  # user sandboxes (warm-pool sandboxes are not counted here)
    requested_cpu: float = 0.0
    requested_memory_mb: int = 0
    pooled: int = 0  # pre-created warm-pool sandboxes (frozen, unclaimed)
    # per user sandbox, busiest first (CPU, then memory); at most the node's --usage-top entries,
    # the rest counted in per_sandbox_omitted (they are in the aggregate cpu/memory_mb above)
    per_sandbox: list[SandboxUsage] = []
    per_sandbox_omitted: int = 0


class Heartbeat(Struct, kw_only=True):
    node: str
    ts: float
    capacity: NodeCapacity
    usage: NodeUsage
    substrates: list[str] = []
    images: list[str] = []
    version: str = ""
    metrics_url: str = ""
    stopping: bool = False
    warm: dict[str, int] = {}  # image (container) or substrate:image (microvm:busybox) -> warm-pool sandboxes ready on this node
    # one per node-agent process: a heartbeat of the same incarnation after a call proves the
    # process that held the sandbox's subscription when the call came was still alive
    incarnation: str = ""


class NodeCreate(Struct, kw_only=True, omit_defaults=True):
    """scheduler -> `corral.node.<node>.create`. With `reply_to` (the client's reply inbox), a
    node that made the sandbox answers the client there itself, then answers the scheduler with
    `"replied": true` (the scheduler then only records the placement). Optional: a node that
    ignores it (older node-agents) answers the scheduler only, and the scheduler relays."""

    sandbox_id: str
    spec: SandboxSpec
    reply_to: str = ""


class NodeCreateBatch(Struct, kw_only=True):
    """scheduler -> `corral.node.<node>.create_batch`: several creates in one request; the reply is
    `{"ok": true, "results": [NodeItemResult, ...]}`, one per item, in order."""

    items: Annotated[list[NodeCreate], Meta(min_length=1, max_length=4096)]


class NodeItemResult(Struct, kw_only=True, omit_defaults=True):
    """One item of a node batch reply: what a single create would have answered."""

    ok: bool
    sandbox: SandboxInfo | None = None
    error: ErrorBody | None = None


class NodeReconciled(Struct, kw_only=True):
    """`corral.node.<node>.reconciled`, published by a starting node-agent for each substrate that
    found what a predecessor left: the sandboxes it adopted and those it cleaned up."""

    node: str
    substrate: str
    adopted: list[str] = []
    cleaned: list[str] = []
    notes: list[str] = []


class NodeRun(Struct, kw_only=True):
    """scheduler -> `corral.node.<node>.run`; the node picks the sandbox id."""

    spec: SandboxSpec
    exec: ExecRequest


class Event(Struct, kw_only=True, omit_defaults=True):
    kind: str
    ts: float
    sandbox_id: str = ""
    node: str = ""
    job: str = ""
    reason: str = ""
    info: SandboxInfo | None = None
    detail: dict[str, Any] = {}


encoder = msgspec.json.Encoder()


def new_id(prefix: str = "sb") -> str:
    import secrets

    return f"{prefix}-{secrets.token_hex(6)}"


