"""How a test on the host reaches a running container sandbox's filesystems.

A sandbox keeps no mount in the host's table: its init holds private clones of its tmpfs (fd 4)
and its overlay root (fd 5), which root on the host reaches through /proc (see the container
substrate's docstring)."""
from __future__ import annotations

import json
import os


def init_pid(sdir: str) -> int:
    """The sandbox's init, as runc wrote it into the state dir."""
    with open(f"{sdir}/init.pid") as f:
        return int(f.read().strip())


def root(sdir: str) -> str:
    """The sandbox's root filesystem as the agent sees it (the overlay, without the masks the
    sandbox's own mount namespace lays over protected paths)."""
    return f"/proc/{init_pid(sdir)}/fd/5"


def rw(sdir: str) -> str:
    """The sandbox's tmpfs: the overlay's upper and work dirs."""
    return f"/proc/{init_pid(sdir)}/fd/4"


def root_mount(sdir: str) -> tuple[list[str], dict[str, str]]:
    """(mount options, filesystem options) of the sandbox's root mount, from its own mountinfo."""
    with open(f"/proc/{init_pid(sdir)}/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            if pre.split()[4] != "/" or not post.startswith("overlay "):
                continue
            sup: dict[str, str] = {}
            for o in post.split()[2].split(","):
                k, _, v = o.partition("=")
                sup[k] = v.encode().decode("unicode_escape")
            return pre.split()[5].split(","), sup
    raise AssertionError(f"no overlay root in the mount namespace of the sandbox at {sdir}")


def lowers(sdir: str) -> list[str]:
    """The node's mounts of the sandbox's image layers (its record names them; the overlay's own
    options name only the idmapped clones it was given, /proc/self/fd paths)."""
    with open(f"{sdir}/sandbox.json") as f:
        layers = json.load(f)["layers"]
    node_dir = os.path.dirname(os.path.dirname(sdir))
    return [f"{node_dir}/layers/{d[len('sha256-'):][:24]}" for d in layers]


def uid_base(sdir: str) -> int:
    """The host uid of the sandbox's root (its user namespace's range)."""
    with open(f"{sdir}/uid-base") as f:
        return int(f.read())
