"""The node's audit buffer is shared by all its sandboxes; when it is full, the sandbox holding the
most loses its oldest events, so a sandbox flooding its own audit cannot evict a neighbour's."""
from __future__ import annotations

import time

from corral_common.contract.audit import AuditEvent, event_id
from corral_node_agent.audit.log import BUFFER_FULL, AuditLog


def _ev(sid: str, i: int) -> AuditEvent:
    return AuditEvent(id=event_id(), ts=time.time(), node="n", sandbox=sid, kind="exec", cmd=f"c{i}")


def test_a_flooding_sandbox_loses_only_its_own_events():
    log = AuditLog(js=None, node="n", max_buffer=1000)  # type: ignore[arg-type]  # nothing is published here
    for i in range(100):
        log.emit(_ev("quiet", i))  # first in: the oldest events of the node
    for i in range(20_000):
        log.emit(_ev("flood", i))
        if i % 50 == 0:
            log.emit(_ev("steady", i))
    assert [e.cmd for e in log.pending["quiet"]] == [f"c{i}" for i in range(100)]
    assert len(log.pending["steady"]) == 400
    assert log.npending == sum(len(q) for q in log.pending.values()) <= 1000
    assert log.stats["quiet"].lost == 0 and log.stats["steady"].lost == 0
    flood = log.stats["flood"]
    assert flood.lost == 20_000 - len(log.pending["flood"]) and flood.reasons == [BUFFER_FULL]
    # what the flood kept is its newest, in order
    kept = [int(e.cmd[1:]) for e in log.pending["flood"]]
    assert kept == list(range(20_000 - len(kept), 20_000))
