"""Mount helpers: who still uses the loader's FUSE mount, and unmounting it."""
from __future__ import annotations

import ctypes
import glob
import os

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[dict[str, str]]:
    out = []
    for line in text.splitlines():
        parts = line.split(" ")
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        out.append({"mount_point": _unescape(parts[4]), "fstype": parts[sep + 1],
                    "source": _unescape(parts[sep + 2]) if len(parts) > sep + 2 else ""})
    return out


def mounts(pid: str = "self") -> list[dict[str, str]]:
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    return any(m["mount_point"] == path for m in mounts())


def users(mount: str) -> list[str]:
    """EROFS (or any) mounts whose source is a file under `mount`, in every mount namespace on the
    host, and loop devices backed by such files."""
    mount = os.path.realpath(mount).rstrip("/") + "/"
    seen_ns: set[str] = set()
    found: list[str] = []
    for p in ["self", *sorted(d for d in os.listdir("/proc") if d.isdigit())]:
        try:
            ns = os.readlink(f"/proc/{p}/ns/mnt")
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        for m in mounts(p):
            if m["source"].startswith(mount):
                found.append(f"{m['fstype']} {m['source']} on {m['mount_point']} (pid {p}'s namespace {ns})")
    for bf in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            with open(bf) as f:
                backing = f.read().strip()
        except OSError:
            continue
        if backing.startswith(mount):
            found.append(f"{bf.split('/')[3]} backed by {backing}")
    return found


def umount(path: str, detach: bool = False) -> None:
    if _libc.umount2(os.fsencode(path), MNT_DETACH if detach else 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {path}: {os.strerror(e)}")
