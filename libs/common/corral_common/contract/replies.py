"""Success replies of the sandbox, node and trajectory subjects (the `Reply` envelope is in
envelope.py; image, monitor and env replies sit beside their requests in images.py, audit.py and
envs.py)."""
from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from .envelope import ErrorBody, Reply
from .errors import Internal, from_code
from .images import ImageManifest
from .messages import ExecChunk, ExecResult, FileContent, JobQuota, NodeItemResult, SandboxInfo, TrajEntry, TrajMeta

# ----- corral.v1.sandbox.* (scheduler) -----


class SandboxReply(Reply, kw_only=True):
    """create, and a sandbox's pause/resume/renew: the sandbox as it is now."""

    sandbox: SandboxInfo


class BatchFailure(Struct, kw_only=True):
    index: int  # the item's position in the batch (its sandbox id derives from request_id and index)
    code: str
    message: str


class CreateBatchReply(Reply, kw_only=True):
    batch_id: str
    sandboxes: list[SandboxInfo] = []
    failed: list[BatchFailure] = []
    # sandboxes made but left out because the reply would pass the bus's payload limit (list them
    # with corral.v1.sandbox.list by job or labels)
    truncated: int = 0


class SandboxListReply(Reply, kw_only=True):
    sandboxes: list[SandboxInfo] = []


class RunReply(Reply, kw_only=True):
    result: ExecResult
    sandbox_id: str
    node: str


class QuotaReply(Reply, kw_only=True):
    job: str
    quota: JobQuota | None = None  # None: no quota applies (no own quota and no _default)


class QuotaUsage(Struct, kw_only=True):
    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0


class QuotaGetReply(QuotaReply, kw_only=True):
    used: QuotaUsage  # what the job holds now (placed and being placed)


# ----- corral.v1.sandbox.<id>.<op> (the owning node) -----


class SandboxUsageInfo(Struct, kw_only=True):
    cpu_ns: int = 0
    memory_bytes: int = 0
    pids: int = 0


class InfoReply(Reply, kw_only=True):
    sandbox: SandboxInfo
    usage: SandboxUsageInfo


class ExecReply(Reply, kw_only=True):
    result: ExecResult


class FileReadReply(Reply, kw_only=True):
    file: FileContent


class FileWriteReply(Reply, kw_only=True):
    path: str
    size: int


class PortOpenReply(Reply, kw_only=True):
    """A port forward is open: publish the client's frames to `tunnel` (corral_common/tunnel.py)."""
    tunnel: str
    window: int  # bytes a sender may have unacknowledged
    chunk: int  # the largest data frame, bytes


class DestroyReply(Reply, kw_only=True):
    sandbox_id: str


class SnapshotReply(Reply, kw_only=True):
    image: ImageManifest
    layer: str  # digest of the new layer (the sandbox's writable layer; a memory snapshot's: its saved guest)
    size: int  # bytes of the new layer
    uploaded_bytes: int  # chunk bytes not already in the store


class RestoreReply(Reply, kw_only=True):
    trajectory: TrajMeta
    rerun_steps: int  # logged steps re-run after the snapshot (their results replayed from the log)
    from_snapshot_step: int  # -1: no snapshot, rebuilt from the trajectory's first step


# ----- corral.v1.traj.* -----


class TrajReply(Reply, kw_only=True):
    trajectory: TrajMeta


class TrajGetReply(Reply, kw_only=True):
    trajectory: TrajMeta
    recent: list[TrajEntry] = []


class TrajListReply(Reply, kw_only=True):
    trajectories: list[TrajMeta] = []


class TrajDeleteReply(Reply, kw_only=True):
    id: str
    snapshots_removed: int


# ----- node-internal: corral.node.<node>.* (scheduler <-> node-agent) -----


class NodePingReply(Reply, kw_only=True):
    node: str
    sandboxes: int
    incarnation: str = ""  # as in its heartbeats
    # how long this process has served its sandboxes' subjects: a call heard before then, by the
    # scheduler's clock, reached no node-agent (the scheduler answers `unavailable` for it)
    serving_s: float = 0.0


class NodeCreateReply(Reply, kw_only=True):
    sandbox: SandboxInfo
    # the node already answered the client on NodeCreate.reply_to; the scheduler only records
    replied: bool = False
    # node clock: heartbeats taken at or after this count the sandbox (the scheduler stops
    # counting it as in flight from then on)
    counted_at: float | None = None


class NodeBatchReply(Reply, kw_only=True):
    results: list[NodeItemResult] = []  # one per item, in order
    counted_at: float | None = None  # as in NodeCreateReply, for every sandbox the batch made


# ----- a streamed exec's messages on the caller's inbox -----


class _ExecFrame(Struct, kw_only=True):
    """Either an ExecChunk (`kind: "chunk"`) or the final reply (an ExecReply or an error): one
    decode tells which."""

    kind: str = ""
    stream: Literal["stdout", "stderr"] = "stdout"
    data: str = ""
    seq: int = 0
    ok: bool = True
    result: ExecResult | None = None
    error: ErrorBody | None = None


_frame_decoder = msgspec.json.Decoder(_ExecFrame)


def decode_exec_frame(data: bytes) -> ExecChunk | ExecReply:
    try:
        f = _frame_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise Internal(f"malformed exec stream message: {e}") from None
    if f.kind == "chunk":
        return ExecChunk(stream=f.stream, data=f.data, seq=f.seq)
    if not f.ok or f.result is None:
        err = f.error or ErrorBody(code="internal", message="exec reply without a result or an error")
        raise from_code(err.code, err.message, err.retry_after_s)
    return ExecReply(result=f.result)
