"""Sandbox lifecycle benchmark: corral against bare runc and Docker, side by side, in one run.

All three start the same busybox rootfs (the corral image store's `busybox/rootfs`):

  corral   the SDK over the NATS bus against an embedded stack (nats-server, scheduler, one node-agent):
           `client.create` (returns once the sandbox is running), `sb.exec(["true"])`, `sb.destroy()`;
           throughput as 64 concurrent `create` calls and as one `create_batch(64)`.
  runc     `runc run -d` of a bundle whose rootfs is an overlay (busybox lower, private upper on
           tmpfs, as corral does), `runc exec <id> true`, `nsenter -t <pid> -a true`, `runc delete -f`;
           throughput as 64 concurrent `runc run -d` of distinct bundles (prepared beforehand).
  docker   `docker run -d --network none <imported busybox> sleep 3600`, `docker exec <id> true`,
           `docker rm -f <id>`; throughput as 64 concurrent `docker run -d`. dockerd is started
           here if `docker info` fails and stopped again at the end.

Sequential latencies are per call, wall clock, from the caller's side (Python `perf_counter` around
the SDK call or the CLI process). Results go to `<out>/sandbox_lifecycle.json` and `.png`.

    .venv/bin/python -m bench.sandbox_lifecycle [--n 50] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from bench._common import Goal, goals_from_ops, log, pyplot, save, stats
from tests.dockerd import start_dockerd

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
IMAGE = "busybox"
DEFAULT_IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")

# value = numerator / denominator; "op" says which way is good
GOALS = {
    "create_p50_vs_runc_run": {"goal": 1.5, "op": "<=",
                               "what": "corral create->ready p50 / runc run -d p50"},
    "create_throughput_vs_docker": {"goal": 10.0, "op": ">=",
                                    "what": "corral create throughput / docker run -d throughput (concurrent creates)"},
    "exec_p50_vs_docker_exec": {"goal": 0.15, "op": "<=",
                                "what": "corral exec p50 / docker exec p50"},
}


# ---------------------------------------------------------------------------------- statistics

def concurrent(fn: Callable[[int], Any], count: int) -> tuple[float, list[tuple[float, Any]]]:
    """Run fn(0..count-1) in `count` threads released together; return (wall ms, [(ms, result|exc)])."""
    barrier = threading.Barrier(count + 1)
    out: list[tuple[float, Any]] = [(0.0, None)] * count
    ends = [0.0] * count

    def task(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        try:
            res: Any = fn(i)
        except Exception as e:  # noqa: BLE001 - recorded per item
            res = e
        ends[i] = time.perf_counter()
        out[i] = ((ends[i] - t0) * 1000, res)

    threads = [threading.Thread(target=task, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return (max(ends) - start) * 1000, out


def throughput_round(wall_ms: float, items: list[tuple[float, Any]]) -> dict[str, Any]:
    ok = [ms for ms, r in items if not isinstance(r, BaseException)]
    errs = [repr(r) for _, r in items if isinstance(r, BaseException)]
    return {
        "wall_s": round(wall_ms / 1000, 4), "ok": len(ok), "failed": len(errs),
        "per_s": round(len(ok) / (wall_ms / 1000), 2) if wall_ms > 0 else None,
        "latency": {k: v for k, v in stats(ok).items() if k != "samples_ms"},
        "errors": errs[:3],
    }


def summarize_rounds(rounds: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    rates = [r["per_s"] for r in rounds if r.get("per_s")]
    return {"concurrency": concurrency, "per_s": round(float(np.median(rates)), 2) if rates else None,
            "rounds": rounds}


# ---------------------------------------------------------------------------------- processes

def run(argv: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
    return subprocess.run(argv, timeout=timeout, **kw)


def timed(argv: list[str], timeout: float = 120, **kw: Any) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = run(argv, timeout, **kw)
    return (time.perf_counter() - t0) * 1000, p


def checked(argv: list[str], timeout: float = 120, **kw: Any) -> tuple[float, subprocess.CompletedProcess]:
    ms, p = timed(argv, timeout, **kw)
    if p.returncode != 0:
        err = (p.stderr or b"").decode(errors="replace").strip() if isinstance(p.stderr, bytes) else ""
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {p.returncode}: {err[-500:]}")
    return ms, p


def first_line(argv: list[str]) -> str:
    try:
        p = run(argv, timeout=10)
        return (p.stdout or b"").decode(errors="replace").strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({e})"


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MNT_DETACH = 2


def mount(src: str, target: str, fstype: str, data: str, flags: int = 0) -> None:
    if _libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    if _libc.umount2(target.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        pts = [line.split()[4] for line in f]
    return [p for p in pts if p == prefix or p.startswith(prefix.rstrip("/") + "/")]


# ---------------------------------------------------------------------------------- machine

def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def foreign_corral_processes() -> int:
    """corral services not started by this run (e.g. someone's test suite): a source of noise."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (b"corral_node_agent" in cmd or b"corral_scheduler" in cmd) and b"crl-bench-" not in cmd \
                and b"--metrics-port" in cmd:
            n += 1
    return n


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(), "nproc_affinity": len(os.sched_getaffinity(0)),
        "kernel": platform.release(), "arch": platform.machine(), "python": platform.python_version(),
        "hostname": platform.node(),
    }
    try:
        with open("/etc/os-release") as f:
            kv = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        info["os"] = kv.get("PRETTY_NAME", "").strip('"')
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_mb"] = int(line.split()[1]) // 1024
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["loadavg_start"] = loadavg()
    info["foreign_corral_processes_start"] = foreign_corral_processes()
    info["runc"] = first_line(["runc", "--version"])
    info["nsenter"] = first_line(["nsenter", "--version"])
    try:
        head = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], timeout=10).stdout.decode().strip()
        dirty = run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], timeout=10).stdout.strip()
        info["corral_commit"] = head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return info


# ---------------------------------------------------------------------------------- runc

class RuncBench:
    """Bundles on a private tmpfs: overlay(busybox lower, tmpfs upper) as rootfs, config from `runc spec`."""

    def __init__(self, lower: str):
        self.lower = lower
        self.runc = shutil.which("runc") or "runc"
        self.tag = f"cbench{os.getpid()}"
        self.dir = tempfile.mkdtemp(prefix="corral-bench-runc-", dir="/tmp")
        mount("tmpfs", self.dir, "tmpfs", "size=1g,mode=0700")
        self.root = f"{self.dir}/state"
        tmpl = f"{self.dir}/template"
        os.makedirs(tmpl)
        checked([self.runc, "spec", "--bundle", tmpl])
        with open(f"{tmpl}/config.json") as f:
            cfg = json.load(f)
        cfg["process"]["terminal"] = False
        cfg["process"]["args"] = ["sleep", "3600"]
        cfg["root"] = {"path": "rootfs", "readonly": False}  # the overlay's upper is private to the container
        self.config = json.dumps(cfg).encode()
        self.live: dict[str, str] = {}  # id -> bundle

    def prepare(self, cid: str) -> float:
        t0 = time.perf_counter()
        b = f"{self.dir}/{cid}"
        for d in ("rootfs", "upper", "work"):
            os.makedirs(f"{b}/{d}")
        with open(f"{b}/config.json", "wb") as f:
            f.write(self.config)
        mount("overlay", f"{b}/rootfs", "overlay", f"lowerdir={self.lower},upperdir={b}/upper,workdir={b}/work")
        return (time.perf_counter() - t0) * 1000

    def start(self, cid: str) -> float:
        b = f"{self.dir}/{cid}"
        # stdout/stderr are inherited by the detached container: never a pipe we would wait on
        with open(f"{b}/runc.err", "wb") as err:
            ms, p = timed([self.runc, "--root", self.root, "run", "-d", "--bundle", b, cid],
                          stdout=subprocess.DEVNULL, stderr=err)
        if p.returncode != 0:
            with open(f"{b}/runc.err", "rb") as f:
                raise RuntimeError(f"runc run {cid} exited {p.returncode}: {f.read()[-500:].decode(errors='replace')}")
        self.live[cid] = b
        return ms

    def pid(self, cid: str) -> int:
        _, p = checked([self.runc, "--root", self.root, "state", cid])
        return int(json.loads(p.stdout)["pid"])

    def exec_runc(self, cid: str) -> float:
        return checked([self.runc, "--root", self.root, "exec", cid, "true"])[0]

    def exec_nsenter(self, pid: int) -> float:
        return checked(["nsenter", "-t", str(pid), "-a", "true"])[0]

    def delete(self, cid: str) -> float:
        ms, _ = checked([self.runc, "--root", self.root, "delete", "-f", cid])
        self.live.pop(cid, None)
        self._drop_bundle(cid)
        return ms

    def _drop_bundle(self, cid: str) -> None:
        b = f"{self.dir}/{cid}"
        try:
            umount(f"{b}/rootfs")
        except OSError:
            pass
        shutil.rmtree(b, ignore_errors=True)

    def cleanup(self) -> list[str]:
        notes = []
        if os.path.isdir(self.root):
            p = run([self.runc, "--root", self.root, "list", "-q"], timeout=30)
            for cid in p.stdout.decode().split():
                run([self.runc, "--root", self.root, "delete", "-f", cid], timeout=60)
        for m in sorted(mounts_under(self.dir), key=len, reverse=True):
            try:
                umount(m)
            except OSError as e:
                notes.append(str(e))
        shutil.rmtree(self.dir, ignore_errors=True)
        if os.path.exists(self.dir):
            notes.append(f"could not remove {self.dir}")
        return notes


def bench_runc(lower: str, n: int, warmup: int, conc: int, rounds: int) -> dict[str, Any]:
    rb = RuncBench(lower)
    res: dict[str, Any] = {"what": "runc run -d / runc exec / nsenter -a / runc delete -f, overlay rootfs on tmpfs",
                           "runc_root": rb.root}
    try:
        seq = 0

        def new_id() -> str:
            nonlocal seq
            seq += 1
            return f"{rb.tag}-{seq}"

        log(f"runc: warm-up x{warmup}")
        for _ in range(warmup):
            cid = new_id()
            rb.prepare(cid)
            rb.start(cid)
            rb.exec_runc(cid)
            rb.delete(cid)

        log(f"runc: {n} sequential run -d")
        prep, create, ids = [], [], []
        for _ in range(n):
            cid = new_id()
            prep.append(rb.prepare(cid))
            create.append(rb.start(cid))
            ids.append(cid)
        res["rootfs_prepare"] = stats(prep)
        res["create"] = stats(create)
        res["create_with_rootfs"] = stats([a + b for a, b in zip(prep, create)])

        log(f"runc: {n} x runc exec, {n} x nsenter -a")
        res["exec"] = stats([rb.exec_runc(ids[0]) for _ in range(n)])
        pid = rb.pid(ids[0])
        res["exec_nsenter"] = stats([rb.exec_nsenter(pid) for _ in range(n)])

        log(f"runc: {n} sequential delete -f")
        res["destroy"] = stats([rb.delete(cid) for cid in ids])

        rr = []
        for r in range(rounds):
            time.sleep(1)
            cids = [new_id() for _ in range(conc)]
            for cid in cids:
                rb.prepare(cid)
            log(f"runc: throughput round {r + 1}/{rounds}: {conc} concurrent run -d")
            wall, items = concurrent(lambda i: rb.start(cids[i]), conc)
            rr.append(throughput_round(wall, items))
            dwall, ditems = concurrent(lambda i: rb.delete(cids[i]), conc)
            rr[-1]["teardown_wall_s"] = round(dwall / 1000, 4)
        res["throughput"] = summarize_rounds(rr, conc)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        log(f"runc: FAILED: {e}")
    finally:
        notes = rb.cleanup()
        if notes:
            res["cleanup_notes"] = notes
    return res


# ---------------------------------------------------------------------------------- docker

class DockerBench:
    def __init__(self, rootfs: str, run_id: str):
        self.rootfs = rootfs
        self.run_id = run_id
        self.docker = shutil.which("docker") or "docker"
        self.image = f"corral-bench-busybox:{run_id}"
        self.daemon: subprocess.Popen | None = None
        self.daemon_log = f"/tmp/corral-bench-dockerd-{run_id}.log"
        self.imported = False
        self.seq = 0
        self.cgroups_before: set[str] = set()

    def _info_ok(self) -> bool:
        try:
            return run([self.docker, "info", "--format", "{{.ServerVersion}}"], timeout=15).returncode == 0
        except Exception:  # noqa: BLE001
            return False

    def ensure_daemon(self, timeout: float = 90) -> dict[str, Any]:
        if not shutil.which("docker"):
            raise RuntimeError("the docker CLI is not installed (apt-get install docker.io)")
        if self._info_ok():
            return {"dockerd_started_by_bench": False}
        log(f"docker: starting dockerd (log {self.daemon_log})")
        self.cgroups_before = set(_docker_cgroup_dirs())
        t0 = time.monotonic()
        self.daemon, why = start_dockerd(self.daemon_log, timeout)
        if self.daemon is None:
            raise RuntimeError(why)
        return {"dockerd_started_by_bench": True, "dockerd_start_s": round(time.monotonic() - t0, 2)}

    def versions(self) -> dict[str, Any]:
        p = run([self.docker, "version", "--format", "{{json .}}"], timeout=20)
        try:
            v = json.loads(p.stdout)
            out = {"client": v["Client"]["Version"], "server": v["Server"]["Version"]}
        except Exception:  # noqa: BLE001
            out = {}
        p = run([self.docker, "info", "--format", "{{.Driver}} {{.CgroupDriver}} {{.CgroupVersion}} {{.DefaultRuntime}}"],
                timeout=20)
        parts = p.stdout.decode().split()
        if len(parts) == 4:
            out.update(storage_driver=parts[0], cgroup_driver=parts[1], cgroup_version=parts[2], runtime=parts[3])
        return out

    def remove_stale(self) -> dict[str, int]:
        """Containers and images an earlier, interrupted bench run left behind."""
        p = run([self.docker, "ps", "-aq", "--filter", "label=corral-bench"], timeout=30)
        stale_c = p.stdout.decode().split()
        if stale_c:
            run([self.docker, "rm", "-f", *stale_c], timeout=120)
        p = run([self.docker, "images", "-q", "--filter", "reference=corral-bench-busybox"], timeout=30)
        stale_i = sorted(set(p.stdout.decode().split()))
        if stale_i:
            run([self.docker, "rmi", "-f", *stale_i], timeout=120)
        return {"containers": len(stale_c), "images": len(stale_i)}

    def import_image(self) -> float:
        t0 = time.perf_counter()
        tar = subprocess.Popen(["tar", "-C", self.rootfs, "-c", "."], stdout=subprocess.PIPE)
        p = subprocess.run([self.docker, "import", "-", self.image], stdin=tar.stdout, capture_output=True, timeout=120)
        tar.stdout.close()  # type: ignore[union-attr]
        tar.wait()
        if p.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {p.stderr.decode(errors='replace')[-500:]}")
        self.imported = True
        return (time.perf_counter() - t0) * 1000

    def run_container(self) -> tuple[float, str]:
        self.seq += 1
        name = f"corral-bench-{self.run_id}-{self.seq}"
        ms, p = checked([self.docker, "run", "-d", "--network", "none", "--label", f"corral-bench={self.run_id}",
                         "--name", name, self.image, "sleep", "3600"])
        return ms, p.stdout.decode().strip()

    def exec(self, cid: str) -> float:
        return checked([self.docker, "exec", cid, "true"])[0]

    def rm(self, cid: str) -> float:
        return checked([self.docker, "rm", "-f", cid])[0]

    def cleanup(self) -> list[str]:
        notes = []
        try:
            if self.daemon is not None or self._info_ok():
                p = run([self.docker, "ps", "-aq", "--filter", f"label=corral-bench={self.run_id}"], timeout=30)
                left = p.stdout.decode().split()
                if left:
                    run([self.docker, "rm", "-f", *left], timeout=120)
                if self.imported:
                    run([self.docker, "rmi", "-f", self.image], timeout=60)
        except Exception as e:  # noqa: BLE001
            notes.append(f"docker cleanup: {e}")
        if self.daemon is not None:
            if self.daemon.poll() is None:
                log("docker: stopping the dockerd this bench started")
                self.daemon.send_signal(signal.SIGTERM)
                try:
                    self.daemon.wait(60)
                except subprocess.TimeoutExpired:
                    notes.append("dockerd ignored SIGTERM for 60 s: killed")
                    self.daemon.kill()
                    self.daemon.wait()
            # the (empty) cgroup directories dockerd made, if they were not there before it started
            for d in set(_docker_cgroup_dirs()) - self.cgroups_before:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            if not notes and self.daemon.returncode in (0, -signal.SIGTERM):
                try:
                    os.unlink(self.daemon_log)
                except OSError:
                    pass
            else:
                notes.append(f"dockerd log kept: {self.daemon_log}")
        return notes


def _docker_cgroup_dirs() -> list[str]:
    import glob
    return glob.glob("/sys/fs/cgroup/*/docker")


def bench_docker(db: DockerBench, n: int, warmup: int, conc: int, rounds: int) -> dict[str, Any]:
    res: dict[str, Any] = {"what": "docker run -d --network none / docker exec / docker rm -f", "image": db.image}
    try:
        log(f"docker: warm-up x{warmup}")
        for _ in range(warmup):
            _, cid = db.run_container()
            db.exec(cid)
            db.rm(cid)

        log(f"docker: {n} sequential run -d")
        create, ids = [], []
        for _ in range(n):
            ms, cid = db.run_container()
            create.append(ms)
            ids.append(cid)
        res["create"] = stats(create)
        log(f"docker: {n} x docker exec")
        res["exec"] = stats([db.exec(ids[0]) for _ in range(n)])
        log(f"docker: {n} sequential rm -f")
        res["destroy"] = stats([db.rm(cid) for cid in ids])

        rr = []
        for r in range(rounds):
            time.sleep(1)
            log(f"docker: throughput round {r + 1}/{rounds}: {conc} concurrent run -d")
            wall, items = concurrent(lambda i: db.run_container()[1], conc)
            rr.append(throughput_round(wall, items))
            cids = [c for _, c in items if isinstance(c, str)]
            if cids:
                dwall, _ = concurrent(lambda i: db.rm(cids[i]), len(cids))
                rr[-1]["teardown_wall_s"] = round(dwall / 1000, 4)
        res["throughput"] = summarize_rounds(rr, conc)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        log(f"docker: FAILED: {e}")
    return res


# ---------------------------------------------------------------------------------- corral

async def bench_corral(image_dir: str, n: int, warmup: int, conc: int, rounds: int, cpu: float, memory_mb: int) -> dict[str, Any]:
    from corral_sdk import AsyncClient
    from corral_sdk.stack import Stack, free_port

    res: dict[str, Any] = {"what": "SDK over NATS: client.create (returns when running) / sb.exec(['true']) / sb.destroy",
                           "spec": {"image": IMAGE, "cpu": cpu, "memory_mb": memory_mb}}
    data = tempfile.mkdtemp(prefix="crl-bench-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=image_dir)
    client = None
    kw = {"image": IMAGE, "cpu": cpu, "memory_mb": memory_mb, "ttl_s": 1800}
    try:
        log("corral: starting the embedded stack")
        t0 = time.perf_counter()
        await stack.start()
        res["stack_start_s"] = round(time.perf_counter() - t0, 2)
        client = await AsyncClient.connect(stack.url)

        log(f"corral: warm-up x{warmup}")
        for _ in range(warmup):
            sb = await client.create(**kw)
            await sb.exec(["true"])
            await sb.destroy()

        log(f"corral: {n} sequential create")
        create, sbs = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await client.create(**kw)
            create.append((time.perf_counter() - t0) * 1000)
            sbs.append(sb)
        res["create"] = stats(create)
        res["create_states"] = sorted({sb.info.state for sb in sbs})

        log(f"corral: {n} x exec ['true'], {n} x exec 'echo hi'")
        lat, node_side = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            r = await sbs[0].exec(["true"])
            lat.append((time.perf_counter() - t0) * 1000)
            node_side.append(r.duration_ms)
            if r.exit_code != 0:
                raise RuntimeError(f"exec true exited {r.exit_code}: {r.stderr[-300:]}")
        res["exec"] = stats(lat)
        res["exec_node_reported_duration"] = stats(node_side)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = await sbs[0].exec("echo hi")
            lat.append((time.perf_counter() - t0) * 1000)
            if r.exit_code != 0 or r.stdout.strip() != "hi":
                raise RuntimeError(f"exec 'echo hi' gave {r.exit_code} {r.stdout!r} {r.stderr[-300:]!r}")
        res["exec_shell"] = stats(lat)

        log(f"corral: {n} sequential destroy")
        lat = []
        while sbs:
            sb = sbs.pop(0)
            t0 = time.perf_counter()
            await sb.destroy()
            lat.append((time.perf_counter() - t0) * 1000)
        res["destroy"] = stats(lat)

        async def timed_create() -> tuple[float, Any]:
            t0 = time.perf_counter()
            try:
                made: Any = await client.create(timeout=300, **kw)
            except Exception as e:  # noqa: BLE001 - counted as a failed create
                made = e
            return (time.perf_counter() - t0) * 1000, made

        async def teardown(made: list[Any]) -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(s.destroy() for s in made), return_exceptions=True)
            return (time.perf_counter() - t0) * 1000

        conc_rounds, batch_rounds = [], []
        for r in range(rounds):
            await asyncio.sleep(1)
            log(f"corral: throughput round {r + 1}/{rounds}: {conc} concurrent create")
            t0 = time.perf_counter()
            items = await asyncio.gather(*(timed_create() for _ in range(conc)))
            wall = (time.perf_counter() - t0) * 1000
            conc_rounds.append(throughput_round(wall, items))
            made = [x for _, x in items if not isinstance(x, BaseException)]
            conc_rounds[-1]["teardown_wall_s"] = round(await teardown(made) / 1000, 4)

            await asyncio.sleep(1)
            log(f"corral: throughput round {r + 1}/{rounds}: create_batch({conc})")
            t0 = time.perf_counter()
            try:
                made = await client.create_batch(conc, timeout=300, **kw)
                err = None
            except Exception as e:  # noqa: BLE001
                made, err = [], e
            wall = (time.perf_counter() - t0) * 1000
            batch_rounds.append({"wall_s": round(wall / 1000, 4), "ok": len(made), "failed": conc - len(made),
                                 "per_s": round(len(made) / (wall / 1000), 2), "errors": [repr(err)] if err else []})
            batch_rounds[-1]["teardown_wall_s"] = round(await teardown(made) / 1000, 4)

        cc = summarize_rounds(conc_rounds, conc)
        bb = summarize_rounds(batch_rounds, conc)
        best = max((("concurrent_create", cc), ("create_batch", bb)), key=lambda kv: kv[1]["per_s"] or 0)
        res["throughput"] = {"concurrency": conc, "per_s": best[1]["per_s"], "method": best[0],
                             "concurrent_create": cc, "create_batch": bb}
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        log(f"corral: FAILED: {e}")
    finally:
        notes = []
        if client is not None:
            try:
                left = await client.list()
                if left:
                    notes.append(f"{len(left)} sandboxes left before stop: destroyed")
                    await asyncio.gather(*(client.sandbox(i.id).destroy() for i in left), return_exceptions=True)
            except Exception as e:  # noqa: BLE001
                notes.append(f"list/destroy leftovers: {e}")
            try:
                await client.close()
            except Exception:  # noqa: BLE001
                pass
        log("corral: stopping the stack")
        await stack.stop()
        if res.get("error") and os.path.isdir(f"{data}/logs"):
            keep = f"/tmp/corral-bench-stack-logs-{os.path.basename(data)}"
            shutil.copytree(f"{data}/logs", keep, dirs_exist_ok=True)
            notes.append(f"stack logs kept in {keep}")
            log(f"corral: stack logs kept in {keep}")
        left_mounts = mounts_under(data)
        if left_mounts:
            notes.append(f"mounts left under {data}: {left_mounts[:5]}")
        else:
            shutil.rmtree(data, ignore_errors=True)
        if notes:
            res["cleanup_notes"] = notes
    return res


# ---------------------------------------------------------------------------------- goals, plot, table

def goals(detail: dict[str, Any]) -> list[Goal]:
    """compute_goals' ratios as goals, each noting the numerator and denominator it divides."""
    units = {"create_throughput_vs_docker": "per s"}
    notes = {k: f"{g['numerator']} / {g['denominator']} {units.get(k, 'ms')}" for k, g in detail.items()
             if k != "info" and g.get("numerator") is not None and g.get("denominator") is not None}
    return goals_from_ops(detail, notes=notes)


def ratio(num: float | None, den: float | None) -> float | None:
    if not num or not den:
        return None
    return round(num / den, 4)


def compute_goals(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(sysname: str, *path: str) -> float | None:
        d: Any = systems.get(sysname, {})
        for p in path:
            if not isinstance(d, dict):
                return None
            d = d.get(p)
        return d if isinstance(d, (int, float)) else None

    vals = {
        "create_p50_vs_runc_run": (get("corral", "create", "median_ms"), get("runc", "create", "median_ms")),
        "create_throughput_vs_docker": (get("corral", "throughput", "per_s"), get("docker", "throughput", "per_s")),
        "exec_p50_vs_docker_exec": (get("corral", "exec", "median_ms"), get("docker", "exec", "median_ms")),
    }
    out = {}
    for k, (num, den) in vals.items():
        g = GOALS[k]
        v = ratio(num, den)
        entry: dict[str, Any] = {**g, "numerator": num, "denominator": den, "value": v}
        if v is None:
            entry["met"] = None
            entry["error"] = "missing data (see the systems' errors)"
        else:
            entry["met"] = v <= g["goal"] if g["op"] == "<=" else v >= g["goal"]
        out[k] = entry
    # for information: the corral exec against the raw primitives it replaces
    out["info"] = {
        "create_p50_vs_runc_run_with_rootfs": ratio(get("corral", "create", "median_ms"),
                                                    get("runc", "create_with_rootfs", "median_ms")),
        "create_p50_vs_docker_run": ratio(get("corral", "create", "median_ms"), get("docker", "create", "median_ms")),
        "exec_p50_vs_runc_exec": ratio(get("corral", "exec", "median_ms"), get("runc", "exec", "median_ms")),
        "exec_p50_vs_nsenter": ratio(get("corral", "exec", "median_ms"), get("runc", "exec_nsenter", "median_ms")),
        "create_throughput_vs_runc": ratio(get("corral", "throughput", "per_s"), get("runc", "throughput", "per_s")),
    }
    return out


COLORS = {"corral": "#2b7bba", "runc": "#e08a2c", "runc (nsenter)": "#f3c68c", "docker": "#5a9e4b"}


def plot(results: dict[str, Any], path: str) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    sysd = results["systems"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.8), gridspec_kw={"width_ratios": [2.2, 1.2, 1.2]})

    # latency box plots
    ax = axes[0]
    groups = [
        ("create", [("corral", "corral", "create"), ("runc", "runc", "create"), ("docker", "docker", "create")]),
        ("exec", [("corral", "corral", "exec"), ("runc", "runc", "exec"), ("runc (nsenter)", "runc", "exec_nsenter"),
                  ("docker", "docker", "exec")]),
        ("destroy", [("corral", "corral", "destroy"), ("runc", "runc", "destroy"), ("docker", "docker", "destroy")]),
    ]
    pos, ticks, ticklabels = 1.0, [], []
    for gname, members in groups:
        start = pos
        for label, sname, key in members:
            samples = (sysd.get(sname, {}).get(key) or {}).get("samples_ms") or []
            if samples:
                bp = ax.boxplot([samples], positions=[pos], widths=0.7, patch_artist=True, showfliers=True,
                                medianprops={"color": "black"}, flierprops={"markersize": 3})
                bp["boxes"][0].set_facecolor(COLORS[label])
                ax.text(pos + 0.38, float(np.median(samples)), f"{np.median(samples):.3g}", ha="left", va="center",
                        fontsize=7)
            pos += 1
        ticks.append((start + pos - 1) / 2)
        ticklabels.append(gname)
        pos += 0.8
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 4)  # headroom for the legend
    ax.set_xticks(ticks, ticklabels)
    ax.set_ylabel("latency per call (ms, log)")
    ax.set_title(f"sequential latency, n={results['config']['n']}")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], fontsize=8, loc="upper center", ncol=4)

    # throughput
    ax = axes[1]
    tp = (sysd.get("corral", {}).get("throughput") or {})
    bars = [
        (f"corral\n{results['config']['concurrency']}x create", (tp.get("concurrent_create") or {}).get("per_s"), COLORS["corral"]),
        ("corral\ncreate_batch", (tp.get("create_batch") or {}).get("per_s"), COLORS["corral"]),
        ("runc\nrun -d", (sysd.get("runc", {}).get("throughput") or {}).get("per_s"), COLORS["runc"]),
        ("docker\nrun -d", (sysd.get("docker", {}).get("throughput") or {}).get("per_s"), COLORS["docker"]),
    ]
    xs = np.arange(len(bars))
    ax.bar(xs, [b[1] or 0 for b in bars], color=[b[2] for b in bars])
    for x, b in zip(xs, bars):
        ax.text(x, (b[1] or 0), "n/a" if b[1] is None else f"{b[1]:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("sandboxes / s")
    ax.set_title(f"create throughput, {results['config']['concurrency']} concurrent")
    ax.grid(axis="y", alpha=0.3)

    # goals
    ax = axes[2]
    goals = [(g["name"], g) for g in results["goals"]]
    ys = np.arange(len(goals))
    for y, (k, g) in zip(ys, goals):
        v = g.get("value")
        if v is None:
            ax.text(1, y, "n/a", va="center")
            continue
        ax.barh(y, v, color="#4caf50" if g["met"] else "#e53935", height=0.5)
        ax.plot([g["target"], g["target"]], [y - 0.35, y + 0.35], color="black", lw=2)
        ax.text(v, y + 0.3, f" {v:.3g} (goal {'<=' if g['better'] == 'lower' else '>='} {g['target']:g})", va="center", fontsize=8)
    ax.set_yticks(ys, [k.replace("_vs_", "\nvs ") for k, _ in goals], fontsize=8)
    ax.set_xscale("log")
    xs_all = [g["target"] for _, g in goals] + [g["value"] for _, g in goals if g.get("value")]
    ax.set_xlim(min(xs_all) / 3, max(xs_all) * 30)
    ax.set_title("goal ratios (black tick = goal)")
    ax.grid(axis="x", which="both", alpha=0.3)

    m = results["machine"]
    fig.suptitle(f"corral sandbox lifecycle vs runc and docker: busybox, {m.get('nproc')} cores, "
                 f"kernel {m.get('kernel')}, {m.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict[str, Any]) -> str:
    sysd = results["systems"]
    rows = [("system", "op", "n", "p50", "p90", "p99", "mean")]
    for sname, key, label in [
        ("corral", "create", "create->ready"), ("runc", "create", "run -d"), ("runc", "create_with_rootfs", "mount+run -d"),
        ("docker", "create", "run -d"),
        ("corral", "exec", "exec true"), ("corral", "exec_shell", "exec 'echo hi'"), ("runc", "exec", "runc exec"),
        ("runc", "exec_nsenter", "nsenter -a"), ("docker", "exec", "docker exec"),
        ("corral", "destroy", "destroy"), ("runc", "destroy", "delete -f"), ("docker", "destroy", "rm -f"),
    ]:
        s = sysd.get(sname, {}).get(key)
        if not s or not s.get("n"):
            continue
        rows.append((sname, label, str(s["n"]), f"{s['median_ms']:.2f}", f"{s['p90_ms']:.2f}", f"{s['p99_ms']:.2f}",
                     f"{s['mean_ms']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["latency (ms)"] + ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                               for r in rows]
    lines.append(f"throughput ({results['config']['concurrency']} concurrent creates, sandboxes/s, median of rounds)")
    tp = sysd.get("corral", {}).get("throughput") or {}
    for label, v in [("corral concurrent create", (tp.get("concurrent_create") or {}).get("per_s")),
                     ("corral create_batch", (tp.get("create_batch") or {}).get("per_s")),
                     ("runc run -d", (sysd.get("runc", {}).get("throughput") or {}).get("per_s")),
                     ("docker run -d", (sysd.get("docker", {}).get("throughput") or {}).get("per_s"))]:
        lines.append(f"  {label:<26} {'n/a' if v is None else f'{v:.1f}'}")
    lines.append("goals")
    for g in results["goals"]:
        v = g.get("value")
        verdict = "n/a" if v is None else ("MET" if g["met"] else "MISSED")
        op = "<=" if g["better"] == "lower" else ">="
        lines.append(f"  {g['what']:<72} {'n/a' if v is None else f'{v:.3f}':>8}  goal {op} {g['target']:g}  {verdict}")
    for sname, s in sysd.items():
        if s.get("error"):
            lines.append(f"  ERROR {sname}: {s['error']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main

# the built-in image builder's CLI (it moved from the node-agent to the image-cache)
IMAGE_BUILDERS = ("corral_image_cache.builtin", "corral_image_cache.builtin")


def ensure_busybox(image_dir: str) -> str:
    import importlib.util
    rootfs = os.path.join(image_dir, IMAGE, "rootfs")
    errors = []
    for mod in IMAGE_BUILDERS:
        try:
            if importlib.util.find_spec(mod) is None:
                continue
        except ImportError:
            continue
        p = run([sys.executable, "-m", mod, "build", IMAGE, "--root", image_dir], timeout=600)
        if p.returncode == 0 and os.path.isdir(rootfs):
            return rootfs
        errors.append(f"{mod}: exit {p.returncode}: {(p.stderr or b'').decode(errors='replace')[-300:]}")
    if os.path.isdir(rootfs) and os.listdir(rootfs):
        log(f"using the existing {rootfs} ({'; '.join(errors) or 'no image builder module found'})")
        return rootfs
    raise RuntimeError(f"could not build the busybox image: {'; '.join(errors) or 'no image builder module found'}")


def _on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50, help="sequential samples per operation (default 50)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory (default bench/results)")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent creates for throughput (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per system (default 3, median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded create/exec/destroy cycles first (default 2)")
    ap.add_argument("--cpu", type=float, default=0.1, help="corral sandbox cpu request (default 0.1)")
    ap.add_argument("--memory-mb", type=int, default=64, help="corral sandbox memory request (default 64)")
    ap.add_argument("--image-dir", default=DEFAULT_IMAGE_DIR)
    ap.add_argument("--skip", action="append", default=[], choices=["corral", "runc", "docker"],
                    help="leave a system out (repeatable; for debugging)")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG (beside JSON) and print the summary of a saved run")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        plot(saved, os.path.splitext(args.replot)[0] + ".png")
        print(summary(saved))
        return 0
    signal.signal(signal.SIGTERM, _on_term)

    if os.geteuid() != 0:
        print("this benchmark needs root (runc, mounts, dockerd)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "sandbox_lifecycle",
        "machine": machine_info(),
        "config": {"n": args.n, "concurrency": args.concurrency, "rounds": args.rounds, "warmup": args.warmup,
                   "image": IMAGE, "corral_spec": {"cpu": args.cpu, "memory_mb": args.memory_mb},
                   "image_dir": args.image_dir, "run_id": run_id},
        "systems": {},
    }
    systems = results["systems"]
    log(f"sandbox_lifecycle: n={args.n} concurrency={args.concurrency} rounds={args.rounds} run_id={run_id}")

    try:
        rootfs = ensure_busybox(args.image_dir)
    except Exception as e:  # noqa: BLE001
        print(f"cannot prepare the busybox image: {e}", file=sys.stderr)
        return 1
    results["config"]["rootfs"] = rootfs

    db = DockerBench(rootfs, run_id)
    try:
        docker_ready = False
        if "docker" not in args.skip:
            try:
                systems["docker"] = {"daemon": db.ensure_daemon()}
                systems["docker"]["versions"] = db.versions()
                stale = db.remove_stale()
                if any(stale.values()):
                    systems["docker"]["stale_removed"] = stale
                systems["docker"]["image_import_ms"] = round(db.import_image(), 1)
                docker_ready = True
            except Exception as e:  # noqa: BLE001
                systems["docker"] = {"error": f"{type(e).__name__}: {e}"}
                log(f"docker: unavailable: {e}")

        if "runc" not in args.skip:
            systems["runc"] = bench_runc(rootfs, args.n, args.warmup, args.concurrency, args.rounds)
        if docker_ready:
            systems["docker"].update(bench_docker(db, args.n, args.warmup, args.concurrency, args.rounds))
        if "corral" not in args.skip:
            systems["corral"] = asyncio.run(bench_corral(args.image_dir, args.n, args.warmup, args.concurrency,
                                                         args.rounds, args.cpu, args.memory_mb))
    finally:
        notes = db.cleanup()
        if notes:
            systems.setdefault("docker", {})["cleanup_notes"] = notes

    results["machine"]["loadavg_end"] = loadavg()
    results["goal_detail"] = compute_goals(systems)
    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    jpath = save(args.out, "sandbox_lifecycle", results, plot, goals(results["goal_detail"]))
    ppath = os.path.join(args.out, "sandbox_lifecycle.png")
    print()
    print(summary(results))
    print(f"\nwrote {jpath} and {ppath} in {results['elapsed_s']} s")
    if results["machine"]["foreign_corral_processes_start"]:
        print(f"note: {results['machine']['foreign_corral_processes_start']} other corral service processes were "
              f"running when the bench started (load {results['machine']['loadavg_start']}): numbers are noisier")
    failed = [s for s, d in systems.items() if d.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
