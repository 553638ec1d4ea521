"""Forks of a `container` sandbox: a new sandbox on the same node and image whose writable layer
starts as a copy of the source's, taken while the source is frozen.

Why a copy and not a shared sealed layer: the source keeps running on its own overlay, whose
upper it writes in place (an overlay's layers cannot be changed under a mounted overlay, and a
running container's root cannot be swapped), so anything the fork shared with it would change
under the fork. The upper is on tmpfs, which has no reflinks; the copy is a `cp -a` of what
the source wrote, whiteouts, opaque-dir xattrs and owners included (zero-filled blocks left as
holes: the fork's disk holds no more than the data), into the
fork's own tmpfs before its overlay is mounted over it. It costs what the source wrote (about
50 ms for 256 MiB here, into a tmpfs with large folios: container_sandbox.LARGE_FOLIOS_OPT), not
the image. Processes and memory are not copied (no CRIU on
this kernel)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from corral_common import metrics
from corral_common.contract.errors import Conflict, InvalidRequest

from .container_sandbox import ContainerSandbox

#: what the copy's error output keeps for the reply
ERROR_TAIL = 600

log = logging.getLogger("corral.node.fork")

COPY_SECONDS = metrics.histogram("corral_fork_copy_seconds", "Time to copy a fork's source's files (the source frozen meanwhile)",
                                 ("node",), buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


async def copy_upper(source: ContainerSandbox, dest: str, disk_mb: int) -> None:
    """Copy the (frozen) source's upper dir into `dest`, the fork's empty upper: everything
    as it is on disk (owners as the sandbox's ids, modes, xattrs, hard links, holes, symlinks
    not followed), with the upper's own attributes too."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", "--preserve=all", "--reflink=never", "--sparse=always", "--", f"{source.rw}/upper/.", dest,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode == 0:
        took = time.perf_counter() - t0
        COPY_SECONDS.labels(source.info.node).observe(took)
        log.info("fork copied its source's files", extra={"fields": {"source": source.id, "copy_ms": round(took * 1000, 1)}})
        return
    text = err.decode(errors="replace").strip()
    if "No space left" in text:
        raise InvalidRequest(f"the files sandbox {source.id} wrote do not fit the fork's disk_mb={disk_mb}; "
                             "ask for more (at least what the source's disk holds)")
    if "No such file" in text and f"/proc/{source.init_pid}/" in text:
        raise Conflict(f"sandbox {source.id} ended while it was being forked")
    raise InvalidRequest(f"sandbox {source.id} could not be forked: {text[-ERROR_TAIL:]}")
