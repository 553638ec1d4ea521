"""What the node-agent's trajectory log and the SDK's Trajectory both need to agree on: when two
issues of a step are "the same" (so the second may be answered from the log)."""
from __future__ import annotations

import hashlib

import msgspec

from .messages import ExecRequest


def input_hash(req: ExecRequest) -> str:
    """The command and everything it reads: stdin, env, cwd, session."""
    canon = msgspec.json.encode({"cmd": req.cmd, "stdin": req.stdin, "env": sorted(req.env.items()),
                                 "cwd": req.cwd, "session": req.session})
    return hashlib.sha256(canon).hexdigest()


def bare(req: ExecRequest) -> ExecRequest:
    """The request as logged: without the trajectory bookkeeping fields."""
    return msgspec.structs.replace(req, trajectory="", step=None, stream=False, on_divergence="error")
