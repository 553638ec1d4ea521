"""Claiming a single create's placement before the sandbox is announced.

The scheduler may give up on a node that answers a create late (its `node_timeout_s`) and ask
another node for the same sandbox id. Both nodes can then build it. Whichever claims the
placement key first with a KV create (compare-and-set on "no such key") owns the id; the other
finds the key taken, destroys what it built and answers `conflict` naming the owner, so one id
never names two live sandboxes. (Batch items claim the same key before they are made: see
handlers/batch.py; such an item arrives here already claimed.)"""
from __future__ import annotations

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common.contract.messages import SandboxInfo, encoder


class _NodeOf(msgspec.Struct, forbid_unknown_fields=False):
    node: str = ""


_node_of = msgspec.json.Decoder(_NodeOf)


async def claim_placement(kv: KeyValue, info: SandboxInfo) -> str:
    """Write `info` as the placement of its id unless another node holds it. Returns "" when the
    placement is this node's now (written, or already naming this node), else the owner's name.
    Errors other than a taken key propagate: without a recorded placement the create must fail."""
    data = encoder.encode(info)
    for _ in range(3):
        try:
            await kv.create(info.id, data)
            return ""
        except KeyWrongLastSequenceError:
            pass
        try:
            e = await kv.get(info.id)
        except KeyNotFoundError:
            continue  # deleted in between (a destroyed claim): try again
        if e is None or not e.value:
            continue
        try:
            owner = _node_of.decode(e.value).node
        except (msgspec.DecodeError, msgspec.ValidationError):
            owner = ""
        if owner == info.node:
            await kv.put(info.id, data)  # ours (a repeated request): bring it up to date
            return ""
        return owner or "another node"
    return "another node"
