"""Substrates benchmark: corral's `function`, `container` and `docker` substrates side by side, and
the one-shot baselines a `function` call competes with, all in one run on the same busybox rootfs.

  function   `client.run(["true"])` over the bus (SDK -> scheduler -> node-agent: a fresh sandbox,
             the command, the reply; teardown after the reply)
  container  `client.create` (returns when running) / `sb.exec(["true"])` / `sb.destroy()`
  docker     the same on substrate `docker` (aiodocker; image from `docker import` of the rootfs)
  gvisor     the same on substrate `gvisor` (runsc, when installed; platform ptrace here)
  runc       bare `runc run` (foreground, not -d) of a `runc spec` bundle whose root is the busybox
             rootfs, running `true` (a fresh container id each time)
  bwrap      `bwrap --unshare-all --ro-bind ROOTFS / --proc /proc --dev /dev /bin/true`
  docker run `docker run --rm --network none IMAGE /bin/true`
  runsc      bare `runsc run` of the same bundle as runc (gVisor, same platform as the node's)

Latency is wall clock per call from the caller (perf_counter around the SDK call or around the CLI
process, so baselines include one fork+exec of their CLI, which is how they are used).

* one-shot latency, interleaved: `--n` rounds; in each round every one-shot system (function,
  runc, bwrap, docker run) makes one call, in a shuffled order, so load from anything else on the
  machine hits them alike. The goal is computed from these.
* one-shot latency, back to back: `--n` calls of `function` with no pause (its prepared slots are
  refilled while the next calls arrive), and `--n` of bare `runc run`, also back to back.
* container/docker/gvisor: `--n` creates (kept), `--n` execs on the first, `--n` destroys.
* throughput: `--concurrency` workers doing one-shot cycles until `--cycles` are done: one `run`
  (function), create+exec+destroy (container, docker), one CLI call (runc, bwrap, docker run).

Results: `<out>/substrates.json` and `<out>/substrates.png`. dockerd is started if `docker info`
fails (and stopped at the end); bubblewrap is installed with apt-get if missing.

    .venv/bin/python -m bench.substrates [--n 40] [--out bench/results] [--concurrency 8] [--cycles 48]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any

from bench._common import Goal, goals_from_ops, log, pyplot, save, stats
from tests.dockerd import docker_ok, start_dockerd, stop_dockerd

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
ROOTFS = f"{IMAGE_DIR}/busybox/rootfs"
#: gVisor, when installed: the node's gvisor substrate and a bare `runsc run` baseline. ptrace is
#: the platform this machine has (no systrap in Debian's runsc; KVM guests do not run here), the
#: same the node's probe settles on
RUNSC = shutil.which("runsc") or ""
RUNSC_PLATFORM = os.environ.get("CORRAL_GVISOR_PLATFORM", "ptrace")
GOAL = 1.5  # function call p50 / bare `runc run` p50


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def first_line(argv: list[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (p.stdout or p.stderr).strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({e})"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                            "loadavg_start": loadavg(), "runc": first_line(["runc", "--version"]),
                            "bwrap": first_line(["bwrap", "--version"]), "docker": first_line(["docker", "version", "--format",
                                                                                                "{{.Server.Version}}"])}
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        info["corral_commit"] = head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    others = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    c = f.read()
            except OSError:
                continue
            if b"corral_node_agent" in c and b"crl-bsub-" not in c:
                others += 1
    info["foreign_node_agents_start"] = others
    return info


# ---------------------------------------------------------------------------------- prerequisites


def ensure_bwrap() -> str:
    if shutil.which("bwrap"):
        return ""
    log("bubblewrap missing: apt-get install -y bubblewrap")
    p = subprocess.run(["apt-get", "install", "-y", "bubblewrap"], capture_output=True, text=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if p.returncode != 0 or not shutil.which("bwrap"):
        return f"could not install bubblewrap: {(p.stderr or p.stdout)[-500:]}"
    return ""


def ensure_dockerd() -> tuple[subprocess.Popen | None, str]:
    if docker_ok():
        return None, ""
    log("starting dockerd")
    return start_dockerd("/tmp/corral-bench-substrates-dockerd.log")


# ---------------------------------------------------------------------------------- baselines


class Baselines:
    def __init__(self, run_id: str, docker_image: str | None):
        self.runc = shutil.which("runc") or "runc"
        self.dir = tempfile.mkdtemp(prefix="corral-bench-subst-", dir="/tmp")
        self.root = f"{self.dir}/runc-state"
        self.bundle = f"{self.dir}/bundle"
        os.makedirs(self.bundle)
        subprocess.run([self.runc, "spec", "--bundle", self.bundle], check=True, capture_output=True)
        with open(f"{self.bundle}/config.json") as f:
            cfg = json.load(f)
        cfg["process"]["terminal"] = False
        cfg["process"]["args"] = ["/bin/true"]
        cfg["root"] = {"path": ROOTFS, "readonly": True}
        with open(f"{self.bundle}/config.json", "w") as f:
            json.dump(cfg, f)
        self.run_id = run_id
        self.seq = 0
        self.docker_image = docker_image
        self.lock = threading.Lock()

    def _id(self) -> str:
        with self.lock:
            self.seq += 1
            return f"bsub-{self.run_id}-{self.seq}"

    def runc_run(self) -> float:
        cid = self._id()
        t0 = time.perf_counter()
        p = subprocess.run([self.runc, "--root", self.root, "run", "--bundle", self.bundle, cid],
                           stdin=subprocess.DEVNULL, capture_output=True)
        ms = (time.perf_counter() - t0) * 1000
        if p.returncode != 0:
            raise RuntimeError(f"runc run: {p.stderr.decode(errors='replace')[-300:]}")
        return ms

    def runsc_run(self) -> float:
        """`runsc run` of the same bundle (gVisor, the platform the node probes first that works here)."""
        cid = self._id()
        t0 = time.perf_counter()
        p = subprocess.run([RUNSC, f"--platform={RUNSC_PLATFORM}", "--network=none", "--root", f"{self.root}-runsc", "run",
                            "--bundle", self.bundle, cid], stdin=subprocess.DEVNULL, capture_output=True)
        ms = (time.perf_counter() - t0) * 1000
        if p.returncode != 0:
            raise RuntimeError(f"runsc run: {p.stderr.decode(errors='replace')[-300:]}")
        return ms

    def bwrap(self) -> float:
        t0 = time.perf_counter()
        p = subprocess.run(["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", ROOTFS, "/",
                            "--proc", "/proc", "--dev", "/dev", "/bin/true"], stdin=subprocess.DEVNULL, capture_output=True)
        ms = (time.perf_counter() - t0) * 1000
        if p.returncode != 0:
            raise RuntimeError(f"bwrap: {p.stderr.decode(errors='replace')[-300:]}")
        return ms

    def docker_run(self) -> float:
        t0 = time.perf_counter()
        p = subprocess.run(["docker", "run", "--rm", "--network", "none", "--label", f"corral-bench-subst={self.run_id}",
                            self.docker_image, "/bin/true"], stdin=subprocess.DEVNULL, capture_output=True)
        ms = (time.perf_counter() - t0) * 1000
        if p.returncode != 0:
            raise RuntimeError(f"docker run: {p.stderr.decode(errors='replace')[-300:]}")
        return ms

    def cleanup(self) -> None:
        for runtime, root in ((self.runc, self.root), (RUNSC, f"{self.root}-runsc")):
            if runtime and os.path.isdir(root):
                p = subprocess.run([runtime, "--root", root, "list", "-quiet"], capture_output=True, text=True)
                for cid in p.stdout.split():
                    subprocess.run([runtime, "--root", root, "delete", "-force", cid], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.docker_image:
            p = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=corral-bench-subst={self.run_id}"], capture_output=True, text=True)
            if p.stdout.split():
                subprocess.run(["docker", "rm", "-f", *p.stdout.split()], capture_output=True)


def thread_throughput(fn, concurrency: int, cycles: int) -> dict[str, Any]:
    """`concurrency` threads take cycles off a shared counter until `cycles` are done."""
    left = [cycles]
    lock = threading.Lock()
    lat: list[float] = []
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            try:
                ms = fn()
                with lock:
                    lat.append(ms)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e)[:200])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "cycles": cycles, "ok": len(lat), "failed": len(errors), "wall_s": round(wall, 3),
            "per_s": round(len(lat) / wall, 2) if wall > 0 else None,
            "latency": {k: v for k, v in stats(lat).items() if k != "samples_ms"}, "errors": errors[:3]}


async def async_throughput(make_cycle, concurrency: int, cycles: int) -> dict[str, Any]:
    left = [cycles]
    lat: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            try:
                await make_cycle()
                lat.append((time.perf_counter() - t0) * 1000)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e)[:200])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "cycles": cycles, "ok": len(lat), "failed": len(errors), "wall_s": round(wall, 3),
            "per_s": round(len(lat) / wall, 2) if wall > 0 else None,
            "latency": {k: v for k, v in stats(lat).items() if k != "samples_ms"}, "errors": errors[:3]}


def function_tiers(metrics_url: str) -> dict[str, int]:
    """How many function calls each tier has served so far (corral_function_calls_total)."""
    import urllib.request

    out = {"warm": 0, "slot": 0, "cold": 0}
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except Exception:  # noqa: BLE001
        return out
    for line in text.splitlines():
        if line.startswith("corral_function_calls_total{"):
            for tier in out:
                if f'tier="{tier}"' in line:
                    out[tier] = int(float(line.rsplit(" ", 1)[1]))
    return out


def tier_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def node_histogram(metrics_url: str, name: str, substrate: str) -> dict[str, Any]:
    """Mean of a node-agent histogram for one substrate, from its Prometheus endpoint."""
    import urllib.request

    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum") and f'substrate="{substrate}"' in line:
            s = float(line.rsplit(" ", 1)[1])
        if line.startswith(f"{name}_count") and f'substrate="{substrate}"' in line:
            c = float(line.rsplit(" ", 1)[1])
    return {"count": int(c), "mean_ms": round(s / c * 1000, 3) if c else None}


# ---------------------------------------------------------------------------------- corral


async def bench_all(args, base: Baselines, docker_image: str | None, results: dict[str, Any]) -> None:
    sys.path[:0] = [REPO]
    from corral_sdk import AsyncClient
    from corral_sdk.stack import Stack, free_port

    data = tempfile.mkdtemp(prefix="crl-bsub-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, docker=docker_image is not None,
                  gvisor=bool(RUNSC))
    log(f"starting the corral stack in {data} (substrates: {' '.join(stack.substrate_args()[1::2])})")
    systems = results["systems"]
    failed = False
    try:
        await stack.start()
        client = await AsyncClient.connect(stack.url)
        node_metrics = next(p.metrics_url for p in stack.procs if p.name == "node-1")
        loop = asyncio.get_running_loop()

        async def fn_call() -> float:
            t0 = time.perf_counter()
            r = await client.run(["/bin/true"])
            ms = (time.perf_counter() - t0) * 1000
            if r.exit_code != 0:
                raise RuntimeError(f"function call failed: {r}")
            return ms

        # ---- warm-up
        for _ in range(args.warmup):
            await fn_call()
            await loop.run_in_executor(None, base.runc_run)
            await loop.run_in_executor(None, base.bwrap)
            if RUNSC:
                await loop.run_in_executor(None, base.runsc_run)
            if docker_image:
                await loop.run_in_executor(None, base.docker_run)

        # ---- one-shot, interleaved rounds
        log(f"one-shot latency: {args.n} interleaved rounds")
        oneshot: dict[str, list[float]] = {"function": [], "runc": [], "bwrap": []}
        by_tier: dict[str, list[float]] = {"warm": [], "slot": [], "cold": []}
        if docker_image:
            oneshot["docker_run"] = []
        if RUNSC:
            oneshot["runsc"] = []
        calls = {"runc": base.runc_run, "bwrap": base.bwrap, "docker_run": base.docker_run, "runsc": base.runsc_run}
        rng = random.Random(7)
        tiers0 = function_tiers(node_metrics)
        for _ in range(args.n):
            order = list(oneshot)
            rng.shuffle(order)
            for name in order:
                if name == "function":
                    before = function_tiers(node_metrics)  # (scraped outside the timed call)
                    ms = await fn_call()
                    oneshot[name].append(ms)
                    d = tier_delta(before, function_tiers(node_metrics))
                    tier = next((k for k, v in d.items() if v), "?")
                    by_tier.setdefault(tier, []).append(ms)
                else:
                    oneshot[name].append(await loop.run_in_executor(None, calls[name]))
        systems["function"] = {"what": "client.run(['/bin/true']) on substrate function (SDK -> scheduler -> node)",
                               "call_interleaved": stats(oneshot["function"]),
                               "tiers_interleaved": tier_delta(tiers0, function_tiers(node_metrics)),
                               "call_interleaved_by_tier": {k: stats(v) for k, v in by_tier.items() if v}}
        systems["runc"] = {"what": "runc run (foreground) of a `runc spec` bundle, root = busybox rootfs, /bin/true",
                           "run_interleaved": stats(oneshot["runc"])}
        systems["bwrap"] = {"what": "bwrap --unshare-all --ro-bind ROOTFS / --proc /proc --dev /dev /bin/true",
                            "run_interleaved": stats(oneshot["bwrap"])}
        if docker_image:
            systems["docker_run"] = {"what": f"docker run --rm --network none {docker_image} /bin/true",
                                     "run_interleaved": stats(oneshot["docker_run"])}
        if RUNSC:
            systems["runsc"] = {"what": f"runsc --platform={RUNSC_PLATFORM} run (foreground) of the same bundle, /bin/true",
                                "run_interleaved": stats(oneshot["runsc"])}

        # ---- back to back
        log(f"one-shot latency: {args.n} back-to-back calls each of function and runc run")
        await asyncio.sleep(1)
        tiers0 = function_tiers(node_metrics)
        systems["function"]["call_back_to_back"] = stats([await fn_call() for _ in range(args.n)])
        systems["function"]["tiers_back_to_back"] = tier_delta(tiers0, function_tiers(node_metrics))
        await asyncio.sleep(1)
        systems["runc"]["run_back_to_back"] = stats([await loop.run_in_executor(None, base.runc_run) for _ in range(args.n)])
        systems["function"]["node_teardown_after_reply"] = node_histogram(node_metrics, "corral_sandbox_destroy_seconds", "function")
        systems["function"]["node_run_until_exit"] = node_histogram(node_metrics, "corral_run_seconds", "function")

        # ---- container / docker: create, exec, destroy
        for sub, image in (("container", "busybox"), ("docker", docker_image), ("gvisor", "busybox" if RUNSC else None)):
            if image is None:
                continue
            log(f"{sub}: {args.n} creates, execs, destroys")
            n = args.n if sub == "container" else max(5, args.n // 2)
            creates, execs, destroys = [], [], []
            sbs = []
            for _ in range(n):
                t0 = time.perf_counter()
                sbs.append(await client.create(image=image, substrate=sub, cpu=0.1, memory_mb=64))
                creates.append((time.perf_counter() - t0) * 1000)
            for _ in range(args.n):
                t0 = time.perf_counter()
                r = await sbs[0].exec(["/bin/true"])
                execs.append((time.perf_counter() - t0) * 1000)
                assert r.exit_code == 0, r
            for sb in sbs:
                t0 = time.perf_counter()
                await sb.destroy()
                destroys.append((time.perf_counter() - t0) * 1000)
            systems[sub] = {"what": f"client.create(image={image!r}, substrate={sub!r}) / sb.exec(['/bin/true']) / sb.destroy()",
                            "create": stats(creates), "exec": stats(execs), "destroy": stats(destroys)}

        # ---- throughput
        c, cycles = args.concurrency, args.cycles
        log(f"throughput: {cycles} one-shot cycles, {c} at a time, per system")

        async def fn_cycle() -> None:
            r = await client.run(["/bin/true"])
            assert r.exit_code == 0

        def cycle_of(sub: str, image: str):
            async def go() -> None:
                sb = await client.create(image=image, substrate=sub, cpu=0.1, memory_mb=64)
                try:
                    await sb.exec(["/bin/true"])
                finally:
                    await sb.destroy()
            return go

        tiers0 = function_tiers(node_metrics)
        systems["function"]["throughput"] = await async_throughput(fn_cycle, c, cycles)
        systems["function"]["tiers_throughput"] = tier_delta(tiers0, function_tiers(node_metrics))
        systems["container"]["throughput"] = await async_throughput(cycle_of("container", "busybox"), c, cycles)
        if docker_image:
            systems["docker"]["throughput"] = await async_throughput(cycle_of("docker", docker_image), c, max(8, cycles // 3))
        if RUNSC:
            systems["gvisor"]["throughput"] = await async_throughput(cycle_of("gvisor", "busybox"), c, max(8, cycles // 3))
        systems["runc"]["throughput"] = await loop.run_in_executor(None, thread_throughput, base.runc_run, c, cycles)
        systems["bwrap"]["throughput"] = await loop.run_in_executor(None, thread_throughput, base.bwrap, c, cycles)
        if docker_image:
            systems["docker_run"]["throughput"] = await loop.run_in_executor(None, thread_throughput, base.docker_run, c, max(8, cycles // 3))
        await client.close()
    except BaseException:
        failed = True
        raise
    finally:
        log("stopping the stack")
        await stack.stop()
        keep = os.path.join("/tmp", f"corral-bench-substrates-logs-{results['config']['run_id']}")
        if failed or any("error" in v for v in systems.values() if isinstance(v, dict)):
            log(f"the stack's logs are kept in {keep}")
            shutil.copytree(os.path.join(data, "logs"), keep, dirs_exist_ok=True)
        shutil.rmtree(data, ignore_errors=True)


# ---------------------------------------------------------------------------------- report


def goal_list(detail: dict[str, Any]) -> list[Goal]:
    notes = {k: f"{g['numerator']} / {g['denominator']} ms" for k, g in detail.items() if k != "info" and g.get("numerator")}
    return goals_from_ops(detail, notes=notes)


def goals(systems: dict[str, Any]) -> dict[str, Any]:
    def get(*path):
        d: Any = systems
        for p in path:
            d = d.get(p) if isinstance(d, dict) else None
        return d

    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    f = get("function", "call_interleaved", "median_ms")
    r = get("runc", "run_interleaved", "median_ms")
    v = ratio(f, r)
    return {
        "function_call_p50_vs_runc_run": {"goal": GOAL, "op": "<=", "what": "function call p50 / bare `runc run` p50 (interleaved rounds)",
                                          "numerator": f, "denominator": r, "value": v, "met": v is not None and v <= GOAL},
        "info": {
            "function_p99_vs_runc_p99": ratio(get("function", "call_interleaved", "p99_ms"), get("runc", "run_interleaved", "p99_ms")),
            "function_vs_bwrap_p50": ratio(f, get("bwrap", "run_interleaved", "median_ms")),
            "function_vs_docker_run_p50": ratio(f, get("docker_run", "run_interleaved", "median_ms")),
            "function_back_to_back_vs_runc_back_to_back_p50": ratio(get("function", "call_back_to_back", "median_ms"),
                                                                    get("runc", "run_back_to_back", "median_ms")),
            "function_throughput_vs_runc": ratio(get("function", "throughput", "per_s"), get("runc", "throughput", "per_s")),
            "function_throughput_vs_docker_run": ratio(get("function", "throughput", "per_s"), get("docker_run", "throughput", "per_s")),
        },
    }


def plot(results: dict[str, Any], path: str) -> None:
    plt = pyplot()

    s = results["systems"]
    bars: list[tuple[str, dict, str]] = []
    for label, sysname, key, color in (
        ("function call", "function", "call_interleaved", "#2b7bba"),
        ("function:\nwarm hits", "function", ("call_interleaved_by_tier", "warm"), "#5d9fd3"),
        ("function:\nslot (runc)", "function", ("call_interleaved_by_tier", "slot"), "#5d9fd3"),
        ("function call\n(back to back)", "function", "call_back_to_back", "#7fb3dd"),
        ("runc run", "runc", "run_interleaved", "#e08a2c"),
        ("bwrap", "bwrap", "run_interleaved", "#9b59b6"),
        ("docker run --rm", "docker_run", "run_interleaved", "#5a9e4b"),
        ("runsc run", "runsc", "run_interleaved", "#b03a2e"),
        ("container\ncreate", "container", "create", "#1f4e79"),
        ("container\nexec", "container", "exec", "#1f4e79"),
        ("container\ndestroy", "container", "destroy", "#1f4e79"),
        ("docker\ncreate", "docker", "create", "#2e6b2a"),
        ("docker\nexec", "docker", "exec", "#2e6b2a"),
        ("docker\ndestroy", "docker", "destroy", "#2e6b2a"),
        ("gvisor\ncreate", "gvisor", "create", "#7b241c"),
        ("gvisor\nexec", "gvisor", "exec", "#7b241c"),
        ("gvisor\ndestroy", "gvisor", "destroy", "#7b241c"),
    ):
        st = s.get(sysname, {})
        for k in (key if isinstance(key, tuple) else (key,)):
            st = st.get(k, {}) if isinstance(st, dict) else {}
        if st and st.get("n"):
            bars.append((label, st, color))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(18, 6), gridspec_kw={"width_ratios": [3.4, 1.3]})
    xs = range(len(bars))
    med = [b[1]["median_ms"] for b in bars]
    p99 = [b[1]["p99_ms"] for b in bars]
    ax1.bar(xs, med, color=[b[2] for b in bars])
    ax1.errorbar(xs, med, yerr=[[0] * len(bars), [max(0, p - m) for p, m in zip(p99, med)]], fmt="none", ecolor="#333", capsize=3)
    for x, m in zip(xs, med):
        ax1.text(x, m, f"{m:.1f}", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(xs))
    ax1.set_xticklabels([b[0] for b in bars], fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("ms per call (median; whisker: p99), log scale")
    g = next(g for g in results["goals"] if g["name"] == "function_call_p50_vs_runc_run")
    ax1.set_title(f"latency: function call p50 = {g['value']}x bare runc run (goal <= {GOAL}x, "
                  f"{'met' if g['met'] else 'NOT met'})", fontsize=10)
    tp = [(name, s[name]["throughput"]["per_s"]) for name in ("function", "runc", "bwrap", "docker_run", "runsc", "container", "docker", "gvisor")
          if s.get(name, {}).get("throughput", {}).get("per_s")]
    ax2.barh([t[0] for t in tp], [t[1] for t in tp], color="#888")
    for i, (_, v) in enumerate(tp):
        ax2.text(v, i, f" {v:.0f}/s", va="center", fontsize=8)
    ax2.set_xlabel(f"one-shot cycles per second ({results['config']['concurrency']} concurrent)")
    ax2.set_title("throughput", fontsize=10)
    fig.suptitle(f"corral substrates vs one-shot baselines, busybox, {results['machine']['nproc']} cores, "
                 f"load {results['machine']['loadavg_start'][0]:.1f}->{results['machine'].get('loadavg_end', [0])[0]:.1f}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-docker", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root (runc, mounts, cgroups, dockerd)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {"benchmark": "substrates", "machine": machine(),
                               "config": {"n": args.n, "concurrency": args.concurrency, "cycles": args.cycles, "warmup": args.warmup,
                                          "rootfs": ROOTFS, "run_id": run_id}, "systems": {}, "notes": []}
    err = ensure_bwrap()
    if err:
        results["notes"].append(err)
    dockerd, derr = (None, "disabled by --no-docker") if args.no_docker else ensure_dockerd()
    docker_image = None
    if derr:
        results["notes"].append(f"docker: {derr}")
    else:
        docker_image = f"corral-bench-subst-busybox:{run_id}"
        p = subprocess.run(f"tar -C {ROOTFS} -c . | docker import - {docker_image}", shell=True, capture_output=True, text=True)
        if p.returncode != 0:
            results["notes"].append(f"docker import failed: {p.stderr.strip()}")
            docker_image = None
    results["config"]["docker_image"] = docker_image
    results["config"]["dockerd_started_by_bench"] = dockerd is not None
    base = Baselines(run_id, docker_image)
    rc = 0
    try:
        asyncio.run(bench_all(args, base, docker_image, results))
    except Exception as e:  # noqa: BLE001
        results["error"] = f"{type(e).__name__}: {e}"
        results["traceback"] = traceback.format_exc()
        log(results["traceback"])
        rc = 1
    finally:
        base.cleanup()
        if docker_image:
            subprocess.run(["docker", "rmi", "-f", docker_image], capture_output=True)
        if dockerd is not None:
            stop_dockerd(dockerd)
            if dockerd.poll() is None:
                dockerd.kill()
    results["machine"]["loadavg_end"] = loadavg()
    results["goal_detail"] = goals(results["systems"])
    save(args.out, "substrates", results, plot, goal_list(results["goal_detail"]))
    s = results["systems"]
    for k in ("tiers_interleaved", "tiers_back_to_back", "tiers_throughput"):
        if k in s.get("function", {}):
            log(f"function   {k:22s} {s['function'][k]}")
    for name, v in s.items():
        for k, st in v.items():
            if isinstance(st, dict) and "median_ms" in st:
                log(f"{name:10s} {k:22s} p50 {st['median_ms']:8.2f} ms  p99 {st['p99_ms']:8.2f} ms")
            elif isinstance(st, dict) and "per_s" in st:
                log(f"{name:10s} {k:22s} {st['per_s']} /s ({st['ok']} ok, {st['failed']} failed)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
