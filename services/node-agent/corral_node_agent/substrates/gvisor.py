"""The `gvisor` substrate: the `container` substrate's sandbox (same OCI config, overlay root on a
size-capped tmpfs, corral-init as PID 1, cgroup limits) run by gVisor's `runsc`, so the
sandbox's system calls are served by gVisor's user-space kernel (the Sentry) instead of the
host's: a kernel bug reachable from inside is the Sentry's, not the host's.

What differs from `container`, and why:
- runsc passes init no fds (no --preserve-fds), so init makes its control socket itself
  (`corral-init --listen`) in a host directory bind-mounted into the sandbox (runsc
  --host-uds=create makes it a host socket). Nothing inside can connect to a host socket (that
  would need --host-uds=open: connect() answers EPERM), the node moves the socket out of that
  directory before anything else runs, and a secret token in every request is a second lock
  (init/corral-init.c).
- gVisor's tasks are not host processes: no exec cgroups. An exec's processes are its process
  group (init setsid()s every child), killed through init (GvisorSandbox); a process that starts
  a session of its own leaves the group, so a timeout does not reach it (it ends with the sandbox).
- The root stays mounted on the host (the files API, snapshots and forks use it), read by gVisor
  with --file-access=shared so that host-side writes show inside.
- No user namespace of ours (the sandbox's uid 0 is the Sentry's, and the Sentry runs
  unprivileged in its own namespaces); no seccomp notify (gVisor's own filter; denied calls are
  not audited); file activity is seen as the gofer's host file operations on the root, not per
  process; no warm pool.
- Limits are the host cgroup's, on the whole Sentry: memory_mb plus SENTRY_MEMORY_MB, and
  pids_max as host tasks (SENTRY_TASKS plus TASKS_PER_PROCESS per process). A sandbox that
  exceeds its memory is OOM-killed as a whole (the exec reports oom_killed, the sandbox ends),
  not one process of it; pids_max is approximate (within ~TASKS_PER_PROCESS), and a fork storm
  against it can wedge or end the Sentry (it is refused host threads) rather than see fork fail.
- The platform is probed at start: systrap, then ptrace (`CORRAL_GVISOR_PLATFORM` forces one,
  e.g. kvm on hosts where a KVM guest runs: where nested virtualisation is not usable, a KVM
  probe would hang until its timeout, so it is not tried unasked)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess

from corral_common import linux
from corral_common.contract.errors import Internal, InvalidRequest, Unavailable
from corral_common.contract.messages import SandboxInfo, SandboxSpec

from .. import cgroups, confine, initclient, masks, oci
from ..initbin import ensure_init_binary
from ..layermounts import LayerMounts
from . import runc_cli
from .base import Sandbox
from .common import make_io_dir
from .container import STARTUP_CPU, ContainerSubstrate, Fill
from .container_sandbox import DEFAULT_ENV, ContainerSandbox, Record, mount_overlay, mount_upper

log = logging.getLogger("corral.node.gvisor")

PLATFORM_ENV = "CORRAL_GVISOR_PLATFORM"
#: tried in this order at start, each by running /bin/true in a throwaway sandbox
PLATFORMS = ("systrap", "ptrace")
PROBE_TIMEOUT_S = 20.0
#: init's control dir and socket inside the sandbox, and the token file it reads once
CTL_DIR = "/.corral/ctl"
CTL_SOCK = f"{CTL_DIR}/init.sock"
TOKEN_FILE = f"{CTL_DIR}/token"
SOCKET_WAIT_S = 10.0
#: the Sentry's own share of the sandbox's host cgroup on top of what the spec asks: its memory
#: (~15 MiB idle here) and its host tasks (~40 idle threads; under ptrace each process inside
#: is a host stub too, ~4 tasks each), so a sandbox at its limits can still run at all
SENTRY_MEMORY_MB = 64
SENTRY_TASKS = 64
TASKS_PER_PROCESS = 4


class GvisorSandbox(ContainerSandbox):
    """A container sandbox under runsc: `init_pid` is the Sentry's host pid (its death is the
    sandbox's), the filesystems are the host mounts in the state dir, exec groups are process
    groups inside."""

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, sdir: str, cg: cgroups.Cgroups, init_pid: int,
                 layers: list[str], token: str):
        super().__init__(info, spec, sdir, cg, init_pid, layers)
        self.rootfs = f"{sdir}/rootfs"
        self.rw = f"{sdir}/rw"
        self.init_token = token
        self.group_pids: dict[str, int] = {}

    def open_exec_group(self, name: str) -> list[int]:
        return []

    def exec_started(self, name: str, pid: int) -> None:
        self.group_pids[name] = pid

    async def kill_exec_group(self, name: str) -> None:
        pid = self.group_pids.get(name)
        if pid is None:
            return
        try:
            await initclient.kill_group(self.ctl, pid, self.init_token)
        except initclient.InitError as e:  # it ended meanwhile (init answers 0), or init is gone
            log.debug("exec group not killed", extra={"fields": {"sandbox": self.id, "group": name, "error": str(e)}})

    def close_exec_group(self, name: str) -> bool:
        self.group_pids.pop(name, None)
        return True


class GvisorSubstrate(ContainerSubstrate):
    name = "gvisor"
    supports_seccomp_notify = False
    protects_paths = True
    memory_snapshot_gap = "`runsc checkpoint` is not wired to corral's snapshots yet"

    def __init__(self, node: str, state_dir: str, layers: LayerMounts, runc: str = "runsc"):
        super().__init__(node, state_dir, layers, runc)
        # its own dirs, runsc root and cgroup parent: the container substrate's reconciliation
        # must never see (or tear down) a gVisor sandbox, and ours never a container
        self.sandboxes_dir = f"{state_dir}/gvisor"
        self.runc_root = f"{state_dir}/runsc"
        self.cgroup_parent += "-gvisor"
        self.use_userns = False
        self.runsc = shutil.which(runc) or runc
        self.platform = ""

    async def start(self) -> None:
        if not shutil.which(self.runsc) and not os.path.exists(self.runsc):
            raise Unavailable("gVisor is not installed (apt-get install runsc)")
        if os.geteuid() != 0:
            raise Unavailable("the gvisor substrate needs root (mounts, cgroups, runsc)")
        linux.set_child_subreaper()  # the Sentry outlives `runsc run -d`: ours to reap
        for d, mode in ((self.sandboxes_dir, 0o711), (self.runc_root, 0o700)):
            os.makedirs(d, mode=mode, exist_ok=True)
            os.chmod(d, mode)
        with open(f"{self.state_dir}/cgroup-parent-gvisor", "w") as f:  # for the stack's last-resort sweep
            f.write(self.cgroup_parent + "\n")
        self.init_path = await asyncio.to_thread(ensure_init_binary, f"{self.state_dir}/bin")
        self.platform = await asyncio.to_thread(self._probe_platform)
        # runsc's global flags for every call (run, state, pause, delete, list): runc_cli and
        # the container substrate's teardown call one binary with runc's command line
        self.runc = f"{self.state_dir}/bin/runsc-corral"
        with open(self.runc + ".tmp", "w") as f:
            f.write("#!/bin/sh\n# written by the node-agent's gvisor substrate: runsc with corral's flags\n"
                    f"exec {self.runsc} --platform={self.platform} --network=none --host-uds=create "
                    '--file-access=shared --overlay2=none "$@"\n')
        os.chmod(self.runc + ".tmp", 0o700)
        os.replace(self.runc + ".tmp", self.runc)
        log.info("gvisor substrate ready", extra={"fields": {"platform": self.platform, "runsc": self.runsc}})

    def _probe_platform(self) -> str:
        forced = os.environ.get(PLATFORM_ENV, "")
        problems = []
        for platform in (forced,) if forced else PLATFORMS:
            try:
                p = subprocess.run([self.runsc, f"--platform={platform}", "--network=none", "--root", f"{self.runc_root}/probe",
                                    "do", "/bin/true"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"{platform}: no answer in {PROBE_TIMEOUT_S:g}s")
                continue
            finally:
                shutil.rmtree(f"{self.runc_root}/probe", ignore_errors=True)
            if p.returncode == 0:
                return platform
            problems.append(f"{platform}: {(p.stderr.strip().splitlines() or ['exit ' + str(p.returncode)])[-1]}")
        raise Unavailable(f"gVisor cannot run a sandbox here ({'; '.join(problems)})")

    async def create_warm(self, image: str) -> ContainerSandbox:
        raise InvalidRequest("the gvisor substrate has no warm pool")

    async def _create_in(self, info: SandboxInfo, spec: SandboxSpec, lower: str, layers: list[str], sdir: str,
                         cg: cgroups.Cgroups, base: int, user_fd: int | None, fill: Fill | None) -> ContainerSandbox:
        sid = info.id
        make_io_dir(f"{sdir}/io")
        upper = mount_upper(sdir, spec.disk_mb)
        if fill is not None:
            await fill(upper)
        mount_overlay(sdir, lower)
        if spec.workdir not in ("", "/"):
            confine.mkdirs(f"{sdir}/rootfs", spec.workdir)
        token = secrets.token_hex(16)
        os.makedirs(f"{sdir}/ctl", mode=0o700)
        for path in (f"{sdir}/ctl/token", f"{sdir}/init.token"):  # init's copy (it unlinks it), and ours
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
        cfg = oci.config(hostname=sid, init_path=self.init_path, io_dir=f"{sdir}/io",
                         cgroups_path="/" + cg.rel.lstrip("/"), env=dict(DEFAULT_ENV),
                         cpu=max(spec.cpu, STARTUP_CPU), memory_mb=spec.memory_mb + SENTRY_MEMORY_MB,
                         pids_max=SENTRY_TASKS + TASKS_PER_PROCESS * spec.pids_max, init_caps=True)
        cfg["process"]["args"] = ["/.corral/init", "--listen", CTL_SOCK, TOKEN_FILE]
        cfg["linux"].pop("seccomp", None)  # the Sentry filters its own host calls; runsc ignores an OCI profile
        cfg["mounts"].append({"destination": CTL_DIR, "type": "bind", "source": f"{sdir}/ctl",
                              "options": ["bind", "rw", "nosuid", "nodev", "noexec"]})
        # runsc mounts a tmpfs of its own at /tmp unless the spec has one there: the sandbox's /tmp
        # is its root's, as on `container` (disk_mb, the files API, snapshots and forks see it)
        os.makedirs(f"{sdir}/rootfs/tmp", mode=0o1777, exist_ok=True)
        cfg["mounts"].append({"destination": "/tmp", "type": "bind", "source": f"{sdir}/rootfs/tmp", "options": ["rbind", "rw"]})
        cfg["mounts"].extend(masks.oci_mounts(masks.build(f"{sdir}/rootfs", list(spec.protected_paths), f"{sdir}/masks")))
        with open(f"{sdir}/config.json", "w") as f:
            json.dump(cfg, f)
        rc = await runc_cli.run_detached(self.runc, self.runc_root, sid, sdir, [])
        if rc != 0:
            raise Internal(f"runsc could not start sandbox {sid}: {runc_cli.log_tail(f'{sdir}/runc.log')}")
        with open(f"{sdir}/init.pid") as f:
            sentry = int(f.read().strip())
        await self._link_control_socket(sid, sdir)
        await self._ping(sid, sdir, token)
        # only now, init listening: gVisor's listen() on a host socket still needs its path
        os.unlink(f"{sdir}/ctl/init.sock")
        if spec.cpu < STARTUP_CPU:
            cg.set_cpu(spec.cpu)
        sb = GvisorSandbox(info, spec, sdir, cg, sentry, layers, token)
        self._persist(sb)
        return sb

    async def _link_control_socket(self, sid: str, sdir: str) -> None:
        """Wait for init's socket in the bind-mounted dir; link it where only the node reaches it
        (the original is unlinked once init answers through the link)."""
        made = f"{sdir}/ctl/init.sock"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SOCKET_WAIT_S
        while not os.path.exists(made):
            if loop.time() > deadline:
                state = await asyncio.to_thread(self._state, sid, sdir)
                raise Internal(f"sandbox {sid}'s init made no control socket in {SOCKET_WAIT_S:g}s; {state}")
            await asyncio.sleep(0.005)
        os.link(made, f"{sdir}/ctl.sock")

    async def _ping(self, sid: str, sdir: str, token: str) -> None:
        """Init's first answer. Its socket's file exists from bind(), a moment before listen():
        a refused connection then means "not yet"."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SOCKET_WAIT_S
        while True:
            try:
                await initclient.ping(f"{sdir}/ctl.sock", token=token)
                return
            except initclient.InitError as e:
                if not isinstance(e.__cause__, ConnectionRefusedError) or loop.time() > deadline:
                    state = await asyncio.to_thread(self._state, sid, sdir)
                    raise Internal(f"sandbox {sid} started but its init does not answer ({e}); {state}") from None
            await asyncio.sleep(0.005)

    def _state(self, sid: str, sdir: str) -> str:
        """runsc's view of a sandbox that did not come up, for the error."""
        p = subprocess.run([self.runc, "--root", self.runc_root, "state", sid], capture_output=True, text=True, timeout=10)
        return f"runsc state: {p.stdout.strip() or p.stderr.strip()}; log: {runc_cli.log_tail(f'{sdir}/runc.log')}"

    def _teardown(self, sid: str, sdir: str, cg: cgroups.Cgroups, pidfd: int | None) -> None:
        """The container teardown, after the gofer (runsc's file server, a child of ours since
        `runsc run` exited) is killed and reaped: `runsc delete` waits for it to exit, and a
        zombie never does (5 s per destroy, and a zombie left behind)."""
        gofer = self._gofer_pid(sid)
        if gofer:
            with contextlib.suppress(OSError):
                os.kill(gofer, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(gofer, 0)
        super()._teardown(sid, sdir, cg, pidfd)

    def _gofer_pid(self, sid: str) -> int:
        """From runsc's state file (0: none, or not a gofer any more)."""
        try:
            with open(f"{self.runc_root}/{sid}_sandbox:{sid}.state") as f:
                pid = int(json.load(f).get("goferPid") or 0)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return pid if pid > 0 and f.read().startswith(b"runsc-gofer") else 0
        except (OSError, ValueError):
            return 0

    def _adopted(self, rec: Record, sdir: str, cg: cgroups.Cgroups, init_pid: int) -> ContainerSandbox:
        with open(f"{sdir}/init.token") as f:
            token = f.read().strip()
        return GvisorSandbox(rec.info, rec.spec, sdir, cg, init_pid, rec.layers, token)

    def take_notify_fd(self, sb: Sandbox) -> int | None:
        return None
