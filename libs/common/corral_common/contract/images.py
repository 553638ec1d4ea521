"""The image contract: the catalog's records (image and layer manifests, prefetch traces, in the
KV buckets named here), the image-cache's requests and replies (`corral.v1.image.*`) and the node
loader's protocol (`corral.node.<node>.loader.*`)."""
from __future__ import annotations

from typing import Literal

import msgspec

from .envelope import Reply

KV_IMAGES = "corral_images"
KV_LAYERS = "corral_layers"
KV_TRACES = "corral_traces"
CHUNK_BUCKET = "corral_chunks"

DEFAULT_CHUNK = 1 << 20
MIN_CHUNK = 256 << 10
MAX_CHUNK = 4 << 20

#: what a layer's bytes are: an EROFS image (a filesystem layer), or a guest's memory and device
#: state as QEMU's migration stream (a memory snapshot's, named by `GuestMemory.layer`)
MEDIA_EROFS = "erofs"
MEDIA_GUEST_MEMORY = "qemu-migration"
MEDIA_TYPES = (MEDIA_EROFS, MEDIA_GUEST_MEMORY)


class LayerManifest(msgspec.Struct, kw_only=True):
    digest: str  # "sha256-<hex of the whole EROFS file>" (a valid KV key and path component)
    size: int
    chunk_size: int
    chunks: list[str]  # sha256 hex of each chunk, in order; the last one may be short
    created_at: float
    source: str = ""
    media_type: str = MEDIA_EROFS

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.size - i * self.chunk_size)


class GuestMemory(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A running guest (microvm, vm) saved by a memory snapshot: its RAM, whose tmpfs holds its
    writable layer, and its devices' state, as QEMU's migration stream chunked like a layer. A
    create of the image resumes it, which needs the machine it was saved from: the substrate
    (device layout), the guest kernel and initramfs, the accelerator, RAM and vCPUs; the image's
    `layers` are its read-only disks again."""

    layer: str  # digest of the stream (media type qemu-migration); not one of the image's `layers`
    substrate: str
    memory_mb: int
    disk_mb: int
    vcpus: int
    guest: str  # the guest kernel and initramfs it booted (their cache tag: kernel version and scripts)
    accel: str  # "tcg" or "kvm": a stream saved under one does not resume under the other
    append: str  # the kernel command line it booted with, given again verbatim


class ImageManifest(msgspec.Struct, kw_only=True):
    name: str
    layers: list[str]  # layer digests, bottom first
    created_at: float
    size: int = 0
    labels: dict[str, str] = {}
    parent: str = ""  # the image this one was composed on, if any
    memory: GuestMemory | None = None  # a memory snapshot's saved guest (creates resume it)


class TraceRead(msgspec.Struct, array_like=True):
    layer: str
    chunk: int


class Trace(msgspec.Struct, kw_only=True):
    """Chunks an image's first start touched, in first-access order (replayed as prefetch)."""

    image: str
    reads: list[TraceRead]
    recorded_at: float
    node: str = ""


# ----- the node loader's protocol -----

LOADER_OPS = ("prepare", "release", "stats", "evict")  # subjects.node_loader(node, op)


class LoaderPrepare(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Make the layers visible as `<mount>/<digest>` and count one use of each (until release).
    `image` (may be empty) selects the prefetch trace to replay, or to record if none exists."""

    image: str = ""
    layers: list[str]


class LoaderRelease(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    layers: list[str]


class LoaderEvict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    layer: str | None = None


# ----- corral.v1.image.* -----

ImportSource = Literal["dir", "tar", "docker_archive", "upper", "layers", "builtin", "snapshot"]


class ImportRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`path` is on the image-cache's machine (the embedded stack shares one machine)."""

    name: str
    source: ImportSource
    path: str = ""
    base: str = ""  # compose on top of this image's layers
    layers: list[str] = []  # sources "layers" and "snapshot": existing layer digests, bottom first
    labels: dict[str, str] = {}
    chunk_size: int = DEFAULT_CHUNK
    #: source "snapshot": the layer a node-agent built from a sandbox's writable layer, its chunks
    #: uploaded already (the data plane stays on the node); the image-cache registers it on top
    #: of `layers`, so only the image-cache writes the catalog
    layer: LayerManifest | None = None
    parent: str = ""  # the image the new one was made from (recorded; its layers are not added)
    #: source "snapshot" of a guest's memory: `layer` is its migration stream, registered as
    #: `memory.layer` and not added to the image's layers (`layers` are the guest's disks)
    memory: GuestMemory | None = None


class NameRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class LayerSummary(msgspec.Struct, kw_only=True):
    digest: str
    size: int
    chunk_size: int
    chunks: int
    unique_chunks: int
    source: str
    created_at: float


class ImportReply(Reply, kw_only=True):
    image: ImageManifest
    layers: list[LayerSummary] = []  # the layers this import added (not those it reused)
    uploaded_bytes: int = 0  # chunk bytes not already in the store


class ImageListReply(Reply, kw_only=True):
    images: list[ImageManifest] = []


class InspectReply(Reply, kw_only=True):
    image: ImageManifest
    layers: list[LayerSummary] = []
    trace_chunks: int = 0  # chunks in the image's recorded prefetch trace (0: none recorded yet)


class ImageDeleteReply(Reply, kw_only=True):
    name: str
    freed_layers: int = 0
    freed_chunks: int = 0


# ----- the node loader's replies -----


class PrepareReply(Reply, kw_only=True):
    paths: dict[str, str] = {}  # layer digest -> where its EROFS file is visible on the node
    prefetch_chunks: int = 0  # chunks queued from the image's trace
    recording: bool = False  # no trace yet: this start's reads are being recorded as one


class ReleaseReply(Reply, kw_only=True):
    released: list[str] = []
    not_prepared: list[str] = []


class EvictReply(Reply, kw_only=True):
    evicted: list[str] = []
    cache_bytes: int = 0


class FetchLatency(msgspec.Struct, kw_only=True):
    """Chunk fetch latency in milliseconds over the loader's recent fetches."""

    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    n: int = 0


class LoaderLayerStats(msgspec.Struct, kw_only=True):
    size: int
    chunk_size: int
    chunks: int
    cached_chunks: int
    cached_bytes: int
    fetched_chunks: int
    refs: int  # prepares not released
    visible: bool
    last_used: float


class LoaderStats(Reply, kw_only=True):
    node: str
    mount: str
    bytes_fetched: int = 0
    fetches: int = 0
    fetches_demand: int = 0
    fetches_prefetch: int = 0
    fetches_fill: int = 0
    fetch_errors: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    chunk_joins: int = 0
    prefetched_chunks: int = 0
    readahead_chunks: int = 0
    filled_chunks: int = 0
    local_copies: int = 0
    evictions: int = 0
    read_errors: int = 0
    cache_bytes: int = 0
    cache_max_bytes: int = 0
    fetch_ms: FetchLatency = msgspec.field(default_factory=FetchLatency)
    queued: dict[str, int] = {}  # chunk fetches waiting to start, by priority (demand, prefetch, fill)
    inflight: int = 0
    pending: int = 0  # chunk loads not finished (fetching, verifying or writing)
    recording: list[str] = []
    layers: dict[str, LoaderLayerStats] = {}
