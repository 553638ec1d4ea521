"""Protected paths that stay protected while the node-agent is down: decoys mounted over them.

fanotify permission marks (audit/fanotify.py) deny and audit every open of a protected path, but
they live in the agent's fanotify group: if the agent dies, the kernel allows every open (fanotify
fails open) until a restarted agent re-marks the sandbox. So the container never sees the real
files in the first place: at create, each protected path that exists in the image is covered
inside the container's mount namespace by a read-only bind mount of a decoy (runc applies it, like
its `maskedPaths`):

- a protected file -> an empty file (mode 0444);
- a protected directory -> a copy of its tree with the same names, every file empty.

The decoys live in the sandbox's state dir on the host (`<sdir>/masks/<n>`), outside its root.
The agent marks the decoy inodes with the same permission events as the real ones, so while it
runs every open is still denied (EPERM) and audited with the protected path (names mirror the
original tree, so `cat /hidden/test_x.py` is reported as such). While it is down, opens succeed
but read empty files: the content never leaks; the names of files under a protected directory do
(a listing shows them), which is the price of auditing per file.

The sandbox cannot remove the cover: mount, umount and namespace creation are denied by seccomp,
it has no capabilities, `rm`/`rename` of a mount point fail with EBUSY, and `ln` across the mount
fails with EXDEV; open_by_handle_at is denied. Paths that do not exist at create (written later)
are protected by the fanotify marks only. The agent's own files.read goes through the host's view
of the root (not the container's), where check_read refuses protected paths."""
from __future__ import annotations

import os
import stat

import msgspec

from corral_common import linux

from .confine import O_PATH, RESOLVE

MAX_ENTRIES = 20_000  # files and directories mirrored under one protected directory


class Mask(msgspec.Struct, kw_only=True):
    path: str  # the protected path inside the sandbox
    decoy: str  # host path of its decoy
    is_dir: bool


def build(root: str, protected: list[str], masks_dir: str) -> list[Mask]:
    """Make a decoy for each protected path that exists under `root` (resolved inside it, links
    included, as runc will resolve the mount destination)."""
    out: list[Mask] = []
    seen: set[str] = set()
    rootfd = os.open(root, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for p in protected:
            path = os.path.normpath("/" + p.lstrip("/"))
            if path == "/" or path in seen:
                continue
            seen.add(path)
            try:
                fd = linux.openat2(rootfd, path, O_PATH | os.O_CLOEXEC, 0, RESOLVE)
            except OSError:
                continue  # not in this image
            try:
                st = os.fstat(fd)
                decoy = f"{masks_dir}/{len(out)}"
                os.makedirs(masks_dir, mode=0o755, exist_ok=True)
                if stat.S_ISDIR(st.st_mode):
                    _mirror(fd, decoy)
                    out.append(Mask(path=path, decoy=decoy, is_dir=True))
                elif stat.S_ISREG(st.st_mode):
                    _empty_file(decoy)
                    out.append(Mask(path=path, decoy=decoy, is_dir=False))
            finally:
                os.close(fd)
    finally:
        os.close(rootfd)
    if out:
        with open(f"{masks_dir}/masks.json", "wb") as f:
            f.write(msgspec.json.encode(out))
    return out


def load(masks_dir: str) -> list[Mask]:
    try:
        with open(f"{masks_dir}/masks.json", "rb") as f:
            return msgspec.json.decode(f.read(), type=list[Mask])
    except (OSError, msgspec.DecodeError):
        return []


def oci_mounts(masks: list[Mask]) -> list[dict]:
    return [{"destination": m.path, "type": "bind", "source": m.decoy,
             "options": ["rbind" if m.is_dir else "bind", "ro", "nosuid", "nodev", "noexec"]} for m in masks]


def _empty_file(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    os.chmod(path, 0o444)


def _mirror(srcfd: int, dest: str) -> None:
    """Same directory tree and names as the O_PATH directory `srcfd`, every file empty; symlinks
    and special files become empty files too (never followed)."""
    os.mkdir(dest, 0o755)
    count = 0
    queue = [(os.dup(srcfd), dest)]
    try:
        while queue:
            pfd, d = queue.pop()
            try:
                rfd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                os.close(pfd)
                continue
            try:
                for name in os.listdir(rfd):
                    count += 1
                    if count > MAX_ENTRIES:
                        break
                    try:
                        cfd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
                    except OSError:
                        continue
                    if stat.S_ISDIR(os.fstat(cfd).st_mode):
                        os.mkdir(f"{d}/{name}", 0o755)
                        queue.append((cfd, f"{d}/{name}"))
                    else:
                        os.close(cfd)
                        _empty_file(f"{d}/{name}")
            finally:
                os.close(rfd)
                os.close(pfd)
    finally:
        for fd, _ in queue:
            os.close(fd)
