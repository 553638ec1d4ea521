"""Responder benchmark: the per-request cost of serving a request/reply subject with corral's
`bus.Responder` (which also answers NATS service discovery, see corral_common/discovery.py) against
nats-py's `nats.micro` endpoints, which answer the same discovery protocol. Side by side, one run.

One nats-server and one server process on this machine; the server process serves the same
handler (decode a small msgspec request, encode an `ok` reply: what a cheap corral op does) three
ways, each on its own subject:

  responder          bus.Responder as the services run it (a task per request, error replies,
                     Prometheus counters, discovery counters)
  responder_bare     the same Responder with its discovery counters switched off: today's
                     Responder before discovery, to show what the counters cost
  micro              a nats.micro service endpoint (add_service + add_endpoint) whose handler does
                     the same decode/encode and error-to-JSON wrapping, nothing else
  micro_metrics      the same plus the Prometheus counting every corral op has (what the
                     Responder does besides discovery), so the difference to `responder` is the
                     way requests are dispatched
  micro_task         the same, with each request in its own task as corral needs (a slow op must
                     not hold up the next); micro's own counters then time only the spawn

Measured from a client process (plain nats-py), the variants interleaved block by block so load
from elsewhere on the machine falls on all of them alike:

  latency     sequential request/reply round trips: p50, p99 (ms)
  throughput  bursts of --burst requests in flight at once (one wildcard inbox, `bus.Scatter`),
              requests per second of wall clock
  cpu         the server process's CPU time per request (`time.process_time` read over the bus
              before and after each block), the least noisy measure of the serving path itself
  handle      in this process, no bus: CPU per call of the Responder's request path (`_handle`,
              a reply-less message) with and without the discovery counters, --n x 25 calls per
              round, 3 rounds each; on a loaded shared machine the bus figures above move by more
              than the counters cost, this isolates them
  slow        --slow-n concurrent requests to a handler that sleeps --slow-ms: wall clock until
              all are answered (the Responder runs each request in its own task; a micro
              endpoint awaits its handler in the subscription's callback, one at a time)

Results: <out>/responder.json and <out>/responder.png.

    .venv/bin/python -m bench.responder [--n 2000] [--blocks 6] [--burst 1000] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

import msgspec
import nats

from bench._common import Goal, goal, log, pyplot, save, stats
from corral_common import bus, metrics
from corral_common.contract import envelope
from corral_common.contract.errors import CorralError

VARIANTS = ("responder", "responder_bare", "micro", "micro_metrics", "micro_task")
PREFIX = "bench.responder"
MATERIAL = 0.10  # a difference below 10% is within this machine's run-to-run noise


class Echo(msgspec.Struct):
    text: str
    sleep_ms: float = 0.0


class EchoReply(envelope.Reply, kw_only=True):
    echo: str


def subject(variant: str) -> str:
    return f"{PREFIX}.{variant}"


# ------------------------------------------------------------------ the server process

async def handle(data: bytes) -> bytes:
    req = bus.decode(data, Echo)
    if req.sleep_ms:
        await asyncio.sleep(req.sleep_ms / 1000)
    return envelope.encode(EchoReply(echo=req.text))


async def serve(url: str) -> None:
    from nats.micro import add_service
    from nats.micro.request import Request

    nc = await nats.connect(url)

    async def on_msg(msg) -> bytes:
        return await handle(msg.data)

    responder = bus.Responder(nc, "bench-responder")
    await responder.serve(subject("responder"), on_msg, "echo", queue="bench")
    bare = bus.Responder(nc, "bench-responder-bare")
    bare.discovery.record = lambda *a: None  # type: ignore[method-assign]
    await bare.serve(subject("responder_bare"), on_msg, "echo", queue="bench")

    async def on_request(req: Request) -> None:
        try:
            body = await handle(req.data)
        except CorralError as e:  # corral's errors are JSON replies with a code, as the Responder makes them
            body = envelope.error(e.code.value, e.message, e.retry_after_s)
        await req.respond(body)

    async def on_request_counted(req: Request) -> None:
        t0 = time.perf_counter_ns()
        code = "ok"
        try:
            body = await handle(req.data)
        except CorralError as e:
            code = e.code.value
            body = envelope.error(e.code.value, e.message, e.retry_after_s)
        metrics.request_done("bench-micro", "echo", code, (time.perf_counter_ns() - t0) / 1e9)
        await req.respond(body)

    tasks: set[asyncio.Task] = set()

    async def on_request_task(req: Request) -> None:
        t = asyncio.create_task(on_request_counted(req))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    svc = await add_service(nc, name="bench-micro", version="0.1.0")
    await svc.add_endpoint(name="echo", subject=subject("micro"), handler=on_request, queue_group="bench")
    await svc.add_endpoint(name="echo-metrics", subject=subject("micro_metrics"), handler=on_request_counted, queue_group="bench")
    await svc.add_endpoint(name="echo-task", subject=subject("micro_task"), handler=on_request_task, queue_group="bench")

    async def on_cpu(msg) -> None:
        await msg.respond(str(time.process_time_ns()).encode())

    await nc.subscribe(f"{PREFIX}.cpu", cb=on_cpu)
    await bus.barrier(nc)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client closes our stdin
    await svc.stop()
    await responder.drain()
    await bare.drain()
    await nc.drain()


# ------------------------------------------------------------------ the client

async def server_cpu_ns(nc) -> int:
    return int((await nc.request(f"{PREFIX}.cpu", b"", timeout=10)).data)


async def sequential(nc, variant: str, n: int) -> list[float]:
    body = msgspec.json.encode(Echo(text="hello"))
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        msg = await nc.request(subject(variant), body, timeout=10)
        out.append((time.perf_counter() - t0) * 1000)
        if not msg.data.startswith(b'{"ok":true'):
            raise RuntimeError(f"{variant}: unexpected reply {msg.data[:200]!r}")
    return out


async def burst(scatter: bus.Scatter, variant: str, n: int, sleep_ms: float = 0.0) -> float:
    """Send n requests at once; seconds until the last reply."""
    body = msgspec.json.encode(Echo(text="hello", sleep_ms=sleep_ms))
    t0 = time.perf_counter()
    answered = 0
    async for _, msg in scatter.requests([(subject(variant), body, None)] * n, timeout=120):
        if msg is None or not msg.data.startswith(b'{"ok":true'):
            raise RuntimeError(f"{variant}: a request of the burst was not answered ok: {msg and msg.data[:200]!r}")
        answered += 1
    assert answered == n
    return time.perf_counter() - t0


async def handle_cost(calls: int) -> dict[str, float]:
    """CPU µs per `Responder._handle` call, discovery counters on and off, best of 3 rounds."""
    async def on_msg(msg) -> bytes:
        return await handle(msg.data)

    full = bus.Responder(None, "bench-inproc")  # type: ignore[arg-type]  # never touches the bus
    full.discovery.add("echo", subject("inproc"), "")
    bare = bus.Responder(None, "bench-inproc-bare")  # type: ignore[arg-type]
    bare.discovery.record = lambda *a: None  # type: ignore[method-assign]
    best = {"responder": float("inf"), "responder_bare": float("inf")}
    # what _handle reads of a message; no reply subject, so nothing is published
    msg = types.SimpleNamespace(subject=subject("inproc"), reply="", data=msgspec.json.encode(Echo(text="hello")))
    for _ in range(3):
        for name, r in (("responder", full), ("responder_bare", bare)):
            t0 = time.process_time_ns()
            for _ in range(calls):
                await r._handle(msg, on_msg, "echo")  # type: ignore[arg-type]
            best[name] = min(best[name], (time.process_time_ns() - t0) / 1000 / calls)
    return {k: round(v, 3) for k, v in best.items()}


async def run(n: int, blocks: int, burst_n: int, slow_n: int, slow_ms: float) -> dict[str, Any]:
    from corral_sdk.stack import free_port, nats_server_binary

    tmp = tempfile.mkdtemp(prefix="crl-bench-responder-")
    port = free_port()
    nats_proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "nats.log"), "w"))
    url = f"nats://127.0.0.1:{port}"
    server = None
    try:
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:  # not listening yet
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError("nats-server did not start")
        nc = await nats.connect(url)
        server = subprocess.Popen([sys.executable, "-m", "bench.responder", "--serve", url], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = await asyncio.to_thread(server.stdout.readline)  # type: ignore[union-attr]
        if line.strip() != b"ready":
            raise RuntimeError(f"server process did not start: {line!r}")
        scatter = await bus.Scatter(nc).start()
        log("warm-up")
        for v in VARIANTS:
            await sequential(nc, v, 200)
            await burst(scatter, v, burst_n)

        lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
        tput: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpu_seq: dict[str, list[float]] = {v: [] for v in VARIANTS}  # server µs per request, sequential blocks
        cpu_burst: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for b in range(blocks):
            order = VARIANTS[b % len(VARIANTS):] + VARIANTS[:b % len(VARIANTS)]  # rotate who goes first
            for v in order:
                c0 = await server_cpu_ns(nc)
                lat[v] += await sequential(nc, v, n)
                c1 = await server_cpu_ns(nc)
                secs = await burst(scatter, v, burst_n)
                c2 = await server_cpu_ns(nc)
                tput[v].append(burst_n / secs)
                cpu_seq[v].append((c1 - c0) / 1000 / n)
                cpu_burst[v].append((c2 - c1) / 1000 / burst_n)
            log(f"block {b + 1}/{blocks}: " + ", ".join(
                f"{v} p50 {sorted(lat[v])[len(lat[v]) // 2]:.3f} ms {tput[v][-1]:.0f}/s" for v in VARIANTS))

        slow = {}
        for v in VARIANTS:
            slow[v] = round(await burst(scatter, v, slow_n, sleep_ms=slow_ms), 3)
            log(f"slow handler, {slow_n} concurrent x {slow_ms:g} ms: {v} {slow[v]:.2f} s")
        await nc.close()
    finally:
        if server is not None:
            server.stdin.close()  # type: ignore[union-attr]
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        nats_proc.terminate()
        nats_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    handle_us = await handle_cost(n * 25)
    log(f"request path in-process: {handle_us}")

    def med(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2], 3)

    res: dict[str, Any] = {"config": {"n": n, "blocks": blocks, "burst": burst_n, "slow_n": slow_n, "slow_ms": slow_ms},
                           "variants": {}, "handle_cpu_us_in_process": handle_us}
    for v in VARIANTS:
        s = stats(lat[v])
        s.pop("samples_ms")
        res["variants"][v] = {"latency": s, "throughput_rps": {"median": med(tput[v]), "blocks": [round(x) for x in tput[v]]},
                              "server_cpu_us_per_request": {"sequential": med(cpu_seq[v]), "burst": med(cpu_burst[v])},
                              "slow_handler_wall_s": slow[v]}
    def cost(v: str) -> dict[str, float]:
        """Relative cost of variant v against the Responder; positive: v costs more (slower,
        fewer requests per second, more server CPU per request)."""
        r, m = res["variants"]["responder"], res["variants"][v]
        return {"p50": round((m["latency"]["median_ms"] - r["latency"]["median_ms"]) / r["latency"]["median_ms"], 3),
                "p99": round((m["latency"]["p99_ms"] - r["latency"]["p99_ms"]) / r["latency"]["p99_ms"], 3),
                "throughput": round((r["throughput_rps"]["median"] - m["throughput_rps"]["median"]) / m["throughput_rps"]["median"], 3),
                "cpu_sequential": round((m["server_cpu_us_per_request"]["sequential"] - r["server_cpu_us_per_request"]["sequential"])
                                        / r["server_cpu_us_per_request"]["sequential"], 3),
                "cpu_burst": round((m["server_cpu_us_per_request"]["burst"] - r["server_cpu_us_per_request"]["burst"])
                                   / r["server_cpu_us_per_request"]["burst"], 3)}

    res["cost_vs_responder"] = {v: cost(v) for v in VARIANTS if v != "responder"}

    def material(v: str) -> dict[str, str]:  # p99 on a shared 2-core machine is noise, not a verdict
        return {k: ("responder" if x > 0 else v) for k, x in res["cost_vs_responder"][v].items() if abs(x) >= MATERIAL and k != "p99"}

    equivalent = material("micro_task")
    res["verdict"] = {
        "material_threshold": MATERIAL,
        "faster_where_material": {v: material(v) for v in ("micro", "micro_task", "responder_bare")},
        "kept": "responder",
        "why": ("micro_task is the nats.micro path that does what corral's ops need (a task per request, JSON error codes, "
                "Prometheus counts): " + (f"material differences {equivalent}" if equivalent else "no material difference to the Responder")
                + f"; plain micro endpoints serve one request at a time ({slow['micro']:.2f} s against {slow['responder']:.2f} s "
                f"for {slow_n} concurrent {slow_ms:g} ms requests), so their lower cost per request is not an option"),
    }
    return res


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    vs = list(res["variants"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    data = [
        ("round trip (ms)", [res["variants"][v]["latency"]["median_ms"] for v in vs], [res["variants"][v]["latency"]["p99_ms"] for v in vs]),
        ("throughput (req/s)", [res["variants"][v]["throughput_rps"]["median"] for v in vs], None),
        ("server CPU per request (µs)", [res["variants"][v]["server_cpu_us_per_request"]["sequential"] for v in vs],
         [res["variants"][v]["server_cpu_us_per_request"]["burst"] for v in vs]),
        (f"{res['config']['slow_n']} x {res['config']['slow_ms']:g} ms handler (s)", [res["variants"][v]["slow_handler_wall_s"] for v in vs], None),
    ]
    labels = {0: ("p50", "p99"), 2: ("sequential", "burst")}
    for i, (ax, (title, a, b)) in enumerate(zip(axes, data)):
        x = range(len(vs))
        if b is None:
            ax.bar(x, a, color="tab:blue")
        else:
            ax.bar([k - 0.2 for k in x], a, 0.4, label=labels[i][0])
            ax.bar([k + 0.2 for k in x], b, 0.4, label=labels[i][1])
            ax.legend()
        ax.set_xticks(list(x))
        ax.set_xticklabels(vs, fontsize=8, rotation=25, ha="right")
        ax.set_title(title, fontsize=9)
    fig.suptitle("bus.Responder vs nats.micro endpoint, same handler, same machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals(res: dict[str, Any]) -> list[Goal]:
    """The issue's rule as a goal: keep the Responder unless micro_task (nats.micro doing what corral
    needs) is materially cheaper; the value is the Responder's largest extra cost over micro_task
    in p50 latency, CPU per request or burst throughput (p99 is noise here)."""
    cost = res["cost_vs_responder"]["micro_task"]
    worst = max(-x for k, x in cost.items() if k != "p99")
    return [goal("responder_extra_cost_vs_micro_task", MATERIAL, round(worst, 3), "fraction", "lower",
                 "Responder / micro_task (a task per request, JSON errors, Prometheus): p50, CPU per request, burst req/s",
                 note=f"kept: {res['verdict']['kept']}")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="sequential requests per variant and block")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--burst", type=int, default=1000, help="requests in flight at once per throughput block")
    ap.add_argument("--slow-n", type=int, default=50)
    ap.add_argument("--slow-ms", type=float, default=20.0)
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON in --out")
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.replot:
        with open(os.path.join(args.out, "responder.json")) as f:
            plot(json.load(f), os.path.join(args.out, "responder.png"))
        return 0
    res = asyncio.run(run(args.n, args.blocks, args.burst, args.slow_n, args.slow_ms))
    save(args.out, "responder", res, plot, goals(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
