"""Configuration shared by every service: flags fall back to CORRAL_* environment variables."""
from __future__ import annotations

import os
import re
import socket

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# how many copies JetStream keeps of each stream, KV bucket and object store a service creates: 1
# on one server, 3 on a cluster (set for every service of a cluster deployment)
REPLICAS_ENV = "CORRAL_JS_REPLICAS"
# host uid ranges claimed by sandboxes' user namespaces, one file per range holding the claiming
# node-agent's sandboxes dir (node-agent userns.py claims them; a stopped stack's are swept)
UID_RANGES_DIR = "/run/corral/uid-ranges"


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


def js_replicas() -> int:
    n = env_int(REPLICAS_ENV, 1)
    if not 1 <= n <= 5:
        raise ValueError(f"{REPLICAS_ENV}={n}: JetStream keeps 1 to 5 replicas")
    return n


def node_id(explicit: str | None = None) -> str:
    """A node's id as every service of that node spells it (node-agent, image loader): `--node`,
    else $CORRAL_NODE, else the host name; lower-cased, anything but [a-z0-9-] turned into `-`
    (it is a NATS subject token: `ip-10-0-1-2.ec2.internal` would otherwise be three)."""
    raw = explicit or os.environ.get("CORRAL_NODE") or socket.gethostname()
    return re.sub(r"[^a-z0-9-]", "-", raw.lower())
