"""The cost of the sandbox hardening (#15) on create and exec, side by side in one run.

Two runc bundle configurations over the same busybox overlay rootfs, measured alternately (so
machine noise falls on both alike):

  before  corral's OCI config as it was before the hardening: capabilities and namespaces as now,
          but the seccomp profile allows by default and answers the denied list with EPERM (all
          architectures), no rlimits, no swap bound, init without capabilities;
  after   corral's OCI config now (`oci.config`): default-deny allowlist on the native ABI,
          rlimits (CORE 0, NOFILE), memory+swap = memory, init keeping SETUID/SETGID/SETPCAP.

create = `runc run -d` of init-less `sleep` (what a create pays runc for; `runc delete -f` is
         reported as destroy, not as a goal);
exec   = a fork+exec of `/bin/true` inside the sandbox, under its filter (the per-exec work of
         corral's exec path, where corral-init forks the command: no `runc exec`), averaged over
         200 in one `runc exec`; and a syscall-heavy command (`dd bs=1` of 200,000 bytes:
         ~400,000 syscalls through the filter). `runc exec true` is reported too, not as a goal:
         runc compiles the whole filter again for every `runc exec`, which corral never runs.

    .venv/bin/python -m bench.hardening [--n 30] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from corral_node_agent import oci

from ._common import goal, log, pyplot, save, stats
from .sandbox_lifecycle import DEFAULT_IMAGE_DIR, RuncBench, checked, ensure_busybox

SYSCALL_HEAVY = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=200000"]
FORK_EXECS = 200
EXEC_LOOP = ["sh", "-c", f"i=0; while [ $i -lt {FORK_EXECS} ]; do /bin/true; i=$((i+1)); done"]


def before_seccomp() -> dict[str, Any]:
    """The shape of the profile before #15: allow by default, the denied list answered EPERM."""
    return {"defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            "syscalls": [{"names": list(oci.DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


def configs() -> dict[str, dict[str, Any]]:
    after = oci.config(hostname="bench", init_path="/bin/true", io_dir="/tmp", cgroups_path="", env={"PATH": "/bin"},
                       cpu=1.0, memory_mb=256, pids_max=256, init_caps=True)
    after["mounts"] = [m for m in after["mounts"] if not m["destination"].startswith("/.corral")]
    after["linux"].pop("cgroupsPath", None)
    after["process"]["args"] = ["sleep", "3600"]
    # the native ABI only, as the node-agent's substrates write it
    after["linux"]["seccomp"]["architectures"] = ["SCMP_ARCH_X86_64"]
    before = json.loads(json.dumps(after))
    before["linux"]["seccomp"] = before_seccomp()
    before["process"].pop("rlimits", None)
    before["linux"]["resources"]["memory"].pop("swap", None)
    for k in ("bounding", "effective", "permitted"):
        before["process"]["capabilities"][k] = []
    return {"before": before, "after": after}


class Bundles(RuncBench):
    def __init__(self, lower: str, config: dict[str, Any], tag: str):
        super().__init__(lower)
        self.config = json.dumps(config).encode()
        self.tag = f"{self.tag}{tag}"

    def exec_argv(self, cid: str, argv: list[str]) -> float:
        return checked([self.runc, "--root", self.root, "exec", cid, *argv])[0]


def measure(lower: str, n: int) -> dict[str, Any]:
    benches = {name: Bundles(lower, cfg, name[0]) for name, cfg in configs().items()}
    samples: dict[str, dict[str, list[float]]] = {name: {"create": [], "exec": [], "exec_syscalls": [], "runc_exec": [],
                                                         "destroy": []} for name in benches}
    try:
        for i in range(n + 3):  # 3 warm-up rounds, not kept
            for name, b in (benches.items() if i % 2 == 0 else reversed(benches.items())):
                cid = f"{b.tag}-{i}"
                b.prepare(cid)
                create = b.start(cid)
                runc_exec = b.exec_runc(cid)
                ex = b.exec_argv(cid, EXEC_LOOP) / FORK_EXECS
                heavy = b.exec_argv(cid, SYSCALL_HEAVY)
                destroy = b.delete(cid)
                if i >= 3:
                    s = samples[name]
                    s["create"].append(create)
                    s["exec"].append(ex)
                    s["exec_syscalls"].append(heavy)
                    s["runc_exec"].append(runc_exec)
                    s["destroy"].append(destroy)
            if i % 10 == 0:
                log(f"round {i}/{n + 3}")
    finally:
        notes = [note for b in benches.values() for note in b.cleanup()]
    out: dict[str, Any] = {name: {k: stats(v) for k, v in s.items()} for name, s in samples.items()}
    out["cleanup_notes"] = notes
    return out


def ratio(res: dict[str, Any], what: str) -> float:
    return round(res["after"][what]["median_ms"] / res["before"][what]["median_ms"], 3)


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    whats = ["create", "exec", "exec_syscalls"]
    x = range(len(whats))
    for off, name in ((-0.2, "before"), (0.2, "after")):
        ax.bar([i + off for i in x], [res[name][w]["median_ms"] for w in whats], width=0.4, label=name)
    ax.set_xticks(list(x), ["create (runc run -d)", "exec (fork+exec inside)", "exec, 400k syscalls"])
    ax.set_ylabel("p50 ms")
    ax.set_title("hardening cost, before vs after (runc, same rootfs, alternating)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--image-dir", default=DEFAULT_IMAGE_DIR)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    t0 = time.time()
    res: dict[str, Any] = {"what": __doc__.split("\n\n")[1].strip(), "n": args.n,
                           "systems": measure(ensure_busybox(args.image_dir), args.n)}
    sysres = res["systems"]
    res["ratios"] = {w: ratio(sysres, w) for w in ("create", "exec", "exec_syscalls", "runc_exec", "destroy")}
    res["seconds"] = round(time.time() - t0, 1)
    goals = [goal("hardening_create_p50", 1.10, res["ratios"]["create"], "x", "lower",
                  what="after / before, runc run -d p50"),
             goal("hardening_exec_p50", 1.10, res["ratios"]["exec"], "x", "lower",
                  what="after / before, one fork+exec of /bin/true inside the sandbox, p50"),
             goal("hardening_syscall_heavy_exec_p50", 1.10, res["ratios"]["exec_syscalls"], "x", "lower",
                  what="after / before, dd bs=1 (~400k syscalls) p50")]
    res["plot_systems"] = sysres
    save(args.out, "hardening", {"config": {"n": args.n}, "results": sysres, "ratios": res["ratios"], "what": res["what"],
                                 "seconds": res["seconds"]}, lambda r, p: plot(r["results"], p), goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
