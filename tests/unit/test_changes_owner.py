"""The writable-layer listing reports each entry's owner as stored, which is the sandbox's own view
(a container's upper keeps the sandbox's uids on disk, seen through an idmapped mount): what lets
the grader tell a file the harness wrote (HARNESS_UID) from one the agent made."""
from __future__ import annotations

import os

from corral_common.contract.messages import HARNESS_UID, ChangesRequest
from corral_node_agent.changes import list_changes


def test_owners_are_listed_as_stored(tmp_path):
    upper = tmp_path / "upper"
    (upper / "state").mkdir(parents=True)
    owners = {"state/orders.jsonl": HARNESS_UID, "state/agent.txt": 0, "state/other.txt": 1000}
    for rel, uid in owners.items():
        (upper / rel).write_text("x")
        os.chown(upper / rel, uid, uid)
    os.symlink("orders.jsonl", upper / "state/link")
    os.lchown(upper / "state/link", HARNESS_UID, HARNESS_UID)
    os.mkfifo(upper / "state/fifo")
    os.chown(upper / "state/fifo", 7, 7)
    got = {c.path: (c.kind, c.uid) for c in list_changes(str(upper), ChangesRequest()).changes}
    assert got == {"/state": ("dir", 0), "/state/orders.jsonl": ("file", HARNESS_UID), "/state/agent.txt": ("file", 0),
                   "/state/other.txt": ("file", 1000), "/state/link": ("symlink", HARNESS_UID), "/state/fifo": ("other", 7)}
