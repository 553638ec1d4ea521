"""What a destroyed sandbox could leave behind on the host, for leak assertions."""
from __future__ import annotations

import os
import subprocess

from corral_common import config

CG_ROOT = "/sys/fs/cgroup"


def cgroup_pids(top: str) -> list[int]:
    """Every process in a cgroup directory and its children (one hierarchy)."""
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(top):
        try:
            with open(f"{dirpath}/cgroup.procs") as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids


def cgroups_under(rel: str) -> list[str]:
    out = []
    for h in sorted(os.listdir(CG_ROOT)):
        base = f"{CG_ROOT}/{h}/{rel.strip('/')}"
        if os.path.isdir(base):
            for dirpath, dirs, _ in os.walk(base):
                for d in dirs:
                    out.append(f"{dirpath}/{d}")
    return out


def mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


def runc_containers(runc_root: str, runtime: str = "runc") -> list[str]:
    if not os.path.isdir(runc_root):
        return []
    p = subprocess.run([runtime, "--root", runc_root, "list", "-quiet"], capture_output=True, text=True)
    return [x for x in p.stdout.split() if x]


def processes_with(text: str) -> list[str]:
    """Command lines of processes mentioning `text` (e.g. a state dir), excluding ourselves."""
    out = []
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def init_processes() -> list[int]:
    """Host pids of every corral-init (PID 1 of a container sandbox)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            if exe.endswith("/corral-init") or exe.endswith("/.corral/init"):
                out.append(int(pid))
        except OSError:
            continue
    return out


def cgroup_parent(data_dir: str, node: str) -> str:
    """The node-agent writes its cgroup parent (unique per state dir) at start."""
    with open(f"{data_dir}/nodes/{node}/cgroup-parent") as f:
        return f.read().strip()


def inits_of_node(data_dir: str, node: str) -> list[int]:
    """corral-init processes in this node's cgroups (other stacks on the host have their own)."""
    parent = cgroup_parent(data_dir, node) + "/"
    out = []
    for pid in init_processes():
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if parent in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def _entries(d: str) -> list[str]:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def node_leftovers(data_dir: str, node: str) -> dict[str, list]:
    """What the node's sandboxes left: the container substrate's (and the function substrate's,
    which shares its cgroup parent) and, where the node ran them, the gvisor, microvm and vm substrates'."""
    state = f"{data_dir}/nodes/{node}"
    sdir = f"{state}/sandboxes"
    other_cgroups: list[str] = []
    for name in ("gvisor", "microvm", "vm"):  # the substrates with a cgroup parent of their own, where the node ran them
        parent = f"{state}/cgroup-parent-{name}"
        if os.path.exists(parent):
            with open(parent) as f:
                other_cgroups += cgroups_under(f.read().strip())
    return {
        "sandbox_dirs": _entries(sdir) + _entries(f"{state}/gvisor") + _entries(f"{state}/microvm") + _entries(f"{state}/vm"),
        "mounts": mounts_under(state + "/"),
        "cgroups": cgroups_under(cgroup_parent(data_dir, node)) + other_cgroups,
        "runc": runc_containers(f"{state}/runc") + runc_containers(f"{state}/runsc", "runsc"),
        "uid_ranges": uid_ranges_of(sdir),
        "guests": [p for vm in ("microvm", "vm") for p in processes_with(f"{state}/{vm}/") if "qemu-system" in p],
    }


UID_CLAIMS = config.UID_RANGES_DIR


def uid_ranges_of(owner: str) -> list[int]:
    """Host uid ranges (their bases) the node-agent whose sandboxes live in `owner` still claims."""
    out = []
    for name in sorted(os.listdir(UID_CLAIMS)) if os.path.isdir(UID_CLAIMS) else []:
        try:
            with open(f"{UID_CLAIMS}/{name}") as f:
                if f.readline().strip() == os.path.abspath(owner):
                    out.append(int(name))
        except (OSError, ValueError):
            continue
    return out


def assert_clean(data_dir: str, node: str) -> None:
    left = node_leftovers(data_dir, node)
    assert left == {"sandbox_dirs": [], "mounts": [], "cgroups": [], "runc": [], "uid_ranges": [], "guests": []}, left
