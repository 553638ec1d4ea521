"""Monitor benchmark: ingest throughput into the embedded ClickHouse, alert latency, and the cost
of auditing on exec latency. One embedded stack (nats-server, image-cache, scheduler, monitor,
one node-agent), everything on this machine.

  ingest    a backlog of N exec audit events (batches of 256, as the node-agent publishes them;
            realistic commands, 0.1% of them misbehaving) is published to CORRAL_AUDIT while the
            monitor is stopped; the monitor is then started with --workers W and the time from its
            first fetch to its last stored event is measured from its Prometheus counters
            (corral_monitor_events_ingested_total); "first" is when its first fetched batch was
            staged (corral_monitor_batch_seconds_count), as stored events only show up a commit
            later. Every event goes through decode, dedup, insert into audit_events and exec_log
            (ClickHouse via chdb), and the stream rules.
  alerts    latency from publishing an audit event (its `ts`) to its alert arriving on
            corral.alerts.> (same clock): (a) idle monitor, one event per message at 20/s,
            (b) the same while 20k events/s of benign background load stream in, (c) end to end
            from a real sandbox: `sb.exec('cat /proc/1/environ')` returning until the alert.
  overhead  exec latency (`sb.exec(['true'])`, sequential, from the SDK) with auditing on vs off,
            side by side: two node-agents in the stack, one audited ("on": every audit source
            of a container sandbox, events ingested by the monitor), one with `--no-audit`
            ("off": no exec log, no file-activity fanotify group, no seccomp-notify listener,
            nothing published or ingested), roles swapped for the second half, a sandbox on
            each; timed blocks of sequential execs alternate between them (ABBA), no restart
            inside the timed part, and before each "off" block the monitor has stored everything
            published so far, so its work on an "on" block is not charged to the "off" block
            after it. A second phase with the monitor stopped
            separates the node-side cost from the monitor competing for this machine's cores.
  overhead_python  the same with a Python start on debian (`python3 -c 'import json, subprocess,
            tempfile; ...'`: hundreds of opens and a temp file, the file-activity heavy case);
            only with --only overhead_python, reported beside the verdict, not in it.

Results: <out>/monitor_ingest.json and <out>/monitor_ingest.png.

    .venv/bin/python -m bench.monitor_ingest [--events 500000] [--workers 1 4] [--out bench/results]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

from bench._common import Goal, goals_from_ops, log, pyplot, save

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from corral_common.contract import subjects  # noqa: E402

GOALS = {
    "ingest_events_per_s": {"goal": 100_000, "op": ">=", "unit": "events/s", "what": "events/s stored, median run of the best --workers setting"},
    "alert_p99_s": {"goal": 1.0, "op": "<=", "unit": "s", "what": "publish -> alert p99 (idle and loaded, worst of the two)"},
    "audit_exec_overhead": {"goal": 0.10, "op": "<=", "unit": "fraction", "what": "exec p50 with audit on / off - 1"},
}

BENIGN_CMDS = [
    "ls -la", "cat src/main.py", "python3 -m pytest -q tests/test_{n}.py", "git status", "git diff", "git log -5",
    "grep -rn 'def f{n}' src/", "sed -i 's/x{n}/y{n}/' src/mod{n}.py", "python3 src/main.py --seed {n}", "pip list",
    "find . -name '*.py' | head -{n}", "echo {n} > /tmp/out{n}.txt", "make -j2 test", "head -{n} README.md",
]
BAD_CMDS = ["git log --all --oneline", "cat /proc/1/environ", "kill -9 1", "rm -rf /*", "curl https://example.com/fix.patch"]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(p / 100 * (len(s) - 1)))))
    return s[k]


def summary(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs) if xs else None,
            "mean": statistics.fmean(xs) if xs else None}


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


def _series(url: str, name: str, result: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(rf'^{re.escape(name)}{{result="{result}"}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def machine() -> dict[str, Any]:
    import chdb

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = ""
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "python": platform.python_version(),
            "chdb": getattr(chdb, "__version__", "?"), "loadavg": os.getloadavg()}


# ----------------------------------------------------------------------------- publishing


def make_batch(job: str, start: int, n: int, bad_every: int = 1000, sandboxes: int = 512, unique: bool = False) -> bytes:
    import msgspec

    from corral_common.contract.audit import AuditBatch, AuditEvent, event_id

    now = time.time()
    evs = []
    for i in range(start, start + n):
        if bad_every and i % bad_every == bad_every - 1:
            cmd = BAD_CMDS[i % len(BAD_CMDS)]
        else:
            cmd = BENIGN_CMDS[i % len(BENIGN_CMDS)].format(n=i % 97)
        if unique:  # defeat the monitor's per-command verdict cache: every command is new
            cmd += f" # {job}-{i}"
        evs.append(AuditEvent(id=f"{job}-{i:09d}-{event_id()}", ts=now, node="bench-node", sandbox=f"sb-{job}-{i % sandboxes}",
                              kind="exec", job=job, cmd=cmd, cwd="/repo", exit_code=1 if i % 3 == 0 else 0, duration_ms=1.5 + (i % 50),
                              stdout_bytes=120, labels={"bench": "1"}))
    return msgspec.json.encode(AuditBatch(events=evs))


async def publish_backlog(js, job: str, total: int, per_msg: int = 256, unique: bool = False) -> float:
    t0 = time.perf_counter()
    futs = []
    for start in range(0, total, per_msg):
        futs.append(js.publish(subjects.audit("bench-node", f"sb-{job}"), make_batch(job, start, min(per_msg, total - start), unique=unique)))
        if len(futs) >= 64:
            await asyncio.gather(*futs)
            futs = []
    await asyncio.gather(*futs)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- stack control


async def wait_query(nc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await nc.request(subjects.MONITOR_QUERY, b'{"sql": "SELECT 1"}', timeout=2)
            if r.data.startswith(b'{"ok":true'):
                return
        except Exception:  # not answering yet (no responders, timeout): poll again until the deadline
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError("the monitor did not come up")


async def stop_proc(stack, name: str) -> None:
    p = stack.proc(name)
    if p.popen.poll() is None:
        p.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(p.popen.wait, 60)


def set_opt(argv: list[str], opt: str, value: str | None) -> list[str]:
    argv = list(argv)
    while opt in argv:
        i = argv.index(opt)
        del argv[i:i + 2]
    if value is not None:
        argv += [opt, value]
    return argv


async def restart_monitor(stack, nc, **opts: str | None) -> str:
    await stop_proc(stack, "monitor")
    p = stack.proc("monitor")
    argv = list(p.argv)
    for k, v in opts.items():
        argv = set_opt(argv, "--" + k.replace("_", "-"), v)
    p.argv[:] = argv
    stack.restart("monitor")
    await wait_query(nc)
    return stack.proc("monitor").metrics_url


# ----------------------------------------------------------------------------- 1. ingest


async def bench_ingest(stack, nc, events: int, workers_list: list[int], batch: int, unique: bool = False) -> list[dict[str, Any]]:
    js = nc.jetstream()
    out = []
    for w in workers_list:
        job = f"ingest-w{w}-{int(time.time())}"
        await stop_proc(stack, "monitor")
        pub_s = await publish_backlog(js, job, events, unique=unique)
        log(f"ingest: backlog of {events} events published in {pub_s:.2f}s; starting the monitor with --workers {w}")
        t_start = time.perf_counter()
        p = stack.proc("monitor")
        p.argv[:] = set_opt(set_opt(p.argv, "--workers", str(w)), "--batch", str(batch))
        stack.restart("monitor")
        url = stack.proc("monitor").metrics_url
        first = last = None
        samples: list[tuple[float, float]] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                v = metric(url, "corral_monitor_events_ingested_total")
            except Exception:
                await asyncio.sleep(0.05)
                continue
            now = time.perf_counter()
            samples.append((now - t_start, v))
            # from the first fetched batch staged (stored events appear a commit interval later)
            if first is None and metric(url, "corral_monitor_batch_seconds_count") > 0:
                first = now
            if v >= events:
                last = now
                break
            await asyncio.sleep(0.02)
        if last is None:
            raise RuntimeError(f"ingest with {w} workers did not finish")
        await wait_query(nc)
        r = json.loads((await nc.request(subjects.MONITOR_QUERY, json.dumps(
            {"sql": f"SELECT count(), count(DISTINCT id) FROM audit_events WHERE job = '{job}'"}).encode(), timeout=30)).data)
        stored, distinct = r["rows"][0]
        alerts = metric(url, "corral_monitor_alerts_total")
        suppressed = metric(url, "corral_monitor_alerts_suppressed_total")
        insert_sum = metric(url, "corral_monitor_insert_seconds_sum")
        rules_sum = metric(url, "corral_monitor_rules_seconds_sum")
        dur = last - first
        hits = _series(url, "corral_monitor_rule_cache_total", "hit")
        res = {"workers": w, "events": events, "batch_messages": batch, "events_per_message": 256, "unique_commands": unique,
               "rule_cache_hits": hits,
               "seconds_first_to_last": dur, "events_per_s": events / dur if dur > 0 else None,
               "seconds_including_start": last - t_start, "stored": stored, "distinct": distinct,
               "alerts_raised": alerts, "alerts_suppressed": suppressed,
               "insert_seconds_total": insert_sum, "rules_seconds_total": rules_sum,
               "curve": [(round(t, 3), v) for t, v in samples[:: max(1, len(samples) // 200)]]}
        log(f"ingest{' (unique commands)' if unique else ''}: {w} worker(s): {events} events in {dur:.2f}s = {res['events_per_s']:,.0f} events/s "
            f"(stored {stored}, distinct {distinct}; insert {insert_sum:.2f}s, rules {rules_sum:.2f}s)")
        out.append(res)
    return out


# ----------------------------------------------------------------------------- 2. alert latency


async def alert_latency(nc, n: int, rate: float, load_eps: float = 0.0) -> dict[str, Any]:
    import msgspec

    from corral_common.contract.audit import Alert, AuditBatch, AuditEvent, event_id

    js = nc.jetstream()
    tag = f"lat{int(time.time() * 1000) % 10**9}"
    sent: dict[str, float] = {}
    got: dict[str, float] = {}
    done = asyncio.Event()

    async def on_alert(msg) -> None:
        t = time.time()
        try:
            a = msgspec.json.decode(msg.data, type=Alert)
        except Exception:
            return
        if a.sandbox.startswith(f"sb-{tag}-") and a.sandbox not in got:
            got[a.sandbox] = t
            if len(got) >= n:
                done.set()

    sub = await nc.subscribe(subjects.ALERTS_ALL, cb=on_alert)
    stop_load = asyncio.Event()

    async def load() -> int:
        k = 0
        per = 256
        interval = per / load_eps
        nxt = time.perf_counter()
        while not stop_load.is_set():
            await js.publish(subjects.audit("bench-node", "sb-load"), make_batch(f"load-{tag}", k, per, bad_every=0))
            k += per
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        return k

    loader = asyncio.create_task(load()) if load_eps else None
    if loader:
        await asyncio.sleep(1.0)
    for i in range(n):
        sb = f"sb-{tag}-{i}"
        ts = time.time()
        ev = AuditEvent(id=f"{tag}-{i}-{event_id()}", ts=ts, node="bench-node", sandbox=sb, kind="exec", job=f"latency-{tag}",
                        cmd="cat /proc/1/environ", cwd="/", exit_code=1)
        sent[sb] = ts
        await js.publish(subjects.audit("bench-node", sb), msgspec.json.encode(AuditBatch(events=[ev])))
        await asyncio.sleep(1.0 / rate)
    try:
        await asyncio.wait_for(done.wait(), 30)
    except TimeoutError:
        pass
    stop_load.set()
    loaded = await loader if loader else 0
    await sub.unsubscribe()
    lat = [got[k] - sent[k] for k in sent if k in got]
    res = {"n": n, "rate_per_s": rate, "background_events_per_s": load_eps, "background_events": loaded,
           "received": len(lat), "latency_s": summary(lat)}
    log(f"alerts ({'load ' + format(load_eps, ',.0f') + ' ev/s' if load_eps else 'idle'}): {len(lat)}/{n} received, "
        f"p50 {res['latency_s']['p50'] * 1000:.1f} ms, p99 {res['latency_s']['p99'] * 1000:.1f} ms")
    return res


async def alert_latency_real(client, n: int) -> dict[str, Any]:
    """From a real exec's return to its alert (node-agent batching + JetStream + monitor)."""
    lat: list[float] = []
    job = f"latency-real-{int(time.time())}"
    async with client.alerts.subscribe(job=job) as alerts:
        sbs = await client.create_batch(n, image="busybox", cpu=0.05, memory_mb=32, ttl_s=600, job=job)
        try:
            for sb in sbs:
                t0 = time.time()
                await sb.exec("cat /proc/1/environ")
                t_ret = time.time()
                while True:
                    a = await alerts.next(timeout=10)
                    if a.sandbox == sb.id:
                        break
                lat.append(time.time() - t_ret)
                _ = t0
        finally:
            await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    res = {"n": n, "latency_s": summary(lat)}
    log(f"alerts (real exec): p50 {res['latency_s']['p50'] * 1000:.1f} ms, p99 {res['latency_s']['p99'] * 1000:.1f} ms")
    return res


# ----------------------------------------------------------------------------- 3. audit overhead

AUDITED, UNAUDITED = "node-1", "node-2"


async def set_node_audit(stack, client, node: str, audit: bool) -> None:
    """Restart `node` with auditing on, or off (`--no-audit`: no exec log, no file-activity
    fanotify group, no seccomp listener; the denied syscalls are plain EPERM), and wait until it
    heartbeats again. Done once, before any timed block."""
    await stop_proc(stack, node)
    p = stack.proc(node)
    rest = [a for a in list(p.argv)[3:] if a != "--no-audit"]  # [python, -m, corral_node_agent, *options]
    p.argv[:] = [sys.executable, "-m", "corral_node_agent", *rest, *([] if audit else ["--no-audit"])]
    stack.restart(node)
    import msgspec

    from corral_common.contract.messages import Heartbeat

    got = asyncio.Event()

    async def on_hb(msg) -> None:
        try:
            if msgspec.json.decode(msg.data, type=Heartbeat).node == node:
                got.set()
        except msgspec.DecodeError:  # not a heartbeat this version can read: not the node we wait for
            pass

    sub = await client.nc.subscribe(subjects.NODE_HEARTBEAT, cb=on_hb)
    try:
        await asyncio.wait_for(got.wait(), 120)
    finally:
        await sub.unsubscribe()
    await asyncio.sleep(2.5)  # the scheduler sees the node's fresh heartbeat


async def sandbox_on(client, node: str, image: str, tries: int = 12):
    """A sandbox on `node`: created through the scheduler (spread placement alternates the two
    nodes), extras destroyed."""
    extra = []
    try:
        for _ in range(tries):
            sb = await client.create(image=image, cpu=0.5, memory_mb=256, ttl_s=3600, job="bench-overhead")
            if sb.info.node == node:
                return sb
            extra.append(sb)
        raise RuntimeError(f"the scheduler placed no sandbox on {node} in {tries} tries")
    finally:
        await asyncio.gather(*(x.destroy() for x in extra), return_exceptions=True)


PY_CMD = ["python3", "-c", "import json, subprocess, tempfile; tempfile.NamedTemporaryFile(dir='/tmp').write(b'x')"]


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


async def monitor_caught_up(nc, timeout: float = 60.0) -> float:
    """Wait until the monitor has stored (and acked) everything published to CORRAL_AUDIT so far;
    returns the seconds waited."""
    js = nc.jetstream()
    t0 = time.monotonic()
    target = (await js.stream_info("CORRAL_AUDIT")).state.last_seq
    while time.monotonic() - t0 < timeout:
        ci = await js.consumer_info("CORRAL_AUDIT", subjects.MONITOR_AUDIT_DURABLE)
        if ci.ack_floor is not None and (ci.ack_floor.stream_seq or 0) >= target:
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise TimeoutError("the monitor did not catch up")


async def timed_block(sb, cmd: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.exec(cmd)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def bench_overhead(stack, client, nc, n: int, rounds: int, image: str = "busybox", cmd: list[str] | None = None,
                         block: int = 250) -> dict[str, Any]:
    """Two node-agents side by side in one stack: one audited (the default), the other restarted
    with --no-audit before anything is timed; for the second half of the run they swap roles.
    One sandbox on each. Timed blocks of `block` sequential execs (`sb.exec(cmd)` from the SDK)
    alternate between the two sandboxes in ABBA order, about `n * rounds` execs per mode and
    phase in all; nothing restarts inside the timed part. Before each `off` block the monitor
    must have stored and acked everything published (the previous `on` block's events), so its
    ingest work is not charged to `off`; before every block
    the node-agents' own timers (audit flush 0.2 s, limit checks 0.2 s after an exec) have passed.
    A block (250 execs) lasts about as long as the monitor's commit interval or longer, so most
    of an `on` block's inserts happen inside `on` blocks (its last one may fall in the wait).

    A second phase, the node-side cost alone: the monitor is stopped and `on` (events published to
    JetStream, nobody consuming) alternates with `off` the same way. Verdict: pooled p50 of `on`
    vs `off` of the first phase."""
    cmd = cmd or ["true"]
    blocks = max(2, (n * rounds) // block // 2)  # per mode, phase and half
    samples: dict[str, list[float]] = {"on": [], "off": [], "on_nomonitor": [], "off_nomonitor": []}
    per_block: list[dict[str, Any]] = []
    mon_cpu: dict[str, float] = {"on": 0.0, "off": 0.0}
    mon_wall: dict[str, float] = {"on": 0.0, "off": 0.0}
    loads: list[float] = []
    waits: list[float] = []
    for half, (audited, unaudited) in enumerate(((AUDITED, UNAUDITED), (UNAUDITED, AUDITED))):
        # the second half swaps the nodes' roles, so nothing particular to one node-agent (its
        # age, its cgroups, where its sandbox landed) leans the comparison; restarts happen here,
        # never inside the timed part
        if half == 0:
            await set_node_audit(stack, client, unaudited, audit=False)
        else:
            await set_node_audit(stack, client, unaudited, audit=False)
            await set_node_audit(stack, client, audited, audit=True)
        sbs = {"on": await sandbox_on(client, audited, image), "off": await sandbox_on(client, unaudited, image)}
        try:
            for sb in sbs.values():
                await timed_block(sb, cmd, 30)  # warm-up, untimed
            for phase in ("monitor", "nomonitor"):
                if phase == "nomonitor":
                    await stop_proc(stack, "monitor")
                for i in range(2 * blocks):
                    mode = ("on", "off", "off", "on")[i % 4]  # ABBA: drift hits both alike
                    await asyncio.sleep(0.5)  # the node-agents' flush and limit timers of the last block
                    if phase == "monitor":
                        if mode == "off":  # the monitor's work on the on blocks is not charged to off
                            waits.append(await monitor_caught_up(nc))
                        mon = stack.proc("monitor")
                        c0, w0 = proc_cpu_s(mon.popen.pid), time.perf_counter()
                    xs = await timed_block(sbs[mode], cmd, block)
                    key = mode if phase == "monitor" else f"{mode}_nomonitor"
                    if phase == "monitor":
                        mon_cpu[mode] += proc_cpu_s(mon.popen.pid) - c0
                        mon_wall[mode] += time.perf_counter() - w0
                    samples[key].extend(xs)
                    load = os.getloadavg()[0]
                    loads.append(load)
                    per_block.append({"half": half, "audited_node": audited, "mode": key, "p50_ms": statistics.median(xs),
                                      "loadavg_1m": load})
                    if i % 4 == 3:
                        log(f"overhead (half {half + 1}, {phase}): block {i + 1}/{2 * blocks}: " + ", ".join(
                            f"{k} p50 {statistics.median(v):.3f} ms" for k, v in samples.items() if v) + f", load {load:.1f}")
        finally:
            await asyncio.gather(*(sb.destroy() for sb in sbs.values()), return_exceptions=True)
            if stack.proc("monitor").popen.poll() is not None:
                stack.restart("monitor")
                await wait_query(nc)
    await set_node_audit(stack, client, UNAUDITED, audit=True)
    pooled = {m: summary(v) for m, v in samples.items()}
    # paired: each on block against the off block next to it (ABBA: on,off | off,on | ...), the
    # median of those ratios; less swayed by the machine's load drifting between blocks
    paired: dict[str, float | None] = {}
    for on_key, off_key in (("on", "off"), ("on_nomonitor", "off_nomonitor")):
        bs = [b for b in per_block if b["mode"] in (on_key, off_key)]
        ratios = []
        for a, b in zip(bs[0::2], bs[1::2]):
            on_b, off_b = (a, b) if a["mode"] == on_key else (b, a)
            if on_b["mode"] == on_key and off_b["mode"] == off_key:
                ratios.append(on_b["p50_ms"] / off_b["p50_ms"])
        paired[on_key] = statistics.median(ratios) - 1 if ratios else None
    p50 = {m: pooled[m]["p50"] for m in samples}
    p99 = {m: pooled[m]["p99"] for m in samples}
    mean = {m: pooled[m]["mean"] for m in samples}
    return {"method": "side by side: one node-agent audited, one --no-audit (roles swapped for the second half), "
                      "alternating ABBA blocks, monitor caught up before each off block",
            "pooled_ms": pooled, "p50_ms": p50, "p99_ms": p99, "mean_ms": mean,
            "p50_overhead": p50["on"] / p50["off"] - 1, "p99_overhead": p99["on"] / p99["off"] - 1,
            "mean_overhead": mean["on"] / mean["off"] - 1,
            "p50_overhead_node_side": p50["on_nomonitor"] / p50["off_nomonitor"] - 1,
            "paired_block_p50_overhead": paired["on"], "paired_block_p50_overhead_node_side": paired["on_nomonitor"],
            "monitor_cpu_share": {m: mon_cpu[m] / mon_wall[m] if mon_wall[m] else None for m in mon_cpu},
            "monitor_catch_up_wait_s": summary(waits), "loadavg_1m": summary(loads),
            "blocks": per_block, "block": block, "execs_per_mode": len(samples["on"]), "image": image, "cmd": cmd}


# ----------------------------------------------------------------------------- plot


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    ing = list(res.get("ingest", []))
    if res.get("ingest_unique_commands"):
        ing.append(res["ingest_unique_commands"])
    if ing:
        labels = [f"{x['workers']} worker{'s' if x['workers'] > 1 else ''}" + ("\nunique cmds" if x.get("unique_commands") else "")
                  for x in ing]
        vals = [x["events_per_s"] or 0 for x in ing]
        ax.bar(labels, vals, color="#4c72b0")
        ax.axhline(GOALS["ingest_events_per_s"]["goal"], color="red", ls="--", label="goal 100k/s")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
        ax.set_ylim(0, max(max(x.get("runs_events_per_s") or [0]) for x in ing) * 1.2)
        ax.set_ylabel("events/s stored (audit_events + exec_log)")
        for i, x in enumerate(ing):
            runs = x.get("runs_events_per_s") or []
            ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3, label="runs" if i == 0 else None)
        ax.set_title(f"ingest into embedded ClickHouse ({ing[0]['events']:,} events; bar = median run)")
        ax.legend()
    ax = axes[1]
    al = res.get("alerts", {})
    names = [k for k in ("idle", "loaded", "real_exec") if k in al]
    if names:
        p50 = [al[k]["latency_s"]["p50"] * 1000 for k in names]
        p99 = [al[k]["latency_s"]["p99"] * 1000 for k in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50", color="#55a868")
        ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99", color="#c44e52")
        ax.axhline(1000, color="red", ls="--", label="goal p99 1 s")
        ax.set_xticks(list(xs))
        lbl = {"idle": "idle", "loaded": f"loaded\n({al.get('loaded', {}).get('background_events_per_s', 0):,.0f} ev/s)",
               "real_exec": "real exec\n(node-agent batching)"}
        ax.set_xticklabels([lbl[k] for k in names])
        ax.set_yscale("log")
        ax.set_ylabel("ms from event to alert")
        ax.set_title("alert latency")
        ax.legend()
    ax = axes[2]
    ov = res.get("overhead")
    if ov:
        modes = [m for m in ("off", "on", "off_nomonitor", "on_nomonitor") if m in ov["p50_ms"]]
        xs = range(len(modes))
        ax.bar([x - 0.2 for x in xs], [ov["p50_ms"][m] for m in modes], width=0.4, label="p50", color="#4c72b0")
        ax.bar([x + 0.2 for x in xs], [ov["p99_ms"][m] for m in modes], width=0.4, label="p99", color="#dd8452")
        for x, m in zip(xs, modes):
            ax.text(x - 0.2, ov["p50_ms"][m], f"{ov['p50_ms'][m]:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([{"off": "audit off", "on": "audit on,\nmonitor\ningesting",
                             "off_nomonitor": "audit off,\nmonitor\nstopped", "on_nomonitor": "audit on,\nmonitor\nstopped"}[m]
                            for m in modes], fontsize=8)
        ax.set_ylim(0, max(ov["p99_ms"][m] for m in modes) * 1.35)
        ax.set_ylabel(f"ms per sb.exec({ov.get('cmd', ['true'])!r}) (sequential)")
        paired = ov.get("paired_block_p50_overhead")
        ax.set_title(f"audit overhead, side by side: p50 {ov['p50_overhead'] * 100:+.1f}% "
                     f"(node side {ov['p50_overhead_node_side'] * 100:+.1f}%), p99 {ov['p99_overhead'] * 100:+.1f}%"
                     + (f"\npaired blocks {paired * 100:+.1f}%" if paired is not None else "")
                     + f"; load avg {ov.get('loadavg_1m', {}).get('p50', 0):.1f} on {os.cpu_count()} cores", fontsize=9)
        ax.legend(loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from corral_sdk import AsyncClient
    from corral_sdk.stack import Stack, free_port

    data = tempfile.mkdtemp(prefix="crl-bench-mon-", dir="/tmp")
    # the overhead phases run an audited and an unaudited node-agent side by side
    nodes = 2 if {"overhead", "overhead_python"} & set(args.only) else 1
    stack = Stack(data_dir=data, nodes=nodes, nats_port=free_port(), image_dir=args.image_dir)
    res: dict[str, Any] = {"benchmark": "monitor_ingest", "started": datetime.datetime.now().isoformat(timespec="seconds"),
                           "machine": machine()}
    log(f"starting the embedded stack in {data}")
    await stack.start(timeout=120)
    nc = await nats.connect(stack.url, max_reconnect_attempts=-1)
    client = await AsyncClient.connect(stack.url)
    try:
        if "ingest" in args.only:
            runs = await bench_ingest(stack, nc, args.events, [w for w in args.workers for _ in range(args.repeat)], args.batch)
            res["ingest_runs"] = runs
            res["ingest"] = []
            for w in args.workers:
                mine = sorted((r for r in runs if r["workers"] == w), key=lambda r: r["events_per_s"] or 0)
                med = dict(mine[len(mine) // 2])
                med["runs_events_per_s"] = [r["events_per_s"] for r in mine]
                med["best_events_per_s"] = mine[-1]["events_per_s"]
                med.pop("curve", None)
                res["ingest"].append(med)
            await restart_monitor(stack, nc, workers="1", batch="256")
        if "alerts" in args.only:
            res["alerts"] = {"idle": await alert_latency(nc, args.alerts, rate=20)}
            res["alerts"]["loaded"] = await alert_latency(nc, args.alerts, rate=20, load_eps=args.load_eps)
            res["alerts"]["real_exec"] = await alert_latency_real(client, args.real)
        if "overhead" in args.only:
            res["overhead"] = await bench_overhead(stack, client, nc, args.execs, args.rounds, block=args.block)
        if "overhead_python" in args.only:  # a Python start: hundreds of opens, a temp file (file activity)
            res["overhead_python"] = await bench_overhead(stack, client, nc, max(20, args.execs // 3), args.rounds, "debian", PY_CMD,
                                                       block=max(10, args.block // 3))
        if "ingest_unique" in args.only:
            # every command distinct: the rules' per-command cache never hits (worst case for the rules)
            runs = await bench_ingest(stack, nc, args.events, [args.workers[0]] * args.repeat, args.batch, unique=True)
            mine = sorted(runs, key=lambda r: r["events_per_s"] or 0)
            med = dict(mine[len(mine) // 2])
            med.pop("curve", None)
            med["runs_events_per_s"] = [r["events_per_s"] for r in mine]
            res["ingest_unique_commands"] = med
            await restart_monitor(stack, nc, workers="1", batch="256")
    finally:
        await client.close()
        await nc.close()
        await stack.stop()
        if args.keep:
            log(f"kept {data}")
        else:
            shutil.rmtree(data, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    verdict = {}
    if res.get("ingest"):
        verdict["ingest_events_per_s"] = max(x["events_per_s"] or 0 for x in res["ingest"])  # best configuration, median run
    if res.get("alerts"):
        verdict["alert_p99_s"] = max(res["alerts"][k]["latency_s"]["p99"] for k in ("idle", "loaded"))
    if res.get("overhead"):
        verdict["audit_exec_overhead"] = res["overhead"]["p50_overhead"]
    res["verdict"] = {k: {"value": v, **GOALS[k], "met": (v >= GOALS[k]["goal"]) if GOALS[k]["op"] == ">=" else (v <= GOALS[k]["goal"])}
                      for k, v in verdict.items()}
    return res


def goals(res: dict[str, Any]) -> list[Goal]:
    """The goals of the sections measured (a partial run keeps the previous run's verdicts)."""
    notes = {}
    if res.get("ingest"):
        notes["ingest_events_per_s"] = "median run per --workers: " + ", ".join(
            f"{x['workers']}: {x['events_per_s'] or 0:,.0f}/s" for x in res["ingest"])
    if res.get("alerts"):
        notes["alert_p99_s"] = "; ".join(f"{k} p50 {v['latency_s']['p50'] * 1000:.1f} ms, p99 {v['latency_s']['p99'] * 1000:.0f} ms"
                                         for k, v in res["alerts"].items() if "latency_s" in v)
    if res.get("overhead"):
        o = res["overhead"]
        notes["audit_exec_overhead"] = (f"{o.get('execs_per_mode')} execs per mode; paired blocks {o.get('paired_block_p50_overhead', 0):+.1%}, "
                                        f"node side {o.get('p50_overhead_node_side', 0):+.1%}")
    return goals_from_ops({k: {**GOALS[k], "value": v["value"]} for k, v in res.get("verdict", {}).items() if k in GOALS}, notes=notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="monitor ingest throughput, alert latency, audit overhead")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--events", type=int, default=500_000, help="backlog size for the ingest runs")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="monitor --workers values to compare")
    ap.add_argument("--batch", type=int, default=256, help="messages per fetch (each message carries 256 events)")
    ap.add_argument("--repeat", type=int, default=3, help="ingest runs per --workers value (the median is reported)")
    ap.add_argument("--alerts", type=int, default=200, help="alert latency samples per scenario")
    ap.add_argument("--load-eps", type=float, default=20_000, help="background events/s for the loaded latency run")
    ap.add_argument("--real", type=int, default=30, help="real-sandbox alert latency samples")
    ap.add_argument("--execs", type=int, default=300, help="overhead: execs per mode per round")
    ap.add_argument("--rounds", type=int, default=10, help="overhead: rounds (about execs * rounds per mode and phase, in blocks)")
    ap.add_argument("--block", type=int, default=250, help="overhead: sequential execs per timed block (modes alternate by block; "
                    "a block outlasts the monitor's 1 s commit interval, so its inserts land inside the on blocks)")
    ap.add_argument("--only", nargs="+", default=["ingest", "ingest_unique", "alerts", "overhead"], choices=["ingest", "ingest_unique", "alerts", "overhead", "overhead_python"])
    ap.add_argument("--keep", action="store_true", help="keep the stack's data dir (logs) for inspection")
    ap.add_argument("--image-dir", default=os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res = asyncio.run(run(args))
    jpath = os.path.join(args.out, "monitor_ingest.json")
    if set(args.only) != {"ingest", "ingest_unique", "alerts", "overhead"} and os.path.exists(jpath):
        # a partial run updates its sections of the previous results
        with open(jpath) as f:
            prev = json.load(f)
        prev.update({k: v for k, v in res.items() if k not in ("verdict",)})
        prev.setdefault("verdict", {}).update(res.get("verdict", {}))
        prev.setdefault("partial_updates", []).append({"sections": args.only, "at": res["started"], "machine": res["machine"],
                                                     "previous_tree": prev.get("tree")})
        res = prev
    save(args.out, "monitor_ingest", res, plot, goals(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
