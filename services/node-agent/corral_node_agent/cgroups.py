"""cgroup plumbing the node-agent does itself (runc owns the container's own cgroup):
per-exec child cgroups so a timed-out exec's processes can be frozen and killed exactly, usage
stats for heartbeats, and sweeping cgroups that a crashed agent left behind.

Supports cgroup v1 (this machine: hybrid with no v2 controllers) and v2 (unified)."""
from __future__ import annotations

import os
import time

ROOT = "/sys/fs/cgroup"


def is_v2() -> bool:
    return os.path.exists(f"{ROOT}/cgroup.controllers")


# v1 hierarchies used for exec tracking: pids (counting, limit inherited) and freezer (atomic kill)
V1_EXEC_HIERARCHIES = ("pids", "freezer")
# the v1 hierarchies of a cgroup corral makes itself (cpuset left out: a new cpuset takes no task
# before its cpus and mems are set)
V1_OWN = ("cpu", "cpuacct", "memory", "pids", "freezer", "blkio")
V1_ALL = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd", "net_cls", "net_prio", "perf_event", "hugetlb", "rdma", "misc")


class Cgroups:
    """Paths of one sandbox's cgroup (`rel` is runc's cgroupsPath, e.g. `/corral/node-1/sb-...`)."""

    def __init__(self, rel: str):
        self.rel = rel.strip("/")
        self.v2 = is_v2()
        self.removed_pids_hits = 0  # pids.events "max" of exec groups already removed

    def path(self, hierarchy: str, sub: str = "") -> str:
        base = f"{ROOT}/{self.rel}" if self.v2 else f"{ROOT}/{hierarchy}/{self.rel}"
        return f"{base}/{sub}" if sub else base

    # ---- per-exec groups ----

    def exec_group_dirs(self, name: str) -> list[str]:
        if self.v2:
            return [self.path("", name)]
        return [self.path(h, name) for h in V1_EXEC_HIERARCHIES if os.path.isdir(f"{ROOT}/{h}")]

    def make_exec_group(self, name: str) -> list[int]:
        """Create the exec's cgroups and return write fds on their cgroup.procs; the exec'd child
        writes "0" to each to move itself in before it runs anything."""
        fds = []
        try:
            for d in self.exec_group_dirs(name):
                os.makedirs(d, exist_ok=True)
                fds.append(os.open(f"{d}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def kill_group(self, name: str, timeout: float = 5.0) -> int:
        """Freeze, SIGKILL every process in the exec group, thaw; returns how many were killed."""
        return kill_dirs(self.exec_group_dirs(name), self.v2, timeout)

    def remove_group(self, name: str) -> bool:
        ok = True
        hits = _pids_hits(self.path("pids", f"{name}/pids.events"))
        for d in self.exec_group_dirs(name):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        if ok:
            self.removed_pids_hits += hits
        return ok

    def exec_groups(self) -> list[str]:
        d = self.path("" if self.v2 else "pids")
        try:
            return [n for n in os.listdir(d) if os.path.isdir(f"{d}/{n}")]
        except FileNotFoundError:
            return []

    # ---- stats ----

    def memory_bytes(self) -> int:
        f = self.path("memory", "memory.current" if self.v2 else "memory.usage_in_bytes")
        return _read_int(f)

    def cpu_usage_ns(self) -> int:
        if self.v2:
            for line in _read(self.path("", "cpu.stat")).splitlines():
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) * 1000
            return 0
        return _read_int(self.path("cpuacct", "cpuacct.usage"))

    def oom_kills(self) -> int:
        f = self.path("memory", "memory.events" if self.v2 else "memory.oom_control")
        for line in _read(f).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def pids_max_hits(self) -> int:
        """How often a fork failed on the pids limit. pids.events "max" counts in the cgroup the
        fork happened in (an exec group, here), not the one whose limit it met: so the sandbox's
        own count, every live exec group's, and those of exec groups already removed."""
        total = self.removed_pids_hits + _pids_hits(self.path("pids", "pids.events"))
        for g in self.exec_groups():
            total += _pids_hits(self.path("pids", f"{g}/pids.events"))
        return total

    def pids_max(self) -> str:
        try:
            return _read(self.path("pids", "pids.max")).strip()
        except OSError:
            return ""

    def pids_current(self) -> int:
        return _read_int(self.path("pids", "pids.current"))

    def thaw(self) -> None:
        """A frozen (paused) sandbox cannot act on SIGKILL until thawed."""
        if self.v2:
            _write(self.path("", "cgroup.freeze"), "0")
        else:
            _write(self.path("freezer", "freezer.state"), "THAWED")

    def freeze(self, timeout: float = 5.0) -> bool:
        """Freeze every task (warm-pool sandboxes wait frozen: no CPU, no timers firing)."""
        if self.v2:
            _write(self.path("", "cgroup.freeze"), "1")
            state, want = (lambda: "frozen 1" in _read(self.path("", "cgroup.events"))), True
        else:
            _write(self.path("freezer", "freezer.state"), "FROZEN")
            state, want = (lambda: _read(self.path("freezer", "freezer.state")).strip() == "FROZEN"), True
        deadline = time.monotonic() + timeout
        while state() != want:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def set_cpu(self, cpu: float, cpu_period_us: int = 100_000) -> None:
        quota = max(1000, int(cpu * cpu_period_us))
        if self.v2:
            _write_strict(self.path("", "cpu.max"), f"{quota} {cpu_period_us}")
        else:
            _write_strict(self.path("cpu", "cpu.cfs_period_us"), str(cpu_period_us))
            _write_strict(self.path("cpu", "cpu.cfs_quota_us"), str(quota))

    def set_limits(self, cpu: float, memory_mb: int, pids_max: int, cpu_period_us: int = 100_000) -> None:
        """The limits runc sets from config.json (oci.py), rewritten in place: a warm-pool sandbox
        takes the claiming request's limits."""
        mem = memory_mb * 1024 * 1024
        quota = max(1000, int(cpu * cpu_period_us))
        if self.v2:
            _write_strict(self.path("", "memory.max"), str(mem))
            _write_strict(self.path("", "memory.low"), str(mem // 4))
            _write_strict(self.path("", "cpu.max"), f"{quota} {cpu_period_us}")
            _write_strict(self.path("", "pids.max"), str(pids_max))
            return
        memsw = self.path("memory", "memory.memsw.limit_in_bytes")
        limited_sw = os.path.exists(memsw) and _read_int(memsw) < (1 << 62)
        if limited_sw and mem > _read_int(self.path("memory", "memory.limit_in_bytes")):
            _write_strict(memsw, str(mem))  # memsw may never be below the memory limit
            _write_strict(self.path("memory", "memory.limit_in_bytes"), str(mem))
        else:
            _write_strict(self.path("memory", "memory.limit_in_bytes"), str(mem))
            if limited_sw:
                _write_strict(memsw, str(mem))
        _write_strict(self.path("memory", "memory.soft_limit_in_bytes"), str(mem // 4))
        _write_strict(self.path("cpu", "cpu.cfs_period_us"), str(cpu_period_us))
        _write_strict(self.path("cpu", "cpu.cfs_quota_us"), str(quota))
        _write_strict(self.path("pids", "pids.max"), str(pids_max))

    def limits(self) -> dict[str, int]:
        """The limits in force (tests check a claimed warm sandbox got the requested ones)."""
        if self.v2:
            q, period = _read(self.path("", "cpu.max")).split()
            return {"memory": _read_int(self.path("", "memory.max")), "cpu_quota": int(q), "cpu_period": int(period),
                    "pids": _read_int(self.path("", "pids.max"))}
        return {"memory": _read_int(self.path("memory", "memory.limit_in_bytes")),
                "cpu_quota": _read_int(self.path("cpu", "cpu.cfs_quota_us")),
                "cpu_period": _read_int(self.path("cpu", "cpu.cfs_period_us")),
                "pids": _read_int(self.path("pids", "pids.max"))}

    def rename(self, new_rel: str) -> Cgroups:
        """Rename this cgroup (every v1 hierarchy; the processes stay in it) to `new_rel` under the
        same parent, as a warm-pool sandbox takes its claimed id. cgroup v2 has no rename."""
        if self.v2:
            raise OSError("cgroup v2 cannot rename cgroups")
        new = Cgroups(new_rel)
        for h in V1_ALL:
            d = f"{ROOT}/{h}/{self.rel}"
            if os.path.isdir(d):
                os.rename(d, f"{ROOT}/{h}/{new.rel}")
        return new

    def make(self) -> None:
        """Create this cgroup (every v1 hierarchy, or the v2 dir with its parents' controllers
        enabled), for a process corral starts itself rather than through runc."""
        if self.v2:
            parts = self.rel.split("/")
            for i in range(len(parts)):
                d = "/".join([ROOT, *parts[:i + 1]])
                os.makedirs(d, exist_ok=True)
                if i < len(parts) - 1:
                    for c in ("+cpu", "+memory", "+pids"):
                        try:
                            _write_strict(f"{d}/cgroup.subtree_control", c)
                        except OSError:
                            pass  # not available to delegate here: that limit is not set
            return
        for h in V1_OWN:
            if os.path.isdir(f"{ROOT}/{h}"):
                os.makedirs(f"{ROOT}/{h}/{self.rel}", exist_ok=True)

    def add(self, pid: int) -> None:
        """Move process `pid` (every thread of it) into this cgroup in every hierarchy."""
        for d in self.all_dirs():
            _write_strict(f"{d}/cgroup.procs", str(pid))

    def holds(self, pid: int) -> bool:
        """Whether process `pid` is in this cgroup itself (not a child group)."""
        try:
            with open(self.path("pids", "cgroup.procs")) as f:
                return str(pid) in f.read().split()
        except OSError:
            return False

    def wait_empty(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pids_current() == 0:
                return True
            time.sleep(0.002)
        return False

    def all_dirs(self) -> list[str]:
        if self.v2:
            return [self.path("")]
        return [f"{ROOT}/{h}/{self.rel}" for h in V1_ALL if os.path.isdir(f"{ROOT}/{h}/{self.rel}")]

    def destroy(self, timeout: float = 5.0) -> None:
        """Kill whatever is left and remove every cgroup dir of this sandbox, children first."""
        if self._remove_if_empty():
            return
        kill_dirs(self.all_dirs(), self.v2, timeout)
        for top in self.all_dirs():
            rmtree_cgroup(top)

    def _remove_if_empty(self) -> bool:
        """One rmdir per hierarchy, for the common case of a group with no task and no child left
        (a finished function call's: ~2 ms less CPU per call than freezing, walking and polling
        a dozen v1 hierarchies). False at the first busy one (EBUSY: tasks, ENOTEMPTY: child
        groups), and the caller kills and removes the rest: a live task is in this group or a
        child of it in every hierarchy, so the first one tried is busy already."""
        dirs = [self.path("")] if self.v2 else [f"{ROOT}/{h}/{self.rel}" for h in V1_ALL]
        for d in dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError:  # EBUSY: tasks; ENOTEMPTY: child groups
                return False
        return True


def _pids_hits(path: str) -> int:
    for line in _read(path).splitlines():
        if line.startswith("max "):
            try:
                return int(line.split()[1])
            except ValueError:
                return 0
    return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return ""


def _read_int(path: str) -> int:
    s = _read(path).strip()
    try:
        return int(s)
    except ValueError:
        return 0


def procs_recursive(d: str) -> list[int]:
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(d):
        for line in _read(f"{dirpath}/cgroup.procs").split():
            pids.append(int(line))
    return pids


def kill_dirs(dirs: list[str], v2: bool, timeout: float) -> int:
    """Freeze (so nothing forks while we kill), SIGKILL all, thaw, wait until empty."""
    freezer = [d for d in dirs if v2 or "/freezer/" in d]
    for d in freezer:
        _write(f"{d}/cgroup.freeze" if v2 else f"{d}/freezer.state", "1" if v2 else "FROZEN")
    killed = 0
    seen: set[int] = set()
    for d in dirs:
        for pid in procs_recursive(d):
            if pid in seen:
                continue
            seen.add(pid)
            try:
                os.kill(pid, 9)
                killed += 1
            except ProcessLookupError:
                pass
    for d in freezer:
        _write(f"{d}/cgroup.freeze" if v2 else f"{d}/freezer.state", "0" if v2 else "THAWED")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(procs_recursive(d) for d in dirs):
        time.sleep(0.002)
    return killed


def _write_strict(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        pass


def rmtree_cgroup(top: str) -> None:
    """cgroup dirs are removed with rmdir, bottom-up (rm -r does not work on cgroupfs)."""
    if not os.path.isdir(top):
        return
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: len(t[0]), reverse=True):
        for _ in range(50):
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def remove_parent(rel: str) -> None:
    """A node's cgroup parent (runc's cgroupsPath prefix of its sandboxes), in every hierarchy,
    once nothing runs in it: only empty groups go (rmdir refuses the others)."""
    rel = rel.strip("/")
    if not rel:
        return
    tops = [f"{ROOT}/{rel}"] if is_v2() else [f"{ROOT}/{h}/{rel}" for h in sorted(os.listdir(ROOT))]
    for top in tops:
        rmtree_cgroup(top)

