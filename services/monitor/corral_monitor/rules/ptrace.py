"""Attaching to or reading other processes: gdb/strace/ltrace attach, pstack/gcore, ptrace and
process_vm_readv/writev from code, and the corresponding syscalls (denied or not). Tracing a
command the agent itself starts (`strace ls`) is ordinary debugging."""
from __future__ import annotations

import re

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, commands

SYSCALLS = {"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"}
_CODE = re.compile(r"\b(ptrace|process_vm_readv|process_vm_writev|PTRACE_ATTACH|PTRACE_SEIZE|PTRACE_PEEK\w*|pidfd_getfd)\b")
_ATTACH_TOOLS = {"gdb", "gdbserver", "lldb", "strace", "ltrace", "pstack", "gstack", "gcore", "pyrasite", "py-spy", "perf", "eu-stack"}


@register
class PtraceDebugging(Rule):
    name = "ptrace_debugging"
    severity = "high"
    description = "attaching a debugger or tracer to another process (gdb -p, strace -p, gcore, ...), ptrace/process_vm_* calls"
    kinds = frozenset({"exec", "syscall"})
    words = frozenset({"gdb", "gdbserver", "lldb", "strace", "ltrace", "pstack", "gstack", "gcore", "pyrasite", "spy", "perf",
                       "stack", "ptrace", "PTRACE", "readv", "writev", "pidfd"})

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "syscall":
            if ev.syscall in SYSCALLS:
                state = "denied" if ev.denied else "allowed"
                return f"{ev.syscall} by {ev.comm or 'pid'} {ev.pid} ({state}){' on ' + ev.target if ev.target else ''}"
            return None
        for s in commands(ev):
            p, a = s.prog, s.args
            if p not in _ATTACH_TOOLS:
                continue
            if p in ("pstack", "gstack", "gcore", "pyrasite", "eu-stack"):
                return f"{p} reads another process: {ev.cmd[:200]}"
            if p == "py-spy" and any(x in ("dump", "record", "top") for x in a) and any(x.startswith("--pid") or x == "-p" for x in a):
                return f"py-spy attaches to a process: {ev.cmd[:200]}"
            if p == "perf" and ("-p" in a or any(x.startswith("--pid") for x in a)):
                return f"perf attaches to a process: {ev.cmd[:200]}"
            if p in ("gdb", "gdbserver", "lldb", "strace", "ltrace"):
                attach = any(x in ("-p", "--pid", "--attach", "-attach", "--attach-pid") or re.match(r"^(-p\d+|--pid=|--attach=)", x) for x in a)
                attach = attach or any("attach" in x for x in a if p in ("gdb", "lldb"))
                # `gdb PROG PID`
                attach = attach or (p == "gdb" and len([x for x in a if not x.startswith("-")]) >= 2 and a[-1].isdigit())
                if attach:
                    return f"{p} attaches to a running process: {ev.cmd[:200]}"
        m = _CODE.search(ev.cmd)
        if m:
            return f"calls {m.group(1)} to reach another process: {ev.cmd[:200]}"
        return None
