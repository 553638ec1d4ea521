"""Configuration shared by every service: flags fall back to CORRAL_* environment variables."""
from __future__ import annotations

import os

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("CORRAL_NATS_URL") or DEFAULT_NATS_URL


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


def state_dir(explicit: str | None = None) -> str:
    return explicit or os.environ.get("CORRAL_STATE_DIR") or "/var/lib/corral"
