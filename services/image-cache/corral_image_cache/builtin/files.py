"""The filesystem steps of building an image: making it durable, swapping it into place in one
rename, measuring it and removing a tree without ever descending into a mount.

They are apart from the store because the builders (debian's debootstrap mounts /proc and /sys
into its target) and the store both need a removal that is safe against mounts."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat

from corral_common.contract.errors import Internal

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_RENAME_EXCHANGE = 2


def swap_into_place(new: str, dest: str) -> None:
    """Rename the built directory `new` to `dest`. If `dest` exists (an image from an older
    recipe), the two are exchanged in one renameat2(RENAME_EXCHANGE), so readers always see a
    complete image at `dest`, and the old tree (now at `new`) is removed. A filesystem without
    RENAME_EXCHANGE gets two renames (dest briefly absent, never half-built)."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return
    rc = libc.renameat2(-100, os.fsencode(new), -100, os.fsencode(dest), _RENAME_EXCHANGE)  # AT_FDCWD
    if rc != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"renameat2({new}, {dest}, RENAME_EXCHANGE): {os.strerror(err)}")
        aside = new + ".old"
        os.rename(dest, aside)
        os.rename(new, dest)
        remove_tree(aside)
        return
    try:
        remove_tree(new)  # the old image
    except (OSError, Internal):
        pass  # the new image is in place; the next build's _clean_stale removes the leftover


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc.syncfs(fd)
    finally:
        os.close(fd)


def disk_usage(path: str) -> int:
    """Bytes allocated under path (like `du -s --bytes` of allocated blocks; hard links once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:
                continue
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def remove_tree(path: str) -> None:
    """rmtree that first detaches anything mounted at or below path (debootstrap mounts /proc, /sys
    and, in a container, a tmpfs with bind-mounted devices on the target): rmtree must never
    descend into a host filesystem."""
    if not os.path.lexists(path):
        return
    from corral_common import linux

    real = os.path.realpath(path)
    for mp in linux.mounted_under(real):
        with contextlib.suppress(OSError):
            linux.umount(mp, detach=True)
    left = linux.mounted_under(real)
    if left:
        raise Internal(f"cannot remove {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path)
