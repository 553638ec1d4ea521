"""Lazy start of a large image: time to the first exec result and bytes fetched before it, on a cold
node cache, for the same >= 1 GiB image, side by side in one run.

The image is `debian` (or `busybox` when the catalog has no debian) plus one layer of ~1 GiB of
generated files of random content (a fake repository with a git pack, dataset shards, model
checkpoints: nothing deduplicates). The task reads a few small files and runs a command:
`cat` a config, `python3 -c` that parses a JSON file (debian only), `md5sum` of one 1 MiB file.

  lazy        fresh node cache (loader `evict` of every unused layer + `echo 3 > drop_caches`),
              image with no prefetch trace: create request -> first exec result; bytes fetched from
              the chunk store before the result (loader stats `bytes_fetched`). This start records
              the image's prefetch trace (the loader records for --trace-window-s after prepare).
  lazy+trace  fresh node cache again, the same image (its trace is replayed as prefetch at prepare):
              time to first exec, and demand misses (loader `chunk_misses`: demand reads that had to
              start a fetch) against the chunks the cold start needed (the trace's length).
  eager       fresh node cache, then every chunk of every layer fetched first (loader prepare, every
              chunk of each layer read through its FUSE file by 16 threads, release), then create
              and first exec. Time = fetch + create + first exec.
  docker      `docker load` of a `docker save` archive of the same root filesystem (base rootfs +
              the generated layer, `docker import`ed) with the image removed and the page cache
              dropped beforehand, then `docker run --rm --network none IMG sh -c TASK`.
  lazy, no readahead  the lazy start again (--reps times, fresh image names) after restarting the
              node's loader with `--readahead-chunks 0`: the bytes the task itself reads, without
              the chunks the loader fetches ahead of sequential readers (skip: --no-readahead-pass).
  worst case  a task reading the whole image (`tar -cf - --one-file-system . | wc -c` at /), lazy
              (cold, no trace) vs eager (cold, fetch everything, then the same task).

Each of lazy / lazy+trace / eager / docker runs --reps times (medians are the headline); every
sample is in the JSON. The generated files are kept in --cache (default
/var/tmp/corral-bench-lazy) with the docker archive, so reruns do not regenerate them.

    .venv/bin/python -m bench.lazy_start [--reps 3] [--size-mib 1024] [--out bench/results]
                                         [--loader-args "--readahead-chunks 0"] [--no-docker] [--no-worst]

The stack is the embedded one (`corral_sdk.stack.Stack`, no monitor, node substrates: container);
`BenchStack` only appends --loader-args to the loader's command line (Stack passes `node_args` to
node-agents, not to loaders), and the no-readahead pass restarts the loader process with one more flag.

Run as root (runc, mounts, drop_caches, dockerd). dockerd: used if `docker info` answers, else
started here (`dockerd --host unix:///var/run/docker.sock`) and stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from bench._common import goals_from_ops, log, pyplot, save
from corral_common.contract import subjects
from corral_sdk import AsyncClient
from corral_sdk.stack import Stack, free_port
from tests.dockerd import docker_ok, start_dockerd

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
GEN_VERSION = "v1"
NODE = "node-1"
DOCKER_REPO = "corral-bench-lazy"

GOALS = {
    "first_exec_lazy_vs_eager": {"goal": 0.1, "op": "<=",
                                 "what": "lazy time to first exec (median) / eager fetch-all + start + first exec (median)"},
    "bytes_fetched_fraction": {"goal": 0.06, "op": "<=", "unit": "fraction",
                               "what": "bytes fetched before the first exec result (lazy, median) / image size"},
    "trace_demand_miss_fraction": {"goal": 0.05, "op": "<=", "unit": "fraction",
                                   "what": "demand misses with the trace replayed (median) / chunks the cold start needed"},
}


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


# ---------------------------------------------------------------------------------- generated data


def _text(n: int) -> bytes:
    """n bytes of source-like text that never repeats (base64 of random bytes, in lines)."""
    raw = base64.b64encode(os.urandom(n * 3 // 4 + 3))[:n]
    return b"\n".join(raw[i:i + 76] for i in range(0, len(raw), 77))[:n]


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _write_random(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 << 20)
            f.write(os.urandom(n))
            left -= n


def generate(root: str, size_mib: int) -> dict[str, Any]:
    """Fill `root/data` with ~size_mib MiB of random files of mixed sizes; returns what the task needs."""
    rnd = random.Random(7)
    total = size_mib << 20
    data = os.path.join(root, "data")
    written = 0
    files = 0
    config = b"".join(f"key_{i}: {base64.b16encode(os.urandom(8)).decode().lower()}\n".encode() for i in range(64))
    _write(f"{data}/config.yaml", config)
    pkg = {"name": "corral-bench-fake-repo", "version": "1.2.3", "nonce": base64.b16encode(os.urandom(16)).decode()}
    _write(f"{data}/repo/package.json", json.dumps(pkg, indent=2).encode())
    sample = os.urandom(1 << 20)
    _write(f"{data}/datasets/sample-1M.bin", sample)
    written += len(config) + 1 + len(sample)
    files += 3
    # a fake repository: ~8% in source files of 256 B .. 128 KiB, ~10% in a git pack
    budget = total * 8 // 100
    i = 0
    while budget > 0:
        n = int(min(128 << 10, max(256, rnd.lognormvariate(8.5, 1.2))))
        _write(f"{data}/repo/src/pkg{i % 97:02d}/sub{(i // 97) % 7}/mod_{i:05d}.py", _text(n))
        budget -= n
        written += n
        files += 1
        i += 1
    for j in range(4):
        n = total * 10 // 100 // 4
        _write_random(f"{data}/repo/.git/objects/pack/pack-{j:02d}{base64.b16encode(os.urandom(6)).decode().lower()}.pack", n)
        written += n
        files += 1
    # dataset shards of 4 .. 64 MiB (~55%), the rest as model checkpoints of 32 .. 96 MiB
    budget = total * 55 // 100
    j = 0
    while budget > 0:
        n = min(budget, rnd.randint(4, 64) << 20)
        _write_random(f"{data}/datasets/train/shard-{j:05d}.parquet", n)
        budget -= n
        written += n
        files += 1
        j += 1
    j = 0
    while written < total:
        n = min(total - written, rnd.randint(32, 96) << 20)
        _write_random(f"{data}/models/checkpoint-{j:03d}.bin", n)
        written += n
        files += 1
        j += 1
    return {"files": files, "bytes": written, "sample_md5": hashlib.md5(sample).hexdigest(), "package_name": pkg["name"]}


def ensure_generated(cache: str, size_mib: int) -> tuple[str, dict[str, Any]]:
    """The layer directory (holding `data/`) and its meta, generated once per (version, size)."""
    d = os.path.join(cache, f"{GEN_VERSION}-{size_mib}")
    layer = os.path.join(d, "layer")
    meta_path = os.path.join(d, "meta.json")
    if os.path.exists(meta_path) and os.path.isdir(layer):
        with open(meta_path) as f:
            meta = json.load(f)
        meta["generated_s"] = 0.0
        meta["reused"] = True
        return layer, meta
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    log(f"generating ~{size_mib} MiB of random files under {layer}")
    t0 = time.perf_counter()
    meta = generate(layer, size_mib)
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".tmp", meta_path)
    meta["generated_s"] = round(time.perf_counter() - t0, 2)
    meta["reused"] = False
    return layer, meta


# ---------------------------------------------------------------------------------- machine


def sh(cmd: list[str] | str, check: bool = True, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str), **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{cmd if isinstance(cmd, str) else shlex.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    return p


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                            "loadavg_start": list(os.getloadavg())}
    try:
        rev = sh(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = sh(["git", "-C", REPO, "status", "--porcelain"]).stdout.strip()
        info["corral_commit"] = rev + ("-dirty" if dirty else "")
    except Exception:  # not a git checkout (or no git): the result has no commit
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_mb"] = int(f.readline().split()[1]) // 1024
    except OSError:
        pass
    return info


class BenchStack(Stack):
    """The embedded stack, with extra arguments for the node loaders (`bench_loader_args`).

    Stack passes `node_args` to node-agents only; the loaders' flags (e.g. --readahead-chunks,
    --trace-window-s) are appended here without changing Stack."""

    bench_loader_args: list[str] = []

    def _start(self, name, argv, *rest, **kw):
        if name.startswith("loader-"):
            argv = [*argv, *self.bench_loader_args]
        return super()._start(name, argv, *rest, **kw)


# ---------------------------------------------------------------------------------- docker


class Docker:
    def __init__(self) -> None:
        self.daemon: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def up(self, timeout: float = 60) -> None:
        if docker_ok():
            self.info["dockerd_started_by_bench"] = False
            return
        log("docker: starting dockerd")
        t0 = time.monotonic()
        self.daemon, why = start_dockerd(f"/tmp/corral-bench-lazy-dockerd-{os.getpid()}.log", timeout)
        if self.daemon is None:
            raise RuntimeError(why)
        self.info.update(dockerd_started_by_bench=True, dockerd_start_s=round(time.monotonic() - t0, 2))

    def down(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            log("docker: stopping the dockerd this bench started")
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    @staticmethod
    def rmi(tag: str) -> None:
        sh(["docker", "rmi", "-f", tag], check=False, timeout=300)

    def ensure_archive(self, cache: str, base_rootfs: str, base_name: str, layer_dir: str, size_mib: int) -> tuple[str, str, float]:
        """A `docker save` archive of base rootfs + generated layer; built once, kept in the cache."""
        tag = f"{DOCKER_REPO}:{GEN_VERSION}-{size_mib}-{base_name}"
        d = os.path.join(cache, f"{GEN_VERSION}-{size_mib}")
        path = os.path.join(d, f"docker-{base_name}.tar")
        stamp = os.path.getmtime(base_rootfs)
        meta = path + ".json"
        if os.path.exists(path) and os.path.exists(meta):
            with open(meta) as f:
                if json.load(f).get("base_mtime") == stamp:
                    return path, tag, 0.0
        log(f"docker: building {tag} (docker import of {base_rootfs} + {layer_dir}) and saving it to {path}")
        t0 = time.perf_counter()
        self.rmi(tag)
        sh(f"tar --numeric-owner -C {shlex.quote(base_rootfs)} -cf - . -C {shlex.quote(layer_dir)} ./data"
           f" | docker import - {tag}")
        sh(["docker", "save", "-o", path + ".tmp", tag])
        os.replace(path + ".tmp", path)
        with open(meta, "w") as f:
            json.dump({"tag": tag, "base_mtime": stamp}, f)
        self.rmi(tag)
        return path, tag, round(time.perf_counter() - t0, 2)


# ---------------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.res: dict[str, Any] = {"benchmark": "lazy_start", "errors": []}

    # ---- loader helpers

    async def loader(self, op: str, body: dict | None = None, timeout: float = 120) -> dict:
        m = await self.c.nc.request(subjects.node_loader(NODE, op), json.dumps(body or {}).encode(), timeout=timeout)
        r = json.loads(m.data)
        if not r.get("ok"):
            raise RuntimeError(f"loader {op}: {r.get('error')}")
        return r

    async def image_req(self, op: str, body: dict, timeout: float = 1800) -> dict:
        m = await self.c.nc.request(subjects.image_op(op), json.dumps(body).encode(), timeout=timeout)
        r = json.loads(m.data)
        if not r.get("ok"):
            raise RuntimeError(f"image {op} {body}: {r.get('error')}")
        return r

    async def quiet(self, timeout: float = 120) -> None:
        """Wait until the loader records no trace and has no fetch queued or running."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.loader("stats")
            busy = st["recording"] or st["pending"] or st["inflight"] or any(st["queued"].values())
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"loader still busy after {timeout:g}s: {st['recording']} pending={st['pending']}")
            await asyncio.sleep(0.2)

    async def cold(self) -> None:
        """A fresh node cache: every unused layer evicted, the kernel's page cache dropped."""
        await self.quiet()
        await self.loader("evict", {})
        st = await self.loader("stats")
        left = {d: x["cached_bytes"] for d, x in st["layers"].items() if d in self.layers and x["cached_bytes"]}
        if left:
            raise RuntimeError(f"layers still cached after evict: {left}")
        await asyncio.to_thread(drop_caches)

    async def snap(self) -> dict:
        return await self.loader("stats")

    @staticmethod
    def delta(a: dict, b: dict, key: str) -> int:
        return int(b[key] - a[key])

    # ---- one start

    async def start_and_exec(self, image: str, cmd: str, timeout_s: float = 120) -> dict[str, Any]:
        s0 = await self.snap()
        t0 = time.perf_counter()
        sb = await self.c.create(image=image, cpu=1.0, memory_mb=1024, disk_mb=256, ttl_s=3600, timeout=120)
        t1 = time.perf_counter()
        try:
            r = await sb.exec(cmd, timeout_s=timeout_s, max_output_bytes=65536)
            t2 = time.perf_counter()
            s1 = await self.snap()
        finally:
            await sb.destroy()
        if r.exit_code != 0:
            raise RuntimeError(f"task failed in {image}: exit {r.exit_code}: {r.stderr[-1000:]}")
        out = {
            "create_ms": round((t1 - t0) * 1000, 1), "exec_ms": round((t2 - t1) * 1000, 1),
            "first_exec_ms": round((t2 - t0) * 1000, 1), "stdout": r.stdout[-300:],
            "bytes_fetched": self.delta(s0, s1, "bytes_fetched"), "fetches": self.delta(s0, s1, "fetches"),
            "fetches_demand": self.delta(s0, s1, "fetches_demand"), "fetches_prefetch": self.delta(s0, s1, "fetches_prefetch"),
            "chunk_misses": self.delta(s0, s1, "chunk_misses"), "chunk_joins": self.delta(s0, s1, "chunk_joins"),
            "chunk_hits": self.delta(s0, s1, "chunk_hits"), "readahead_chunks": self.delta(s0, s1, "readahead_chunks"),
            "prefetched_chunks": self.delta(s0, s1, "prefetched_chunks"),
        }
        await self.quiet()
        s2 = await self.snap()
        out["bytes_fetched_settled"] = self.delta(s0, s2, "bytes_fetched")  # with readahead/prefetch finished
        return out

    def check_task_output(self, out: str) -> None:
        if self.meta["sample_md5"] not in out:
            raise RuntimeError(f"task output lacks the sample's md5 {self.meta['sample_md5']}: {out!r}")
        if self.base == "debian" and self.meta["package_name"] not in out:
            raise RuntimeError(f"task output lacks the package name: {out!r}")

    # ---- variants

    async def lazy_cold(self, image: str) -> dict:
        await self.cold()
        r = await self.start_and_exec(image, self.task)
        self.check_task_output(r["stdout"])
        await self.quiet()  # the recording window ends and the trace is stored
        r["trace_chunks"] = (await self.image_req("inspect", {"name": image}))["trace_chunks"]
        return r

    async def lazy_trace(self, image: str, cold: dict) -> dict:
        await self.cold()
        r = await self.start_and_exec(image, self.task)
        self.check_task_output(r["stdout"])
        need = cold["trace_chunks"] or (cold["chunk_misses"] + cold["fetches_prefetch"])
        r["cold_chunks_needed"] = need
        r["demand_miss_fraction"] = round(r["chunk_misses"] / need, 4) if need else None
        return r

    async def fetch_all(self) -> dict:
        """Every chunk of every layer of the image into the node cache, through the FUSE files."""
        s0 = await self.snap()
        t0 = time.perf_counter()
        r = await self.loader("prepare", {"image": "", "layers": self.layers})
        paths = r["paths"]
        jobs = []
        for d in self.layers:
            size, cs = self.layer_sizes[d]
            jobs += [(paths[d], off, min(cs, size - off)) for off in range(0, size, cs)]

        def read_all() -> int:
            fds = {p: os.open(p, os.O_RDONLY) for p in paths.values()}
            try:
                def one(job):
                    p, off, n = job
                    got = 0
                    while got < n:
                        b = os.pread(fds[p], n - got, off + got)
                        if not b:
                            raise IOError(f"short read of {p} at {off + got}")
                        got += len(b)
                    return got

                with concurrent.futures.ThreadPoolExecutor(16) as ex:
                    return sum(ex.map(one, jobs))
            finally:
                for fd in fds.values():
                    os.close(fd)

        nbytes = await asyncio.to_thread(read_all)
        await self.loader("release", {"layers": self.layers})
        t1 = time.perf_counter()
        s1 = await self.snap()
        return {"fetch_all_ms": round((t1 - t0) * 1000, 1), "bytes_read": nbytes,
                "bytes_fetched": self.delta(s0, s1, "bytes_fetched"),
                "throughput_mib_s": round(nbytes / (1 << 20) / (t1 - t0), 1)}

    async def eager(self, image: str, cmd: str, timeout_s: float = 120) -> dict:
        await self.cold()
        f = await self.fetch_all()
        r = await self.start_and_exec(image, cmd, timeout_s)
        r["fetch_all_ms"] = f["fetch_all_ms"]
        r["fetch_all_bytes"] = f["bytes_fetched"]
        r["fetch_all_mib_s"] = f["throughput_mib_s"]
        r["start_and_exec_ms"] = r["first_exec_ms"]
        r["first_exec_ms"] = round(f["fetch_all_ms"] + r["first_exec_ms"], 1)
        r["bytes_fetched_total"] = f["bytes_fetched"] + r["bytes_fetched"]
        return r

    def docker_run(self, cmd: str) -> dict:
        Docker.rmi(self.docker_tag)
        drop_caches()
        t0 = time.perf_counter()
        sh(["docker", "load", "-q", "-i", self.docker_tar])
        t1 = time.perf_counter()
        p = sh(["docker", "run", "--rm", "--network", "none", self.docker_tag, "sh", "-c", cmd])
        t2 = time.perf_counter()
        Docker.rmi(self.docker_tag)
        return {"load_ms": round((t1 - t0) * 1000, 1), "run_ms": round((t2 - t1) * 1000, 1),
                "first_exec_ms": round((t2 - t0) * 1000, 1), "stdout": p.stdout[-300:]}

    # ---- the run

    async def run(self) -> dict:
        a = self.args
        res = self.res
        res["machine"] = machine_info()
        t_start = time.perf_counter()
        layer_dir, self.meta = ensure_generated(a.cache, a.size_mib)
        res["generated"] = {"dir": layer_dir, **self.meta}
        data = tempfile.mkdtemp(prefix="crl-bench-lazy-", dir="/tmp")
        stack = BenchStack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, monitor=False,
                           node_args=["--substrate", "container"])
        stack.bench_loader_args = shlex.split(a.loader_args)
        docker = Docker()
        ok = False
        try:
            t0 = time.perf_counter()
            await stack.start(timeout=300)
            res["stack_start_s"] = round(time.perf_counter() - t0, 2)
            self.c = await AsyncClient.connect(stack.url)
            try:
                await self.image_req("inspect", {"name": "debian"}, timeout=30)
                self.base = "debian"
            except RuntimeError:
                self.base = "busybox"
            if self.base == "debian":
                self.task = ("cat /data/config.yaml > /dev/null && "
                             "python3 -c 'import json; print(json.load(open(\"/data/repo/package.json\"))[\"name\"])' && "
                             "md5sum /data/datasets/sample-1M.bin")
            else:
                self.task = "cat /data/config.yaml > /dev/null && head -c 200 /data/repo/package.json && md5sum /data/datasets/sample-1M.bin"
            self.worst_task = "cd / && tar -cf - --one-file-system . 2>/dev/null | wc -c"
            log(f"importing the image (base {self.base} + {layer_dir})")
            t0 = time.perf_counter()
            imp = await self.image_req("import", {"name": "lazybench", "source": "dir", "path": layer_dir, "base": self.base})
            import_s = time.perf_counter() - t0
            self.layers = imp["image"]["layers"]
            insp = await self.image_req("inspect", {"name": "lazybench"})
            self.layer_sizes = {x["digest"]: (x["size"], x["chunk_size"]) for x in insp["layers"]}
            self.image_size = sum(s for s, _ in self.layer_sizes.values())
            self.image_chunks = sum(x["chunks"] for x in insp["layers"])
            res["image"] = {"base": self.base, "size": self.image_size, "size_mib": round(self.image_size / (1 << 20), 1),
                            "chunks": self.image_chunks, "import_s": round(import_s, 2), "uploaded_bytes": imp["uploaded_bytes"],
                            "layers": insp["layers"], "task": self.task, "worst_task": self.worst_task}
            res["config"] = {"reps": a.reps, "size_mib": a.size_mib, "loader_args": stack.bench_loader_args,
                             "sandbox": {"cpu": 1.0, "memory_mb": 1024}, "node_substrates": ["container"],
                             "cold": "loader evict of every unused layer + sync + echo 3 > /proc/sys/vm/drop_caches"}
            log(f"image: {res['image']['size_mib']} MiB in {self.image_chunks} chunks, imported in {import_s:.1f}s")
            # one image name per rep (the same layers): each has no trace until its cold start records one
            names = [f"lazybench-r{i}" for i in range(a.reps)]
            for n in names + ["lazybench-worst"]:
                await self.image_req("import", {"name": n, "source": "layers", "layers": self.layers})
            if not a.no_docker:
                try:
                    await asyncio.to_thread(docker.up)
                    base_rootfs = os.path.join(IMAGE_DIR, self.base, "rootfs")
                    self.docker_tar, self.docker_tag, build_s = await asyncio.to_thread(
                        docker.ensure_archive, a.cache, base_rootfs, self.base, layer_dir, a.size_mib)
                    docker.info.update(archive=self.docker_tar, archive_bytes=os.path.getsize(self.docker_tar), build_s=build_s,
                                       version=sh(["docker", "version", "-f", "{{.Server.Version}}"], check=False).stdout.strip())
                except Exception as e:
                    docker.info["error"] = f"{type(e).__name__}: {e}"
                    log(f"docker unavailable: {e}")
            samples: dict[str, list[dict]] = {"lazy": [], "lazy_trace": [], "eager": [], "docker": []}
            for i, name in enumerate(names):
                log(f"rep {i + 1}/{a.reps}: lazy (cold, records the trace)")
                cold = await self.lazy_cold(name)
                samples["lazy"].append(cold)
                log(f"  lazy: first exec {cold['first_exec_ms']:.0f} ms (create {cold['create_ms']:.0f}), "
                    f"{cold['bytes_fetched'] / 1e6:.1f} MB fetched, trace {cold['trace_chunks']} chunks")
                r = await self.lazy_trace(name, cold)
                samples["lazy_trace"].append(r)
                log(f"  lazy+trace: first exec {r['first_exec_ms']:.0f} ms, demand misses {r['chunk_misses']}/"
                    f"{r['cold_chunks_needed']}, joins {r['chunk_joins']}, {r['bytes_fetched'] / 1e6:.1f} MB fetched")
                r = await self.eager(name, self.task)
                self.check_task_output(r["stdout"])
                samples["eager"].append(r)
                log(f"  eager: fetch all {r['fetch_all_ms']:.0f} ms ({r['fetch_all_mib_s']} MiB/s) + start and exec "
                    f"{r['start_and_exec_ms']:.0f} ms")
                if not a.no_docker and "error" not in docker.info:
                    try:
                        r = await asyncio.to_thread(self.docker_run, self.task)
                        self.check_task_output(r["stdout"])
                        samples["docker"].append(r)
                        log(f"  docker: load {r['load_ms']:.0f} ms + run {r['run_ms']:.0f} ms")
                    except Exception as e:
                        docker.info["error"] = f"{type(e).__name__}: {e}"
                        log(f"  docker failed: {e}")
            res["samples"] = samples
            res["docker"] = docker.info
            if not a.no_readahead_pass:
                # the same cold lazy start with the loader's readahead off: the bytes the task itself needs
                await self.restart_loader(stack, ["--readahead-chunks", "0"])
                samples["lazy_no_readahead"] = []
                for i in range(a.reps):
                    name = f"lazybench-nr{i}"
                    await self.image_req("import", {"name": name, "source": "layers", "layers": self.layers})
                    r = await self.lazy_cold(name)
                    samples["lazy_no_readahead"].append(r)
                    log(f"  lazy, loader --readahead-chunks 0: first exec {r['first_exec_ms']:.0f} ms, "
                        f"{r['bytes_fetched'] / 1e6:.1f} MB fetched")
                await self.restart_loader(stack, [])
            if not a.no_worst:
                log("worst case: the task reads the whole image, lazy (cold, no trace)")
                lw = await self.lazy_worst()
                log(f"  lazy: {lw['first_exec_ms'] / 1000:.1f} s, {lw['bytes_fetched_settled'] / 1e6:.0f} MB fetched")
                log("worst case: eager (cold, fetch everything, then the same task)")
                ew = await self.eager(names[0], self.worst_task, timeout_s=1800)
                log(f"  eager: {ew['first_exec_ms'] / 1000:.1f} s (fetch {ew['fetch_all_ms'] / 1000:.1f} s)")
                res["worst_case"] = {"lazy": lw, "eager": ew, "lazy_vs_eager": round(lw["first_exec_ms"] / ew["first_exec_ms"], 3),
                                     "tar_bytes": int(lw["stdout"].split()[-1])}
            await self.c.close()
            ok = True
        except Exception as e:
            res["errors"].append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            log(f"error: {e}")
        finally:
            await stack.stop()
            if ok:
                shutil.rmtree(data, ignore_errors=True)
            else:
                res["stack_data_dir_kept"] = data
            if not a.no_docker:
                try:
                    Docker.rmi(getattr(self, "docker_tag", f"{DOCKER_REPO}:none"))
                except Exception:  # the image may never have been built
                    pass
                docker.down()
        res["summary"], legacy = self.summarise(res)
        res["goal_info"] = legacy.pop("info")
        res["goals"] = goals_from_ops(legacy, notes=goal_notes(res["summary"]))  # Goal structs until save writes them
        res["machine"]["loadavg_end"] = list(os.getloadavg())
        res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        return res

    async def restart_loader(self, stack: Stack, extra: list[str]) -> None:
        """Restart the node's loader (no layer in use: the node cache was just emptied) with `extra`
        appended to the arguments it was started with."""
        await self.quiet()
        p = stack.proc("loader-1")
        if not hasattr(self, "loader_argv"):
            self.loader_argv = list(p.argv)
        p.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(p.popen.wait, 60)
        p.argv = [*self.loader_argv, *extra]
        stack.restart("loader-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                await self.loader("stats", timeout=2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def lazy_worst(self) -> dict:
        await self.cold()
        r = await self.start_and_exec("lazybench-worst", self.worst_task, timeout_s=1800)
        await self.quiet()
        return r

    def summarise(self, res: dict) -> tuple[dict, dict]:
        s = res.get("samples") or {}
        size = getattr(self, "image_size", 0)

        def m(var: str, key: str):
            return med([x.get(key) for x in s.get(var, [])])

        summ = {
            "image_size": size,
            "first_exec_ms": {v: m(v, "first_exec_ms") for v in ("lazy", "lazy_trace", "eager", "docker", "lazy_no_readahead")},
            "create_ms": {v: m(v, "create_ms") for v in ("lazy", "lazy_trace")},
            "eager_fetch_all_ms": m("eager", "fetch_all_ms"),
            "eager_fetch_all_mib_s": m("eager", "fetch_all_mib_s"),
            "docker_load_ms": m("docker", "load_ms"),
            "docker_run_ms": m("docker", "run_ms"),
            "bytes_fetched_before_first_exec": {v: m(v, "bytes_fetched") for v in ("lazy", "lazy_trace", "lazy_no_readahead")},
            "bytes_fetched_settled": {v: m(v, "bytes_fetched_settled") for v in ("lazy", "lazy_trace")},
            "cold_chunks_needed": m("lazy", "trace_chunks"),
            "cold_demand_misses": m("lazy", "chunk_misses"),
            "trace_demand_misses": m("lazy_trace", "chunk_misses"),
            "trace_joins": m("lazy_trace", "chunk_joins"),
            "trace_prefetched_chunks": m("lazy_trace", "prefetched_chunks"),
            # the cold task is a chain of demand misses: its exec time per miss approximates one
            # chunk's fetch latency (store get + verify + cache write + FUSE round trip)
            "lazy_exec_ms_per_demand_miss": med([x["exec_ms"] / x["chunk_misses"] for x in s.get("lazy", []) if x.get("chunk_misses")]),
        }
        fe = summ["first_exec_ms"]
        for v in ("lazy", "lazy_trace", "docker"):
            if fe.get(v) and fe.get("eager"):
                summ[f"{v}_vs_eager"] = round(fe[v] / fe["eager"], 4)
        if fe.get("lazy") and fe.get("docker"):
            summ["lazy_vs_docker"] = round(fe["lazy"] / fe["docker"], 4)
        values = {
            "first_exec_lazy_vs_eager": summ.get("lazy_vs_eager"),
            "bytes_fetched_fraction": (round(summ["bytes_fetched_before_first_exec"]["lazy"] / size, 4)
                                       if size and summ["bytes_fetched_before_first_exec"]["lazy"] is not None else None),
            "trace_demand_miss_fraction": med([x.get("demand_miss_fraction") for x in s.get("lazy_trace", [])]),
        }
        goals = {}
        for k, g in GOALS.items():
            v = values[k]
            goals[k] = {**g, "value": v, "met": None if v is None else (v <= g["goal"] if g["op"] == "<=" else v >= g["goal"])}
        goals["info"] = {"lazy_trace_vs_eager": summ.get("lazy_trace_vs_eager"), "lazy_vs_docker": summ.get("lazy_vs_docker"),
                         "docker_vs_eager": summ.get("docker_vs_eager"),
                         "bytes_fetched_settled_fraction": (round(summ["bytes_fetched_settled"]["lazy"] / size, 4)
                                                            if size and summ["bytes_fetched_settled"]["lazy"] is not None else None),
                         "worst_case_lazy_vs_eager": (res.get("worst_case") or {}).get("lazy_vs_eager"),
                         "bytes_fetched_fraction_no_readahead": (
                             round(summ["bytes_fetched_before_first_exec"]["lazy_no_readahead"] / size, 4)
                             if size and summ["bytes_fetched_before_first_exec"]["lazy_no_readahead"] is not None else None)}
        return summ, goals


def goal_notes(summ: dict[str, Any]) -> dict[str, str]:
    """The numbers behind each goal's ratio, for the docs' result column."""
    fe, b, size = summ["first_exec_ms"], summ["bytes_fetched_before_first_exec"], summ.get("image_size") or 0

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.0f} ms"

    notes = {"first_exec_lazy_vs_eager": f"{ms(fe.get('lazy'))} / {ms(fe.get('eager'))}; with the prefetch trace "
                                         f"{ms(fe.get('lazy_trace'))}, Docker load + run {ms(fe.get('docker'))}"}
    if b.get("lazy") is not None and size:
        notes["bytes_fetched_fraction"] = f"{b['lazy'] / 1e6:,.0f} MB of {size / 1e6:,.0f} MB"
    if summ.get("trace_demand_misses") is not None:
        notes["trace_demand_miss_fraction"] = f"{summ['trace_demand_misses']} misses, {summ.get('cold_chunks_needed')} chunks needed cold"
    return notes


# ---------------------------------------------------------------------------------- plot


def plot(res: dict, path: str) -> None:
    plt = pyplot()

    s = res.get("samples") or {}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))
    a = axes[0]
    names = [("lazy", "lazy\n(cold)", "#4a8"), ("lazy_trace", "lazy +\ntrace", "#2a6"), ("eager", "eager\n(fetch all)", "#c84"),
             ("docker", "docker\nload+run", "#58c"), ("lazy_no_readahead", "lazy, no\nreadahead", "#8c8")]
    xs, labels = [], []
    for i, (k, label, col) in enumerate(names):
        vals = [x["first_exec_ms"] / 1000 for x in s.get(k, [])]
        if not vals:
            continue
        m = statistics.median(vals)
        a.bar(i, m, color=col)
        a.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
        a.text(i, m * 1.15, f"{m:.2f}s" if m < 10 else f"{m:.1f}s", ha="center", fontsize=9)
        xs.append(i)
        labels.append(label)
    a.set_xticks(xs, labels)
    a.set_yscale("log")
    a.set_ylabel("create request -> first exec result (s, log)")
    img = res.get("image", {})
    a.set_title(f"time to first exec, {img.get('size_mib', '?')} MiB image, cold node")

    a = axes[1]
    size = img.get("size") or 1
    bars = []
    for k, label, col in [names[0], names[4], names[1]]:
        vals = [x["bytes_fetched"] / (1 << 20) for x in s.get(k, [])]
        if vals:
            bars.append((label, statistics.median(vals), col))
    if s.get("eager"):
        bars.append(("eager\n(fetch all)", statistics.median(x["bytes_fetched_total"] for x in s["eager"]) / (1 << 20), "#c84"))
    for i, (label, v, col) in enumerate(bars):
        a.bar(i, v, color=col)
        a.text(i, v * 1.15, f"{v:.0f} MiB\n{100 * v * (1 << 20) / size:.1f}%", ha="center", fontsize=8)
    a.axhline(0.06 * size / (1 << 20), color="r", ls="--", lw=1, label="6% of the image (goal)")
    a.set_ylim(1, size / (1 << 20) * 5)
    a.set_xticks(range(len(bars)), [b[0] for b in bars])
    a.set_yscale("log")
    a.set_ylabel("MiB fetched before the first exec result (log)")
    a.set_title("bytes fetched from the chunk store")
    a.legend(fontsize=8)

    a = axes[2]
    w = res.get("worst_case")
    if w:
        vals = [w["lazy"]["first_exec_ms"] / 1000, w["eager"]["fetch_all_ms"] / 1000, w["eager"]["start_and_exec_ms"] / 1000]
        a.bar([0], [vals[0]], color="#4a8", label="lazy: start + read everything")
        a.bar([1], [vals[1]], color="#c84", label="eager: fetch all")
        a.bar([1], [vals[2]], bottom=[vals[1]], color="#e3b27a", label="eager: then start + read everything")
        a.text(0, vals[0] * 1.02, f"{vals[0]:.1f}s", ha="center")
        a.text(1, (vals[1] + vals[2]) * 1.02, f"{vals[1] + vals[2]:.1f}s", ha="center")
        a.set_xticks([0, 1], ["lazy", "eager"])
        a.legend(fontsize=8, loc="lower center")
    a.set_ylabel("seconds")
    a.set_title("worst case: the task reads the whole image")

    a = axes[3]
    goals = [(g["name"], g) for g in res.get("goals", []) if g.get("value") is not None]
    for i, (k, g) in enumerate(goals):
        a.barh(i, g["value"], color="#5a5" if g["met"] else "#c55")
        a.plot([g["target"], g["target"]], [i - 0.4, i + 0.4], color="k", lw=2)
        a.text(g["value"], i, f" {g['value']:.3f}", va="center", fontsize=9)
    a.set_yticks(range(len(goals)), [k.replace("_", " ") for k, _ in goals], fontsize=8)
    a.set_title("goals (black tick = goal, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lazy_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024, help="generated layer size (the image adds its base)")
    ap.add_argument("--cache", default="/var/tmp/corral-bench-lazy", help="generated files and the docker archive, kept across runs")
    ap.add_argument("--loader-args", default="", help="extra loader flags, e.g. '--readahead-chunks 0'")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--no-worst", action="store_true")
    ap.add_argument("--no-readahead-pass", action="store_true",
                    help="skip the extra lazy starts with the loader restarted with --readahead-chunks 0")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("this benchmark needs root (runc, mounts, drop_caches, dockerd)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: the stack is stopped on the way out
    res = asyncio.run(Bench(a).run())
    os.makedirs(a.out, exist_ok=True)
    for var in (res.get("samples") or {}).values():
        for x in var:
            x.pop("stdout", None)
    save(a.out, "lazy_start", res, plot, res.pop("goals", []))
    print(json.dumps({"summary": res.get("summary"), "errors": [e["error"] for e in res["errors"]]}, indent=2))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
