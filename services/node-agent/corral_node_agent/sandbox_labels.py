"""The labels a sandbox carries, and with them every audit event of it: the spec's own, plus those
only the node sets (a spec's own value for them is dropped), which tell the monitor what holds
for the sandbox: an egress allowlist is in force (labels.NETWORK), whose tenant it is
(labels.TENANT: its alerts go to that tenant too), which sandbox a fork started from
(labels.FORK_OF)."""
from __future__ import annotations

from corral_common.contract import labels
from corral_common.contract.messages import SandboxSpec

NODE_SET = (labels.NETWORK, labels.TENANT, labels.FORK_OF)


def sandbox_labels(spec: SandboxSpec) -> dict[str, str]:
    out = {k: v for k, v in spec.labels.items() if k not in NODE_SET}
    if spec.network == "allowlist":
        out[labels.NETWORK] = "allowlist"
    if spec.tenant:
        out[labels.TENANT] = spec.tenant
    if spec.fork_of:
        out[labels.FORK_OF] = spec.fork_of
    return out
