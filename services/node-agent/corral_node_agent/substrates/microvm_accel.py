"""Which accelerator a node's guests run under: KVM when the host's passes a real boot (probed
once per host and cached: a nested KVM that creates VMs but never runs a vCPU is common), TCG
otherwise; `CORRAL_MICROVM_ACCEL` forces one. And what the guest's kernel is told of its clock
under TCG."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from corral_common.contract.errors import Unavailable

from .microvm_guest import GUEST_CACHE

if TYPE_CHECKING:
    from .microvm import MicrovmSubstrate

ACCEL_ENV = "CORRAL_MICROVM_ACCEL"
ACCEL_CACHE_S = 86400.0
KVM_PROBE_S, TCG_PROBE_S = 8.0, 60.0


async def choose(sub: MicrovmSubstrate) -> str:
    """"kvm" or "tcg" for `sub`'s guests, or Unavailable saying why neither boots one."""
    forced = os.environ.get(ACCEL_ENV, "")
    if forced:
        if forced not in ("kvm", "tcg"):
            raise Unavailable(f"{ACCEL_ENV}={forced!r}: use kvm or tcg")
        return forced
    cache = f"{GUEST_CACHE}/accel-{sub.name}"
    with contextlib.suppress(OSError):
        if time.time() - os.path.getmtime(cache) < ACCEL_CACHE_S:
            with open(cache) as f:
                cached = f.read().strip()
            if cached in ("kvm", "tcg"):
                return cached
    problems = []
    for accel, limit in (("kvm", KVM_PROBE_S), ("tcg", TCG_PROBE_S)):
        if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
            problems.append("kvm: no /dev/kvm")
            continue
        problem = await probe(sub, accel, limit)
        if not problem:
            with open(cache + ".tmp", "w") as f:
                f.write(accel + "\n")
            os.replace(cache + ".tmp", cache)
            return accel
        problems.append(f"{accel}: {problem}")
    raise Unavailable(f"QEMU cannot boot the {sub.name} guest here ({'; '.join(problems)})")


async def probe(sub: MicrovmSubstrate, accel: str, limit: float) -> str:
    """Boot the guest to its init (corral_probe=1 powers off there); '' if it got there. The
    console goes to a file: read through a pipe by the node-agent, the guest's boot stalled."""
    d = tempfile.mkdtemp(prefix=f"{sub.name}-probe-", dir=sub.state_dir)
    try:
        with open(f"{d}/qemu.log", "wb") as log_file:
            proc = await asyncio.create_subprocess_exec(*sub.qemu_argv(accel, 128, 1, sub.kernel_cmdline(accel, "corral_probe=1"), f"file:{d}/console.log"),
                                                        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=log_file)
        try:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), open(f"{d}/console.log", "rb") as f:
                    if b"corral-probe-ok" in f.read():
                        return ""
                if proc.returncode is not None:
                    return "QEMU ended before the guest's init ran: " + sub.failure_text(d)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.05)
            return f"the guest did not reach its init in {limit:g}s: " + sub.failure_text(d)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def clock_args(accel: str) -> str:
    """Under TCG the guest's TSC runs at the host's rate, and a microvm has no HPET or PM
    timer to measure it against: the kernel's PIT calibration fails under load and the boot
    then hangs (~1 in 5) calibrating the APIC timer against PIT ticks. Told the rate
    (tsc_early_khz, the host's from /proc/cpuinfo, whose TSC is constant), it uses the TSC
    and the APIC's TSC-deadline timer and calibrates nothing."""
    if accel != "tcg":
        return ""
    return f"tsc=reliable lpj=4000000 tsc_early_khz={host_tsc_khz()}" if host_tsc_khz() else "tsc=reliable lpj=4000000"


@functools.cache
def host_tsc_khz() -> int:
    """The host's TSC rate in kHz (0: unknown, or not constant)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return 0
    if " constant_tsc" not in info:
        return 0
    for line in info.splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 0
