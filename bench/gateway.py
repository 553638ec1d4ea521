"""SandboxFusion gateway benchmark: `POST /run_code` through `corral gateway` against the same
program run with `docker run --rm` of the same image, and against a direct `corral.v1.sandbox.run`.

The program (python, the debian image) sums the numbers it reads on stdin and prints the sum, as an
RL reward's test case does; every answer is checked.

  gateway      aiohttp POSTs of SandboxFusion requests to the gateway (one shared HTTP session)
  docker run   `docker run --rm -i --network none --memory 1024m IMAGE sh -c '<the gateway's script>'`
               with the gateway's environment (code in it), image from `docker import` of the
               debian rootfs; one CLI process per run, threads for concurrency
  direct       the gateway's exact RunRequest (same spec, script and environment) sent on the bus
               by the SDK, no HTTP: what the gateway adds is the difference

* throughput and latency at concurrency 1, 16 and 64 (`--cycles-*`): requests/s, p50, p99.
* added latency: the gateway's own time per run, from its `Server-Timing` header (answer time
  minus time waiting on the bus); and end to end, `--n` interleaved pairs (a gateway request and the same run sent directly, in
  alternating order, each after `--pause-s` so the node's warm function sandbox is back and both
  take the same path), one at a time: the median of the paired differences with a bootstrap 95% interval.

Goals (issue 16): added p50 <= 3 ms; >= 5x docker run's throughput at concurrency 16.
Results: `<out>/gateway.json` and `<out>/gateway.png`.

    .venv/bin/python -m bench.gateway [--n 40] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO]

from bench._common import Goal, goal, log, pyplot, save, stats  # noqa: E402

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")
CODE = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
LEVELS = (1, 16, 64)


def case(i: int) -> tuple[str, str]:
    nums = list(range(i % 50, i % 50 + 20))
    return " ".join(map(str, nums)), f"{sum(nums)}\n"


def summary(lat: list[float], wall: float, ok: int, failed: int, errors: list[str], c: int, n: int) -> dict[str, Any]:
    s = {k: v for k, v in stats(lat).items() if k != "samples_ms"}
    return {"concurrency": c, "requests": n, "ok": ok, "failed": failed, "wall_s": round(wall, 3),
            "per_s": round(ok / wall, 2) if wall > 0 else None, "p50_ms": s.get("median_ms"), "p99_ms": s.get("p99_ms"),
            "latency": s, "errors": errors[:3]}


async def gateway_level(url: str, c: int, n: int) -> dict[str, Any]:
    import aiohttp

    left = list(range(n))
    lat: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            while left:
                i = left.pop()
                stdin, want = case(i)
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/run_code", json={"code": CODE, "language": "python", "stdin": stdin, "run_timeout": 60}) as r:
                        body = await r.json()
                    ms = (time.perf_counter() - t0) * 1000
                    if r.status != 200 or body["status"] != "Success" or body["run_result"]["stdout"] != want:
                        raise RuntimeError(f"HTTP {r.status}: {str(body)[:200]}")
                    lat.append(ms)
                except Exception as e:  # noqa: BLE001  (counted and reported as a failed request)
                    errors.append(repr(e)[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.perf_counter() - t0
    return summary(lat, wall, len(lat), len(errors), errors, c, n)


def docker_level(image: str, argv: list[str], env: dict[str, str], workdir: str, c: int, n: int) -> dict[str, Any]:
    left = list(range(n))
    lock = threading.Lock()
    lat: list[float] = []
    errors: list[str] = []
    env_args = [a for k in env for a in ("-e", k)]
    cmd = ["docker", "run", "--rm", "-i", "--network", "none", "--memory", "1024m", "--label", "corral-bench-gw=1", "-w", workdir,
           *env_args, image, *argv]

    def worker() -> None:
        while True:
            with lock:
                if not left:
                    return
                i = left.pop()
            stdin, want = case(i)
            t0 = time.perf_counter()
            p = subprocess.run(cmd, input=stdin.encode(), capture_output=True, env={**os.environ, **env})
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                if p.returncode == 0 and p.stdout.decode() == want:
                    lat.append(ms)
                else:
                    errors.append(f"rc={p.returncode} out={p.stdout[:80]!r} err={p.stderr[-200:]!r}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return summary(lat, wall, len(lat), len(errors), errors, c, n)


def overhead_from_metrics(text: str) -> dict[str, Any]:
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith("corral_gateway_overhead_seconds_sum"):
            s = float(line.rsplit(" ", 1)[1])
        elif line.startswith("corral_gateway_overhead_seconds_count"):
            c = float(line.rsplit(" ", 1)[1])
    return {"runs": int(c), "mean_ms": round(s / c * 1000, 3) if c else None}


async def bench(args, results: dict[str, Any], docker_image: str | None) -> None:
    import aiohttp

    from corral_common.contract import labels, subjects
    from corral_common.contract.messages import ExecRequest, RunRequest, RunSpec, encoder
    from corral_common.contract.replies import RunReply
    from corral_gateway.languages import LANGUAGES, WORKDIR, program
    from corral_gateway.runner import ADAPTER, MAX_OUTPUT
    from corral_sdk import AsyncClient
    from corral_sdk.stack import Stack, free_port

    data = tempfile.mkdtemp(prefix="crl-bgw-", dir="/tmp")
    stack = Stack(data_dir=data, nodes=1, nats_port=free_port(), image_dir=IMAGE_DIR, monitor=False, env_builder=False, gateway_port=0)
    log(f"starting the corral stack and the gateway in {data}")
    try:
        await stack.start()
        url = stack.gateway_url
        client = await AsyncClient.connect(stack.url)
        prog = program(LANGUAGES["python"], CODE, {}, [])
        spec = RunSpec(image="debian", substrate="function", cpu=1.0, memory_mb=1024, disk_mb=1024, workdir=WORKDIR, job="sandbox-fusion",
                       labels={labels.ADAPTER: ADAPTER})

        async def direct(i: int) -> float:
            stdin, want = case(i)
            payload = encoder.encode(RunRequest(spec=spec, exec=ExecRequest(cmd=prog.argv, stdin=stdin, env=prog.env, timeout_s=60,
                                                                             max_output_bytes=MAX_OUTPUT)))
            t0 = time.perf_counter()
            r = await client.request(subjects.SANDBOX_RUN, payload, RunReply, 120)
            ms = (time.perf_counter() - t0) * 1000
            if r.result is None or r.result.stdout != want:
                raise RuntimeError(f"direct run answered {r.result}")
            return ms

        async with aiohttp.ClientSession() as s:
            own_ms: list[float] = []

            async def via_gateway(i: int) -> float:
                stdin, want = case(i)
                t0 = time.perf_counter()
                async with s.post(url + "/run_code", json={"code": CODE, "language": "python", "stdin": stdin, "run_timeout": 60}) as r:
                    body = await r.json()
                ms = (time.perf_counter() - t0) * 1000
                own_ms.append(float(r.headers["Server-Timing"].split("gateway;dur=")[1].split(",")[0]))
                if body["run_result"]["stdout"] != want:
                    raise RuntimeError(f"gateway answered {body}")
                return ms

            log("warm-up")
            for i in range(args.warmup):
                await via_gateway(i)
                await direct(i)
            async with s.get(url + "/metrics") as m:
                before = overhead_from_metrics(await m.text())
            log(f"added latency: {args.n} interleaved pairs")
            own_ms.clear()
            pairs = []
            for i in range(args.n):
                # a pause before each call lets the node refill its warm function sandbox (it waits
                # for a quiet moment), so both calls take the same path; the order alternates so
                # neither always goes first
                ms = {}
                for name in (("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")):
                    await asyncio.sleep(args.pause_s)
                    ms[name] = await (via_gateway(i) if name == "gateway" else direct(i))
                pairs.append((ms["gateway"], ms["direct"]))
            async with s.get(url + "/metrics") as m:
                after = overhead_from_metrics(await m.text())
        g_ms = [g for g, _ in pairs]
        d_ms = [d for _, d in pairs]
        diffs = [g - d for g, d in pairs]
        import numpy as np

        own_runs = after["runs"] - before["runs"]
        rng = np.random.default_rng(7)
        boot = np.median(rng.choice(np.asarray(diffs), size=(2000, len(diffs))), axis=1)
        results["added_latency"] = {
            "pairs": args.n, "gateway_p50_ms": round(float(np.median(g_ms)), 3), "direct_p50_ms": round(float(np.median(d_ms)), 3),
            "p50_difference_ms": round(float(np.median(g_ms) - np.median(d_ms)), 3),
            "median_paired_difference_ms": round(float(np.median(diffs)), 3),
            "median_paired_difference_ci95_ms": [round(float(np.percentile(boot, 2.5)), 3), round(float(np.percentile(boot, 97.5)), 3)],
            "paired_differences_ms": [round(d, 3) for d in diffs],
            "gateway_own_p50_ms": round(float(np.median(own_ms)), 3), "gateway_own_p99_ms": round(float(np.percentile(own_ms, 99)), 3),
            "gateway_own_mean_ms": round(((after["mean_ms"] or 0) * after["runs"] - (before["mean_ms"] or 0) * before["runs"]) / own_runs, 3)
            if own_runs else None,
            "gateway": {k: v for k, v in stats(g_ms).items() if k != "samples_ms"},
            "direct": {k: v for k, v in stats(d_ms).items() if k != "samples_ms"},
        }
        a = results["added_latency"]
        log(f"added latency: {a['median_paired_difference_ms']} ms paired median (95% CI {a['median_paired_difference_ci95_ms']}), "
            f"gateway's own p50 {a['gateway_own_p50_ms']} ms (Server-Timing)")
        for c in LEVELS:
            n = getattr(args, f"cycles_{c}")
            log(f"gateway at concurrency {c}: {n} requests")
            results["gateway"][str(c)] = r = await gateway_level(url, c, n)
            log(f"  {r['per_s']}/s p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms failed {r['failed']}")
            if docker_image:
                n = getattr(args, f"docker_cycles_{c}")
                log(f"docker run at concurrency {c}: {n} runs")
                results["docker_run"][str(c)] = r = await asyncio.to_thread(docker_level, docker_image, prog.argv, prog.env, WORKDIR, c, n)
                log(f"  {r['per_s']}/s p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms failed {r['failed']}")
        await client.close()
    finally:
        await stack.stop()
        shutil.rmtree(data, ignore_errors=True)


def goals(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a = res.get("added_latency") or {}
    if a:
        # the gateway's own time per run (Server-Timing) is the direct measure; the paired end-to-end
        # difference also carries the extra process hop's scheduling on a loaded machine and its
        # confidence interval says how far it can be trusted: met when the gateway's own p50 is
        # within 3 ms and the end-to-end difference is not shown to exceed it
        lo, hi = a["median_paired_difference_ci95_ms"]
        out["added_p50_ms"] = {"goal": "<= 3", "value": a["gateway_own_p50_ms"], "what": "gateway's own p50 (Server-Timing)",
                               "end_to_end_paired_median_ms": a["median_paired_difference_ms"], "end_to_end_ci95_ms": [lo, hi],
                               "met": a["gateway_own_p50_ms"] <= 3 and lo <= 3}
    g, d = res["gateway"].get("16"), res["docker_run"].get("16")
    if g and d and d.get("per_s"):
        x = g["per_s"] / d["per_s"]
        out["throughput_vs_docker_at_16"] = {"goal": ">= 5x", "gateway_per_s": g["per_s"], "docker_per_s": d["per_s"],
                                             "ratio": round(x, 2), "met": x >= 5}
    return out


def goal_list(res: dict[str, Any]) -> list[Goal]:
    """goals() as uniform goals: the added-latency goal's two conditions are two goals (both met is
    what goals() calls met)."""
    out = []
    a = res.get("added_latency") or {}
    if a:
        lo, hi = a["median_paired_difference_ci95_ms"]
        out.append(goal("added_p50_ms", 3, a["gateway_own_p50_ms"], "ms", "lower", "the gateway's own p50 per run (Server-Timing)",
                        note=f"p99 {a.get('gateway_own_p99_ms')} ms"))
        out.append(goal("end_to_end_added_ci95_low_ms", 3, lo, "ms", "lower",
                        "end-to-end paired difference gateway - direct sandbox.run, 95% bootstrap interval's lower bound "
                        "(the difference is not shown to exceed 3 ms)",
                        note=f"median {a['median_paired_difference_ms']} ms, interval [{lo}, {hi}] ms over {a.get('pairs')} pairs"))
    g, d = res["gateway"].get("16"), res["docker_run"].get("16")
    out.append(goal("throughput_vs_docker_at_16", 5, round(g["per_s"] / d["per_s"], 2) if g and d and d.get("per_s") else None, "x",
                    "higher", "gateway runs/s / `docker run --rm -i` runs/s, 16 at once",
                    note=f"{(g or {}).get('per_s')} / {(d or {}).get('per_s')} per s"))
    return out


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = list(range(len(LEVELS)))
    w = 0.38
    for k, (name, color, off) in enumerate((("gateway", "#3b6fb6", -w / 2), ("docker_run", "#5a9e4b", w / 2))):
        vals = [(res[name].get(str(c)) or {}).get("per_s") or 0 for c in LEVELS]
        ax1.bar([x + off for x in xs], vals, w, label="corral gateway" if k == 0 else "docker run --rm", color=color)
        for x, v in zip(xs, vals):
            ax1.text(x + off, v, f"{v:g}", ha="center", va="bottom", fontsize=8)
        p50 = [(res[name].get(str(c)) or {}).get("p50_ms") or 0 for c in LEVELS]
        p99 = [(res[name].get(str(c)) or {}).get("p99_ms") or 0 for c in LEVELS]
        ax2.bar([x + off for x in xs], p50, w, color=color, label=f"{'corral gateway' if k == 0 else 'docker run --rm'} p50")
        ax2.scatter([x + off for x in xs], p99, color="black", marker="_", s=200, zorder=3, label="p99" if k == 0 else None)
    ax1.set_xticks(xs, [f"concurrency {c}" for c in LEVELS])
    ax1.set_ylabel("runs / s")
    ax1.set_title("SandboxFusion /run_code throughput (python, debian image)")
    ax1.legend()
    ax2.set_xticks(xs, [f"concurrency {c}" for c in LEVELS])
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (ms, log)")
    a = res.get("added_latency") or {}
    ax2.set_title(f"latency; the gateway's own p50 {a.get('gateway_own_p50_ms')} ms a run\n"
                  f"(end to end over sandbox.run: {a.get('median_paired_difference_ms')} ms, 95% CI {a.get('median_paired_difference_ci95_ms')})",
                  fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="interleaved pairs for the added latency")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pause-s", type=float, default=0.8, help="pause before each call of the added-latency pairs")
    ap.add_argument("--cycles-1", type=int, default=20)
    ap.add_argument("--cycles-16", type=int, default=384)  # ~10 s a side: 96 (2.6 s) moved the ratio by 10% run to run
    ap.add_argument("--cycles-64", type=int, default=192)
    ap.add_argument("--docker-cycles-1", type=int, default=8)
    ap.add_argument("--docker-cycles-16", type=int, default=80)
    ap.add_argument("--docker-cycles-64", type=int, default=64)
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root (runc, mounts, cgroups, dockerd)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {"benchmark": "gateway", "config": {k: v for k, v in vars(args).items() if k != "out"}, "code": CODE,
                               "gateway": {}, "docker_run": {}, "notes": []}
    docker_image = None
    dockerd = None
    if not args.no_docker:
        from tests.dockerd import docker_ok, start_dockerd

        if not docker_ok():
            log("starting dockerd")
            dockerd, err = start_dockerd("/tmp/corral-bench-gateway-dockerd.log")
            if err:
                results["notes"].append(f"docker: {err}")
        if docker_ok():
            docker_image = f"corral-bench-gw-debian:{run_id}"
            log(f"docker import of the debian rootfs as {docker_image}")
            p = subprocess.run(f"tar -C {shlex.quote(IMAGE_DIR)}/debian/rootfs -c . | docker import - {docker_image}", shell=True,
                               capture_output=True, text=True)
            if p.returncode != 0:
                results["notes"].append(f"docker import failed: {p.stderr.strip()[-300:]}")
                docker_image = None
    results["config"]["docker_image"] = docker_image
    rc = 0
    try:
        asyncio.run(bench(args, results, docker_image))
    except Exception as e:  # noqa: BLE001  (recorded in the results, which are still written)
        import traceback

        results["error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
        rc = 1
    finally:
        if docker_image:
            subprocess.run(["docker", "rmi", "-f", docker_image], capture_output=True)
        if dockerd is not None:
            from tests.dockerd import stop_dockerd

            stop_dockerd(dockerd)
    results["goal_detail"] = goals(results)
    save(args.out, "gateway", results, plot, goal_list(results))
    return rc


if __name__ == "__main__":
    sys.exit(main())
