"""Reaching file contents sideways: by file handle (open_by_handle_at / name_to_handle_at) or by
the file's block map (FIEMAP / FIBMAP / FS_IOC_GETFSMAP ioctls, filefrag, hdparm --fibmap,
xfs_io fiemap), which can find a protected file's data without opening it by path."""
from __future__ import annotations

import re

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, commands

HANDLE_SYSCALLS = {"open_by_handle_at", "name_to_handle_at"}
_IOCTL = re.compile(r"FIEMAP|FIBMAP|GETFSMAP|FS_IOC_FIEMAP|FS_IOC_GETFSMAP", re.I)
_CODE = re.compile(r"\b(open_by_handle_at|name_to_handle_at|FS_IOC_FIEMAP|FS_IOC_GETFSMAP|FIEMAP|FIBMAP)\b")


@register
class HandleOrBlockmapAccess(Rule):
    name = "handle_or_blockmap_access"
    severity = "critical"
    description = "file access by handle (open_by_handle_at) or block map (FIEMAP/FIBMAP/GETFSMAP, filefrag, hdparm --fibmap)"
    kinds = frozenset({"exec", "syscall"})
    words = frozenset({"filefrag", "hdparm", "xfs", "handle", "FIEMAP", "FIBMAP", "GETFSMAP"})

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "syscall":
            names = " ".join([ev.syscall, ev.op, ev.detail.get("ioctl", ""), ev.detail.get("request", "")])
            if ev.syscall in HANDLE_SYSCALLS:
                return f"{ev.syscall} by {ev.comm or 'pid'} {ev.pid} ({'denied' if ev.denied else 'allowed'}) {ev.path}".rstrip()
            m = _IOCTL.search(names)
            if m:
                return f"block-map ioctl {m.group(0)} by {ev.comm or 'pid'} {ev.pid} ({'denied' if ev.denied else 'allowed'}) {ev.path}".rstrip()
            return None
        for s in commands(ev):
            p, a = s.prog, s.args
            if p == "filefrag":
                return f"maps a file's blocks (filefrag): {ev.cmd[:200]}"
            if p == "hdparm" and any(x in ("--fibmap",) for x in a):
                return f"maps a file's blocks (hdparm --fibmap): {ev.cmd[:200]}"
            if p == "xfs_io" and re.search(r"\b(fiemap|bmap)\b", " ".join(a)):
                return f"maps a file's blocks (xfs_io): {ev.cmd[:200]}"
        m = _CODE.search(ev.cmd)
        if m:
            return f"uses {m.group(1)} to reach a file sideways: {ev.cmd[:200]}"
        return None
