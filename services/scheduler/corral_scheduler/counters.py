"""The scheduler's Prometheus series, in one place because creates, batches and runs all count
into the same ones (a placement is a placement whichever path made it)."""
from __future__ import annotations

from corral_common import metrics

PLACEMENTS = metrics.counter("corral_scheduler_placements_total", "Sandboxes placed", ("node",))
REJECTIONS = metrics.counter("corral_scheduler_rejections_total", "Create requests refused", ("code",))
BATCH_SECONDS = metrics.histogram("corral_scheduler_batch_seconds", "Time to place a create_batch")
NODES_ALIVE = metrics.gauge("corral_scheduler_nodes_alive", "Nodes with a recent heartbeat")
