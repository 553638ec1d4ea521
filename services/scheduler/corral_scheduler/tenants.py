"""A create's tenant comes from the caller's authenticated account (corral_common.tenancy), never
from the spec it sent: the scheduler stamps it on the spec the node builds from, and scopes the
request id and the job to it, so that one tenant's retry key can neither reach nor block another's
sandbox, and its jobs' quotas and fair share are its own."""
from __future__ import annotations

import msgspec
from nats.aio.msg import Msg

from corral_common import tenancy
from corral_common.contract.messages import SandboxSpec


def stamp(msg: Msg, spec: SandboxSpec) -> SandboxSpec:
    """`spec` as the caller may have it: a tenant's own name in `tenant` (whatever it wrote
    there), its request id prefixed with it and its job qualified (tenancy.qualify_job); the
    operator's as sent (it may create for a tenant)."""
    who = tenancy.caller(msg)
    if who is None:
        return spec
    rid = f"{who}:{spec.request_id}" if spec.request_id else ""
    return msgspec.structs.replace(spec, tenant=who, request_id=rid, job=tenancy.qualify_job(who, spec.job))
