"""Syscalls the sandbox's seccomp policy denies (mount, bpf, keyctl, perf_event_open, userfaultfd,
unshare, setns, ...): probing the walls. ptrace/process_vm_* and handle/block-map calls have their
own, more specific rules."""
from __future__ import annotations

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule
from .handle_blockmap import HANDLE_SYSCALLS
from .ptrace import SYSCALLS as PTRACE_SYSCALLS


@register
class DeniedSyscall(Rule):
    name = "denied_syscall"
    severity = "medium"
    description = "a syscall denied by the sandbox's seccomp policy (mount, bpf, keyctl, perf_event_open, userfaultfd, unshare, ...)"
    kinds = frozenset({"syscall"})

    def match(self, ev: AuditEvent) -> str | None:
        if not ev.denied or ev.syscall in PTRACE_SYSCALLS or ev.syscall in HANDLE_SYSCALLS:
            return None
        if "FIEMAP" in ev.op.upper() or "GETFSMAP" in ev.op.upper():
            return None
        return f"denied syscall {ev.syscall or '?'}{' ' + ev.op if ev.op else ''} by {ev.comm or 'pid'} {ev.pid}"
