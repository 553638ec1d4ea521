"""Raw block devices and filesystem debuggers: debugfs, reading /dev/sdX, /dev/loopN, /dev/mem,
mknod of devices. These bypass every path-based protection."""
from __future__ import annotations

import re

from corral_common.contract.audit import AuditEvent

from . import register
from .base import Rule, commands

_DEV = re.compile(r"/dev/(sd[a-z]+\d*|vd[a-z]+\d*|xvd[a-z]+\d*|hd[a-z]\d*|nvme\d+(n\d+)?(p\d+)?|loop\d+|dm-\d+|mapper/\S+|md\d+"
                  r"|mmcblk\d+\S*|disk/\S+|block/\S+|mem\b|kmem\b|port\b|sg\d+|root\b)")
_TOOLS = {"debugfs", "mknod", "losetup", "blockdev", "sg_raw", "fdisk", "sfdisk", "parted", "tune2fs", "dumpe2fs",
          "e2image", "icat", "blkcat", "fls", "ntfscat", "xfs_db", "btrfs-debug-tree"}


@register
class RawDeviceAccess(Rule):
    name = "raw_device_access"
    severity = "critical"
    description = "filesystem debuggers (debugfs, xfs_db) and raw block or memory devices (/dev/sdX, /dev/loopN, /dev/mem, mknod)"
    kinds = frozenset({"exec", "file"})
    words = frozenset({"dev", "debugfs", "mknod", "losetup", "blockdev", "sg", "fdisk", "sfdisk", "parted", "tune2fs", "dumpe2fs",
                       "e2image", "icat", "blkcat", "fls", "ntfscat", "xfs", "btrfs"})

    def match(self, ev: AuditEvent) -> str | None:
        if ev.kind == "file":
            m = _DEV.match(ev.path)
            return f"{ev.op or 'access'} of raw device {ev.path} by {ev.comm or 'pid'} {ev.pid}" if m else None
        for s in commands(ev):
            if s.prog in _TOOLS:
                return f"{s.prog} reaches below the filesystem: {ev.cmd[:200]}"
        m = _DEV.search(ev.cmd)
        if m:
            return f"touches raw device {m.group(0)}: {ev.cmd[:200]}"
        return None
