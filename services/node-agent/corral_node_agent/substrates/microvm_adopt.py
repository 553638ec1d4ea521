"""A restarted node-agent takes back the guests its predecessor left running.

Why this can work: QEMU runs in a session of its own (microvm_process.py) and outlives the agent;
in the guest, the agent (guest/agent.sh) reads end-of-file while no host is connected to its port
and waits for the next one, so the sandbox's state (files, sessions, background processes, the
guard and its marks) is untouched. What the guest writes meanwhile (answers nobody waits for, the
guard's reports) waits in the port until a host reads it; the reports are handed on, and what a
crash cut off mid-line is the sandbox's audit gap, which the node records for every adopted
sandbox. A guest found stopped (`stop` by QMP: paused, or a pool's) is adopted paused."""
from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import msgspec

from corral_common.contract.errors import CorralError
from corral_common.contract.messages import SandboxInfo, SandboxSpec

from .. import cgroups
from ..layermounts import ImageFiles
from . import microvm_qmp
from .microvm_channel import GuestChannel
from .microvm_process import QemuProcess

log = logging.getLogger("corral.node.microvm")

ADOPT_TIMEOUT_S = 30.0  # for the guest's agent to answer the new host (a loaded TCG host is slow; giving up destroys the guest)


class GuestRecord(msgspec.Struct):
    """`sandbox.json` of a guest (common.save_record): what its successor needs to serve it."""
    info: SandboxInfo
    spec: SandboxSpec
    files: ImageFiles  # the loader's files it runs on (their leases stay with the loader across the restart)
    append: str  # its kernel command line (a memory snapshot records it)


class Reattached(NamedTuple):
    proc: QemuProcess
    chan: GuestChannel
    paused: bool


async def reattach(sdir: str, cg: cgroups.Cgroups) -> Reattached | str:
    """QEMU and its guest's agent, connected again; or why the guest cannot be adopted."""
    proc = QemuProcess.find(cg, f"{sdir}/qemu.pid")
    if proc is None:
        return "its QEMU no longer runs"
    chan = GuestChannel(f"{sdir}/agent.sock")
    try:
        async with microvm_qmp.monitor(f"{sdir}/qmp.sock", ADOPT_TIMEOUT_S) as q:
            status = (await q.execute("query-status")).get("status", "")
        if status not in ("running", "paused"):  # e.g. a memory snapshot's save cut off by the crash
            raise _NotAdoptable(f"QEMU is in state {status!r}")
        # a stopped guest's agent cannot answer: it is asked once the guest runs again
        await chan.connect(ADOPT_TIMEOUT_S, ping=status == "running")
    except (CorralError, OSError, _NotAdoptable) as e:
        with contextlib.suppress(Exception):
            await chan.close()
        proc.close()
        return getattr(e, "message", None) or str(e)
    return Reattached(proc=proc, chan=chan, paused=status == "paused")


class _NotAdoptable(Exception):
    pass
