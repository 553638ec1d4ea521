"""The microvm and vm substrates, each against a bare QEMU boot of the same guest, in one run.

  create   `client.create(image="busybox", substrate=S, memory_mb=500)` (a size the warm pool's
           guests do not have: a cold boot) over the bus, returned when the
           guest's agent answers (QEMU start, kernel boot, layers mounted, overlay, agent up)
  boot     a bare `qemu-system-x86_64` of the same machine type, kernel, initramfs, accelerator
           and kernel arguments, with the busybox layer as its block device, timed from the process start to
           the guest's init writing its first line on the console (corral_probe=1): the part of a
           create that is QEMU and the kernel
  pooled   `client.create(image="busybox", substrate=S)` with the default sizes, which claims a
           guest the node's warm pool (`--warm-pool S:busybox=1`) booted and stopped ahead; the
           pool is refilled (waited for) before anything else is timed
  exec     `sb.exec(["true"])` on the first guest (the agent's round trip over virtio-serial)
  destroy  `sb.destroy()`, each guest right after its create (at cpu=1 a 2-cpu node holds two)

create and boot alternate, one of each per round, so machine noise falls on both; microvm's rounds
and vm's alternate too. The accelerator (KVM or TCG) is the one the node settled on for each,
recorded in the results.

    .venv/bin/python -m bench.microvm [--n 10] [--execs 40] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import msgspec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._common import goal, log, machine, pyplot, save, stats  # noqa: E402
from corral_common.contract import subjects  # noqa: E402
from corral_common.contract.messages import Heartbeat, SandboxSpec  # noqa: E402
from corral_node_agent.substrates import REGISTRY  # noqa: E402
from corral_node_agent.substrates.microvm import GUEST_BASE_MB, MicrovmSubstrate  # noqa: E402
from corral_node_agent.substrates.microvm_guest import GUEST_CACHE, ensure_guest  # noqa: E402
from corral_sdk import AsyncClient  # noqa: E402
from corral_sdk.stack import Stack, free_port  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
GOAL_CREATE_RATIO = 1.5  # a create (boot + layers + agent) at most 1.5x a bare boot to init
GOAL_POOLED_RATIO = 0.1  # a pooled create does not pay the boot: at most a tenth of one
SUBSTRATES = ("microvm", "vm")
OPS = ("create", "boot", "pooled", "exec", "destroy")
COLD_MB = 500  # cold creates' memory_mb: not the default, so no warm guest serves them


def layer_file() -> str:
    """The busybox image's layer: the built-in image's EROFS file in the image dir."""
    path = f"{IMAGE_DIR}/busybox/layer.erofs"
    if not os.path.exists(path):
        raise SystemExit(f"no busybox layer at {path} (make test or make demo builds it)")
    return path


async def bare_boot(argv: list[str], console: str) -> float:
    if os.path.exists(console):
        os.unlink(console)
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    try:
        while True:
            try:
                with open(console, "rb") as f:
                    if b"corral-probe-ok" in f.read():
                        return (time.perf_counter() - t0) * 1000
            except FileNotFoundError:
                pass
            if proc.returncode is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("the bare boot did not reach the guest's init")
            await asyncio.sleep(0.005)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def warm_ready(nc, substrate: str, timeout: float = 120) -> None:
    """Until a heartbeat says the node's `substrate` pool has a guest ready."""
    got = asyncio.Event()

    async def on(m) -> None:
        if msgspec.json.decode(m.data, type=Heartbeat).warm.get(f"{substrate}:busybox", 0) >= 1:
            got.set()

    sub = await nc.subscribe(subjects.NODE_HEARTBEAT, cb=on)
    try:
        await asyncio.wait_for(got.wait(), timeout)
    finally:
        await sub.unsubscribe()


async def run(args) -> dict[str, Any]:
    s = Stack(data_dir=tempfile.mkdtemp(prefix="crl-bench-", dir="/tmp"), nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR,
              monitor=False, ephemeral=True,
              node_args=["--substrate", "container", *(a for n in SUBSTRATES for a in ("--substrate", n, "--warm-pool", f"{n}:busybox=1"))])
    await s.start()
    c = await AsyncClient.connect(s.url)
    work = tempfile.mkdtemp(prefix="crl-bench-boot-")
    try:
        guest = await asyncio.to_thread(ensure_guest)
        spec = SandboxSpec(image="busybox", memory_mb=COLD_MB)  # what the cold creates get: the same guest RAM for the bare boot
        accel, argv = {}, {}
        for name in SUBSTRATES:
            with open(f"{GUEST_CACHE}/accel-{name}") as f:
                accel[name] = f.read().strip()
            sub = REGISTRY[name]("bench", work, None)  # type: ignore[arg-type]  (only its QEMU command line is used)
            assert isinstance(sub, MicrovmSubstrate)
            sub.guest = guest
            argv[name] = sub.qemu_argv(accel[name], spec.memory_mb + spec.disk_mb + GUEST_BASE_MB, 1, sub.kernel_cmdline(accel[name], "corral_probe=1"),
                                   f"file:{work}/console.log", layer_files=[layer_file()])
        times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in OPS} for name in SUBSTRATES}
        for i in range(args.n):
            for name in (SUBSTRATES if i % 2 == 0 else SUBSTRATES[::-1]):
                t = times[name]
                await warm_ready(c.nc, name)
                t0 = time.perf_counter()
                sb = await c.create(image="busybox", substrate=name)
                t["pooled"].append((time.perf_counter() - t0) * 1000)
                await sb.destroy()
                await warm_ready(c.nc, name)  # its refill's boot is over before the cold ones are timed
                for what in (("create", "boot") if i % 2 == 0 else ("boot", "create")):
                    if what == "boot":
                        t["boot"].append(await bare_boot(argv[name], f"{work}/console.log"))
                        continue
                    t0 = time.perf_counter()
                    sb = await c.create(image="busybox", substrate=name, memory_mb=COLD_MB)
                    t["create"].append((time.perf_counter() - t0) * 1000)
                    for _ in range(args.execs if i == 0 else 0):
                        t0 = time.perf_counter()
                        r = await sb.exec(["true"])
                        t["exec"].append((time.perf_counter() - t0) * 1000)
                        assert r.exit_code == 0, r
                    t0 = time.perf_counter()
                    await sb.destroy()
                    t["destroy"].append((time.perf_counter() - t0) * 1000)
                log(f"round {i + 1}/{args.n} {name}: create {t['create'][-1]:.0f} ms, boot {t['boot'][-1]:.0f} ms, "
                    f"pooled {t['pooled'][-1]:.0f} ms")
        return {name: {"accel": accel[name], "ops": {k: stats(v) for k, v in times[name].items()}} for name in SUBSTRATES}
    finally:
        await c.close()
        await s.stop()
        shutil.rmtree(work, ignore_errors=True)


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SUBSTRATES), figsize=(11, 4), sharey=True)
    for ax, name in zip(axes, SUBSTRATES):
        d = res["detail"][name]
        ax.bar(OPS, [d["ops"][n]["median_ms"] for n in OPS], color=["#1f618d", "#7f8c8d", "#27ae60", "#1f618d", "#1f618d"])
        ax.set_yscale("log")
        ax.set_title(f"{name} ({d['accel']}): create vs a bare boot to init")
    axes[0].set_ylabel("median ms")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--execs", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    detail = asyncio.run(run(args))
    summary: dict[str, Any] = {}
    goals = []
    for name in SUBSTRATES:
        ops = detail[name]["ops"]
        ratio = round(ops["create"]["median_ms"] / ops["boot"]["median_ms"], 3)
        summary.update({f"{name}_create_over_bare_boot": ratio, f"{name}_accel": detail[name]["accel"],
                        **{f"{name}_{k}_p50_ms": v["median_ms"] for k, v in ops.items()}})
        goals.append(goal(f"{name}_create_vs_bare_boot", GOAL_CREATE_RATIO, ratio, "x", "lower",
                          f"{name} create p50 over a bare QEMU boot of the same guest to init (p50)"))
        pooled = round(ops["pooled"]["median_ms"] / ops["boot"]["median_ms"], 4)
        summary[f"{name}_pooled_over_bare_boot"] = pooled
        goals.append(goal(f"{name}_pooled_vs_bare_boot", GOAL_POOLED_RATIO, pooled, "x", "lower",
                          f"{name} pooled create p50 over a bare QEMU boot of the same guest to init (p50)"))
    res = {"benchmark": "microvm", "machine": machine(), "args": vars(args), "detail": detail, "summary": summary}
    save(args.out, "microvm", res, plot, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
