"""The loader's settings (`python -m corral_image_cache.loader --help` documents each)."""
from __future__ import annotations

import msgspec


class LoaderConfig(msgspec.Struct, kw_only=True):
    nats_url: str
    node: str
    mount: str
    cache_dir: str
    cache_max_mb: int = 0  # 0: no cap
    fetch_parallel: int = 8
    chunk_backend: str = "nats"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    trace_window_s: float = 10.0
    fetch_timeout_s: float = 10.0
    fetch_retries: int = 2
    read_timeout_s: float = 60.0
    background_fill_after_s: float = 0.0  # 0: off
    shutdown_grace_s: float = 5.0
    auto_unmount: bool = True
    entry_timeout_s: float = 1.0
    attr_timeout_s: float = 3600.0
    fuse_threads: int = 64  # libfuse worker threads (libfuse's default: 10) and kernel max_background
    readahead_chunks: int = 2  # chunks fetched ahead of a reader crossing into the next chunk (0: off)
