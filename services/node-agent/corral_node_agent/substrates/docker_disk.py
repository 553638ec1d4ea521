"""`disk_mb` for the `docker` substrate: the container's writable layer on a size-capped tmpfs.

Docker's own way, `--storage-opt size=`, needs overlay2 on xfs mounted with `pquota` (or the
btrfs/zfs drivers); a Docker root on ext4, the common case and this host's, refuses it. A `du`
monitor that kills a sandbox over its quota does not enforce anything: writes race past it and the
sandbox never sees ENOSPC. So corral does for Docker what it does for `container`: between
`docker create` and `docker start` it mounts a tmpfs of `disk_mb` over the container's overlay2
layer directory (the one holding `diff` = upperdir and `work` = workdir, which overlayfs needs on
one mount) and copies Docker's few bookkeeping entries (`link`, `lower`, the empty `diff`/`work`)
into it. Docker then mounts the container's overlay with its upper on that tmpfs: a write past
`disk_mb` fails with ENOSPC inside the sandbox, and the pages are charged to the writer's memory
cgroup (the container's), as the `container` substrate's writable tmpfs is. `docker commit`
reads the upper as usual. `docker rm` unmounts the tmpfs itself (moby's EnsureRemoveAll unmounts
what is mounted below a layer it removes); `release` is the safety net after it.

This needs the node-agent to see Docker's data root (same host, same mount namespace) and the
overlay2 storage driver; `check` says clearly when that is not so."""
from __future__ import annotations

import os
import shutil

from corral_common import linux


def layers_dir(info: dict) -> str:
    """Docker's overlay2 layer directory from `docker info`, or SystemExit naming what is missing."""
    driver = info.get("Driver", "")
    root = info.get("DockerRootDir", "/var/lib/docker")
    where = f"{root}/overlay2"
    if driver != "overlay2":
        raise SystemExit(f"node-agent: substrate 'docker' enforces disk_mb with a tmpfs under Docker's overlay2 layers, "
                         f"but this Docker uses the {driver!r} storage driver; run dockerd with `--storage-driver overlay2`")
    if not os.path.isdir(where):
        raise SystemExit(f"node-agent: substrate 'docker' enforces disk_mb with a tmpfs under Docker's layers at {where}, "
                         f"which this node-agent cannot see (Docker on another host or in another mount namespace?)")
    return where


def layer_of(upper_dir: str, layers: str) -> str:
    """The layer directory (parent of `diff`) of a container's UpperDir, checked to be one of Docker's."""
    d = os.path.dirname(upper_dir.rstrip("/"))
    if os.path.basename(upper_dir.rstrip("/")) != "diff" or os.path.dirname(d) != layers.rstrip("/"):
        raise ValueError(f"unexpected overlay2 upper dir {upper_dir!r} (not {layers}/<id>/diff)")
    return d


def cap(layer: str, disk_mb: int) -> None:
    """Mount a tmpfs of disk_mb over `layer` (a created, not yet started container's layer) with
    the same entries, owner and mode. The original entries stay reachable through an O_PATH fd
    opened before the mount shadows them."""
    st = os.stat(layer)
    fd = os.open(layer, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        linux.mount("tmpfs", layer, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"size={disk_mb}m,mode={st.st_mode & 0o7777:o},uid={st.st_uid},gid={st.st_gid}")
        try:
            shutil.copytree(f"/proc/self/fd/{fd}", layer, symlinks=True, dirs_exist_ok=True)
        except BaseException:
            release(layer)
            raise
    finally:
        os.close(fd)


def release(layer: str) -> None:
    """Unmount whatever is still mounted at or under `layer` (Docker normally has done it)."""
    if layer:
        linux.umount_all(layer)
