"""The loader's Prometheus metrics, labelled by node (one loader per node)."""
from __future__ import annotations

from corral_common import metrics

BYTES_FETCHED = metrics.counter("corral_loader_bytes_fetched_total", "Chunk bytes fetched from the chunk store", ("node", "priority"))
CHUNKS_FETCHED = metrics.counter("corral_loader_chunks_fetched_total", "Chunks fetched from the chunk store", ("node", "priority"))
CHUNK_HITS = metrics.counter("corral_loader_chunk_hits_total", "Chunk reads served from the node cache", ("node",))
CHUNK_MISSES = metrics.counter("corral_loader_chunk_misses_total",
                               "Chunk reads that had to wait: fetch (started a fetch) or inflight (joined one)", ("node", "wait"))
FETCH_SECONDS = metrics.histogram("corral_loader_fetch_seconds", "Time to fetch and verify one chunk (with retries)",
                                  ("node", "priority"),
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
FETCH_ERRORS = metrics.counter("corral_loader_fetch_errors_total", "Chunks that could not be fetched or verified", ("node", "reason"))
CACHE_BYTES = metrics.gauge("corral_loader_cache_bytes", "Bytes of chunks in the node cache", ("node",))
CACHE_MAX_BYTES = metrics.gauge("corral_loader_cache_max_bytes", "Node cache size cap (0: none)", ("node",))
PREFETCH_CHUNKS = metrics.counter("corral_loader_prefetch_chunks_total", "Chunks queued by trace replay or background fill", ("node", "kind"))
EVICTIONS = metrics.counter("corral_loader_evictions_total", "Layers evicted from the node cache", ("node",))
LAYERS_IN_USE = metrics.gauge("corral_loader_layers_in_use", "Layers prepared and not released", ("node",))
READ_ERRORS = metrics.counter("corral_loader_read_errors_total", "FUSE reads answered with EIO", ("node",))
