"""Build progress on the bus: one EnvProgress per stage on `corral.env.progress.<build_id>`."""
from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS

from corral_common import logs
from corral_common.contract import subjects
from corral_common.contract.envs import EnvProgress, Stage
from corral_common.contract.messages import encoder

log = logging.getLogger("corral.env")


class Progress:
    def __init__(self, nc: NATS, build_id: str, name: str):
        self.nc, self.build_id, self.name = nc, build_id, name
        self.subject = subjects.env_progress(build_id)

    async def __call__(self, stage: Stage, fraction: float, message: str = "") -> None:
        ev = EnvProgress(build_id=self.build_id, name=self.name, stage=stage, message=message,
                         fraction=round(min(1.0, max(0.0, fraction)), 3), ts=time.time())
        logs.kv(log, logging.INFO, "build progress", build=self.build_id, env=self.name, stage=stage, message=message)
        try:
            await self.nc.publish(self.subject, encoder.encode(ev))
        except Exception:
            pass  # progress is advisory; the build goes on
