"""The built-in `busybox` image: the host's static busybox with its applet links and a minimal
/etc, built in milliseconds (no recipe: it is whatever busybox the host has)."""
from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
from typing import TYPE_CHECKING

from corral_common.contract.errors import Internal

if TYPE_CHECKING:
    from .recipes import Progress


def _find_busybox() -> str:
    for p in ("/bin/busybox", "/usr/bin/busybox", shutil.which("busybox")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    raise Internal("busybox not found: install the busybox-static package")


def _is_static_elf(path: str) -> bool:
    """True if the ELF file has no PT_INTERP program header (no dynamic loader needed)."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF":
            return False
        is64 = ident[4] == 2
        end = "<" if ident[5] == 1 else ">"
        if is64:
            phoff, = struct.unpack_from(end + "Q", ident, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 54)
        else:
            phoff, = struct.unpack_from(end + "I", ident, 28)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 42)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, = struct.unpack_from(end + "I", table, i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


_BUSYBOX_DIRS = {
    "bin": 0o755, "sbin": 0o755, "usr": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755,
    "etc": 0o755, "dev": 0o755, "proc": 0o555, "sys": 0o555, "tmp": 0o1777, "run": 0o755,
    "root": 0o700, "home": 0o755, "mnt": 0o755, "var": 0o755, "var/tmp": 0o1777, "var/log": 0o755,
}

_BUSYBOX_ETC = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
}


def build_busybox(rootfs: str, progress: Progress | None = None) -> str:
    bb = _find_busybox()
    if not _is_static_elf(bb):
        raise Internal(f"{bb} is dynamically linked: install the busybox-static package")
    if progress:
        progress("creating busybox rootfs", 0.0)
    applets = subprocess.run([bb, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    banner = subprocess.run([bb], capture_output=True, text=True).stdout.splitlines()
    version = banner[0].split(" multi-call")[0] if banner else "BusyBox"

    os.mkdir(rootfs, 0o755)
    os.chmod(rootfs, 0o755)
    for d, mode in _BUSYBOX_DIRS.items():
        p = os.path.join(rootfs, d)
        os.makedirs(p, exist_ok=True)
        os.chmod(p, mode)
    target = os.path.join(rootfs, "bin", "busybox")
    shutil.copyfile(bb, target)
    os.chmod(target, 0o755)
    for rel in applets:
        rel = rel.strip("/")
        if not rel or rel == "bin/busybox" or ".." in rel.split("/"):
            continue
        link = os.path.join(rootfs, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        # relative links resolve the same inside the sandbox and when inspected from the host
        dest = os.path.relpath("bin/busybox", os.path.dirname(rel) or ".")
        with contextlib.suppress(FileExistsError):
            os.symlink(dest, link)
    for n, text in _BUSYBOX_ETC.items():
        with open(os.path.join(rootfs, "etc", n), "w") as f:
            f.write(text)
        os.chmod(os.path.join(rootfs, "etc", n), 0o644)
    if progress:
        progress("busybox rootfs created", 0.99)
    return f"{version} from {bb}"


