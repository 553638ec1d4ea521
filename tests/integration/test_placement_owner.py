"""A placement is removed only by its owner, on a real JetStream KV bucket.

One id can name a sandbox on another node by then: a batch's ids follow from its request_id, so a
batch asked again while a node was declared lost makes the same ids elsewhere. The node, back or
restarted and cleaning up what died with it, must not delete those placements, nor may a
scheduler replica whose table is behind the bucket when it deletes a lost node's placements."""
from __future__ import annotations

import secrets
import time

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError

from corral_common.contract.messages import SandboxInfo, SandboxSpec, encoder
from corral_node_agent.placements import Placements as NodePlacements
from corral_node_agent.substrates.base import Sandbox
from corral_scheduler.placements import Placements as SchedulerPlacements


@pytest.fixture
async def kv(nc):
    js = nc.jetstream()
    bucket = f"test-placements-{secrets.token_hex(4)}"
    yield await js.create_key_value(bucket=bucket)
    await js.delete_key_value(bucket)


def _info(sid: str, node: str) -> SandboxInfo:
    now = time.time()
    return SandboxInfo(id=sid, node=node, state="running", substrate="container", image="busybox", created_at=now, expires_at=now + 60)


async def _node_of(kv, sid: str) -> str | None:
    try:
        e = await kv.get(sid)
    except KeyNotFoundError:
        return None
    return None if e is None or not e.value else msgspec.json.decode(e.value, type=SandboxInfo).node


async def test_a_node_deletes_its_own_placement_and_leaves_another_nodes(kv):
    a, b = NodePlacements(kv, "node-a"), NodePlacements(kv, "node-b")
    mine, theirs, retaken = (f"sb-{secrets.token_hex(6)}" for _ in range(3))
    a.record(Sandbox(_info(mine, "node-a"), SandboxSpec()))
    await a.written(mine)
    await kv.put(theirs, encoder.encode(_info(theirs, "node-b")))
    await a.delete(theirs)  # a restarted node cleaning an id it once had, made again on node-b
    assert await _node_of(kv, theirs) == "node-b"
    # written by node-a, then made again on node-b (node-a declared lost meanwhile): node-a's
    # delete on the revision it wrote fails, and what it reads back is not its own
    a.record(Sandbox(_info(retaken, "node-a"), SandboxSpec()))
    await a.written(retaken)
    await b.put(Sandbox(_info(retaken, "node-b"), SandboxSpec()))
    await a.delete(retaken)
    assert await _node_of(kv, retaken) == "node-b"
    await a.delete(mine)
    assert await _node_of(kv, mine) is None
    await a.delete(mine)  # already gone: nothing to do, nothing raised


async def test_a_scheduler_deletes_a_lost_nodes_placement_only_while_it_is_that_nodes(kv):
    p = SchedulerPlacements(kv)
    lost, remade = f"sb-{secrets.token_hex(6)}", f"sb-{secrets.token_hex(6)}"
    await kv.put(lost, encoder.encode(_info(lost, "node-lost")))
    await kv.put(remade, encoder.encode(_info(remade, "node-other")))  # the table still says node-lost
    await p.delete_lost(lost, "node-lost")
    await p.delete_lost(remade, "node-lost")
    assert await _node_of(kv, lost) is None
    assert await _node_of(kv, remade) == "node-other"
    await p.delete_lost(f"sb-{secrets.token_hex(6)}", "node-lost")  # no such key: nothing raised
