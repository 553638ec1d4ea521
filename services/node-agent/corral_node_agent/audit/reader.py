"""One read loop for all of the node's fanotify groups.

A node has up to three groups: the permission group of protected paths and canaries
(fanotify.py; FAN_CLASS_CONTENT, on which the kernel refuses FID reporting) and the two
notification groups of file activity (files.py: FID mode and fd mode). They cannot be one group,
but their events share one framing (fanotify_event_metadata, then info records) and one way of
being read: non-blocking, EINTR retried, a bounded number of reads per wakeup so that one busy
group cannot starve the event loop (the loop's reader is level-triggered: it comes back for the
rest), every event fd closed once its handler returned, and a handler's failure costing only
its event. Each group registers a handler here; this module is the only place that reads them."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
import time
from collections.abc import Callable

log = logging.getLogger("corral.node.fanotify")

METADATA = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid

#: (mask, event fd or FAN_NOFD, pid, buffer, start of the info records, end of the event, monotonic
#: time of the read). The reader closes the event fd after the handler returned: a permission
#: handler writes its answer before that.
Handler = Callable[[int, int, int, bytes, int, int, float], None]


class FanotifyReader:
    def __init__(self) -> None:
        self.groups: dict[int, tuple[Handler, int, int]] = {}  # group fd -> (handler, read size, reads per wakeup)

    def add(self, fd: int, handler: Handler, bufsize: int = 1 << 16, max_reads: int = 64) -> None:
        self.groups[fd] = (handler, bufsize, max_reads)
        asyncio.get_running_loop().add_reader(fd, self.read, fd)

    def remove(self, fd: int) -> None:
        if self.groups.pop(fd, None) is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(fd)
        except (RuntimeError, ValueError):
            pass  # no running loop (closing after it stopped): nothing is registered any more

    def drain(self, fd: int, rounds: int = 1000) -> None:
        """Read until the group's queue is found empty (or `rounds` bounded reads went by)."""
        for _ in range(rounds):
            if self.read(fd):
                return

    def read(self, fd: int) -> bool:
        """Read up to the group's reads-per-wakeup buffers and hand each event to its handler;
        True when the queue was found empty."""
        group = self.groups.get(fd)
        if group is None:
            return True
        handler, bufsize, max_reads = group
        for _ in range(max_reads):
            try:
                buf = os.read(fd, bufsize)
            except BlockingIOError:
                return True
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                log.warning("fanotify read failed", extra={"fields": {"error": str(e)}})
                return True
            if not buf:
                return True
            now = time.monotonic()
            off = 0
            while off + METADATA.size <= len(buf):
                event_len, _vers, _res, mlen, mask, efd, pid = METADATA.unpack_from(buf, off)
                if event_len < METADATA.size:
                    break
                try:
                    handler(mask, efd, pid, buf, off + mlen, off + event_len, now)
                except Exception:
                    log.exception("bad fanotify event")
                finally:
                    if efd >= 0:
                        os.close(efd)
                off += event_len
        return False
