"""A guest's writable layer on the host, for `changes` and snapshots of microvm and vm sandboxes.

The layer is an overlay upper directory on a tmpfs inside the guest, which the host cannot see.
The guest agent (the guest's root, out of the sandbox's reach: init/corral-guest.c) sends it as
a tar made with the sandbox's processes frozen, plus the list of opaque directories (an xattr a
tar does not carry); here it becomes a directory in overlayfs format again (whiteouts as 0/0
character devices, opaque directories marked), which changes.py and the snapshot's layer builder
read exactly as they read a container's upper.

The tar's names, links, owners and modes are the sandbox's choices: nothing is extracted outside
the directory (no absolute or `..` name, no write through a link made earlier in the archive, no
hard link to a file outside it) and no device but a whiteout is made. Modes are kept as they
are (the layer is the sandbox's, setuid bits and sticky /tmp included); the directory is root's
and private to the node."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import AsyncIterator

from ..changes import OPAQUE_XATTR
from .microvm_channel import GuestChannel

log = logging.getLogger("corral.node.microvm")


@contextlib.asynccontextmanager
async def pulled(chan: GuestChannel, work_dir: str, timeout_s: float) -> AsyncIterator[str]:
    """While entered: the guest's writable layer as a directory under `work_dir`."""
    tmp = tempfile.mkdtemp(prefix="upper-", dir=work_dir)
    try:
        opaque = await chan.upper(f"{tmp}/upper.tar", timeout_s)
        dest = f"{tmp}/upper"
        skipped = await asyncio.to_thread(unpack, f"{tmp}/upper.tar", dest, opaque)
        if skipped:
            log.warning("guest upper: entries not unpacked", extra={"fields": {"skipped": skipped[:20], "count": len(skipped)}})
        yield dest
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)


def unpack(tar_path: str, dest: str, opaque: bytes) -> list[str]:
    """Extract the guest's tar into `dest` (made here, in a private dir) and mark its opaque
    directories. Returns the names of the entries it refused."""
    os.mkdir(dest)
    dest = os.path.realpath(dest)
    skipped: list[str] = []

    def inside(name: str) -> bool:
        p = os.path.realpath(os.path.join(dest, name))
        return p == dest or p.startswith(dest + os.sep)

    def admit(m: tarfile.TarInfo, _path: str) -> tarfile.TarInfo | None:
        name = m.name.lstrip("/")
        ok = inside(name) and not m.isblk() and not (m.ischr() and (m.devmajor, m.devminor) != (0, 0))
        if ok and m.islnk():
            ok = inside(m.linkname.lstrip("/"))
        if not ok:
            skipped.append(m.name)
            return None
        return m.replace(name=name, linkname=m.linkname.lstrip("/") if m.islnk() else m.linkname, deep=False)

    with tarfile.open(tar_path, "r:") as tf:
        tf.extractall(dest, numeric_owner=True, filter=admit)
    for rel in opaque.split(b"\0"):
        if not rel:
            continue
        p = os.path.join(dest, os.fsdecode(rel))
        if inside(os.fsdecode(rel)) and os.path.realpath(p) == os.path.normpath(p) and os.path.isdir(p):
            os.setxattr(p, OPAQUE_XATTR, b"y", follow_symlinks=False)
    return skipped
