"""The rule registry: each detection rule is one small class in its own module, registered with
`@register` (stream rules, `Rule`) or `@register_sql` (windowed rules, `SqlRule`).

    rules = build(RuleContext(protected=["/secret"]))
    for r in rules:
        if r.applies(ev) and (msg := r.match(ev)):
            ...
"""
from __future__ import annotations

from corral_common.contract.audit import RuleInfo

from .base import Rule, RuleContext, SqlRule

REGISTRY: dict[str, type[Rule]] = {}
SQL_REGISTRY: dict[str, type[SqlRule]] = {}


def register(cls: type[Rule]) -> type[Rule]:
    if cls.name in REGISTRY or cls.name in SQL_REGISTRY:
        raise ValueError(f"duplicate rule name {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def register_sql(cls: type[SqlRule]) -> type[SqlRule]:
    if cls.name in REGISTRY or cls.name in SQL_REGISTRY:
        raise ValueError(f"duplicate rule name {cls.name!r}")
    SQL_REGISTRY[cls.name] = cls
    return cls


def build(ctx: RuleContext | None = None, only: list[str] | None = None) -> list[Rule]:
    ctx = ctx or RuleContext()
    return [cls(ctx) for name, cls in REGISTRY.items() if not only or name in only]


def build_sql(only: list[str] | None = None) -> list[SqlRule]:
    return [cls() for name, cls in SQL_REGISTRY.items() if not only or name in only]


def describe() -> list[RuleInfo]:
    out = [RuleInfo(name=c.name, severity=c.severity, kind="stream", description=c.description) for c in REGISTRY.values()]
    out += [RuleInfo(name=c.name, severity=c.severity, kind="window", description=c.description) for c in SQL_REGISTRY.values()]
    return out


# importing a module registers its rules
from . import (  # noqa: E402,F401
    audit_incomplete,
    canary,
    denial_burst,
    denied_syscall,
    fork_bomb,
    git_history,
    handle_blockmap,
    kill_foreign,
    mass_deletion,
    mass_file_rewrite,
    memory_bomb,
    network_egress,
    network_probe,
    proc_snooping,
    protected_paths,
    ptrace,
    raw_device,
    site_packages,
    test_tampering,
)

__all__ = ["REGISTRY", "SQL_REGISTRY", "Rule", "RuleContext", "SqlRule", "build", "build_sql", "describe", "register", "register_sql"]
