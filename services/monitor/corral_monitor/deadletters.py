"""The dead-letter stream: messages and events the monitor cannot store (malformed, or failing
for a reason that is not an outage) are kept there with their source and reason, never dropped
silently and never blocking their stream."""
from __future__ import annotations

import hashlib
import logging

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError

from corral_common import config, metrics
from corral_common.contract import subjects

log = logging.getLogger("corral.monitor.consumer")

DEADLETTER_SUBJECT = subjects.DEADLETTER
DEADLETTER_STREAM = subjects.DEADLETTER_STREAM

MALFORMED = metrics.counter("corral_monitor_malformed_total", "Malformed messages or events (dead-lettered)", ("stream", "reason"))
DEADLETTERED = metrics.counter("corral_monitor_deadlettered_total", "Messages published to the dead-letter stream", ("stream",))


class DeadLetters:
    def __init__(self, js: JetStreamContext):
        self.js = js

    async def ensure(self) -> None:
        cfg = StreamConfig(name=DEADLETTER_STREAM, subjects=[DEADLETTER_SUBJECT], storage=StorageType.FILE, max_age=30 * 86400,
                           num_replicas=config.js_replicas())
        try:
            await self.js.add_stream(cfg)
        except BadRequestError:
            await self.js.update_stream(cfg)

    async def put(self, stream: str, msg: Msg, data: bytes, reason: str, error: str) -> None:
        md = msg.metadata
        headers = {
            "Corral-Source-Stream": stream,
            "Corral-Source-Subject": msg.subject,
            "Corral-Source-Seq": str(md.sequence.stream),
            "Corral-Reason": reason,
            "Corral-Error": error.replace("\r", " ").replace("\n", " ")[:500],
            # the same bad message redelivered is one dead letter
            "Nats-Msg-Id": f"dl-{stream}-{md.sequence.stream}-{hashlib.blake2b(data, digest_size=8).hexdigest()}",
        }
        await self.js.publish(DEADLETTER_SUBJECT, data, headers=headers, timeout=5)
        MALFORMED.labels(stream, reason).inc()
        DEADLETTERED.labels(stream).inc()
        log.warning("dead-lettered", extra={"fields": {"stream": stream, "subject": msg.subject, "reason": reason, "error": error[:300]}})
