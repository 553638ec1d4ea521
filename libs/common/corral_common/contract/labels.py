"""Every label key corral reads or writes, in one place.

A label key is `corral.<word>`: one word after `corral.`, never a further dot, used as a key of a
sandbox's `labels` dict (SandboxSpec.labels, stored with the sandbox and carried on its audit
events) or of a Docker object's labels. Subjects, by contrast, always have a further token
(`corral.node.<node>.create`) and live in subjects.py; tests/unit/test_subjects_in_one_place.py
tells the two apart by exactly that shape and fails on either spelled outside its module.
"""
from __future__ import annotations

# environments (env-builder): which environment (and version) a sandbox belongs to
ENV = "corral.env"
ENV_VERSION = "corral.env_version"
ROLE = "corral.role"  # env-build | env-verify-* | env-grade: what the env-builder made a sandbox for
BUILD = "corral.build"  # the build id of an env-build sandbox
GRADED = "corral.graded"  # the rollout sandbox an env-grade sandbox grades

# the monitor: secrets of a sandbox it should alarm on when read (comma-separated paths)
PROTECTED_PATHS = "corral.protected_paths"
CANARIES = "corral.canaries"

# the docker substrate's labels on its containers: reconciliation after a crash finds its own by them
DOCKER_NODE = "corral.node"
DOCKER_STATE = "corral.state"
DOCKER_SANDBOX = "corral.sandbox"
DOCKER_JOB = "corral.job"
DOCKER_USER_PREFIX = "corral.label."  # + a SandboxSpec label key: the user's own labels

# set by the node on a sandbox with an egress allowlist ("allowlist"; a spec's own is dropped), so
# its audit events carry it: there, only connects the node's policy refused are misbehaviour (the
# monitor's network_egress rule)
NETWORK = "corral.network"

# set by the node on a tenant's sandbox (a spec's own is dropped): its audit events, and so the
# alerts on them, name the tenant, which hears them on subjects.tenant_alert
TENANT = "corral.tenant"

# set by the node on a fork (SandboxSpec.fork_of; a spec's own is dropped): the sandbox it was
# forked from, whose files it started with
FORK_OF = "corral.fork_of"

# the edge adapter a sandbox was made for (the SandboxFusion gateway: "sandbox-fusion")
ADAPTER = "corral.adapter"
