"""The microvm guest: the distribution's kernel and an initramfs made here of busybox-static, the
kernel modules the guest needs (virtio block and serial, EROFS, overlayfs), corral's guest
init and agent (corral_node_agent/guest/) and corral-guest (init/corral-guest.c: what puts the
sandbox's commands in namespaces of their own without a capability).

The kernel is Debian's `linux-image-amd64`; QEMU boots its uncompressed ELF image (taken out of
the bzImage's xz payload once) through PVH, which reaches the guest's init in about half the time
of booting the compressed image under TCG. Both files are cached per kernel version and script
contents under GUEST_CACHE, so a node starts without redoing them."""
from __future__ import annotations

import glob
import gzip
import hashlib
import io
import lzma
import os
import stat
from importlib import resources

import msgspec

from corral_common.contract.errors import Unavailable

from ..initbin import INIT_DIR, ensure_binary

GUEST_CACHE = os.environ.get("CORRAL_GUEST_CACHE", "/var/lib/corral/guest")
BUSYBOX = "/bin/busybox"
#: loaded in this order (each after what it depends on): crc32c_generic is the crc32c that
#: libcrc32c (erofs') asks the crypto API for, which would load it with modprobe; virtio_mmio is
#: the microvm machine's transport, virtio_pci the q35 one's (`vm`)
MODULES = ("virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "crc32c_generic", "erofs", "overlay")
APPLETS = ("sh", "mount", "insmod", "mkdir", "cat", "sed", "hostname", "poweroff", "sleep", "env", "setsid", "tail",
           "base64", "head", "wc", "kill", "rm", "mv", "mkfifo", "printf", "echo", "basename", "dirname", "touch",
           "chmod", "chown", "rmdir", "dd", "tar", "test", "[")


class Guest(msgspec.Struct, frozen=True):
    kernel: str  # the uncompressed kernel (ELF)
    initrd: str
    version: str

    @property
    def tag(self) -> str:
        """Kernel version and the initramfs's make-up (its cache dir's name): a saved guest
        resumes only under the same."""
        return os.path.basename(os.path.dirname(self.kernel))


def find_kernel() -> tuple[str, str]:
    """(bzImage path, version) of the newest installed kernel that has its modules."""
    found = []
    for path in glob.glob("/boot/vmlinuz-*"):
        version = path[len("/boot/vmlinuz-"):]
        if os.path.exists(f"/lib/modules/{version}/modules.dep"):
            found.append((os.path.getmtime(path), path, version))
    if not found:
        raise Unavailable("no guest kernel for the microvm substrate: apt-get install linux-image-amd64 "
                          "(its /boot/vmlinuz-* and /lib/modules/*)")
    _, path, version = max(found)
    return path, version


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz (Debian's)."""
    at = bzimage.find(b"\xfd7zXZ\x00")
    if at < 0:
        raise Unavailable("the guest kernel's payload is not xz-compressed; cannot boot it with -M microvm")
    out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[at:])
    if out[:4] != b"\x7fELF":
        raise Unavailable("the guest kernel's xz payload is not an ELF image")
    return out


def module_order(version: str, names: tuple[str, ...] = MODULES) -> list[str]:
    """Module file paths (under /lib/modules/<version>), dependencies first; built-in ones left out."""
    base = f"/lib/modules/{version}"
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    with open(f"{base}/modules.dep") as f:
        for line in f:
            path, _, rest = line.partition(":")
            deps[path] = rest.split()
            by_name[os.path.basename(path).split(".ko")[0].replace("-", "_")] = path
    builtin = set()
    if os.path.exists(f"{base}/modules.builtin"):
        with open(f"{base}/modules.builtin") as f:
            builtin = {os.path.basename(line.strip()).split(".ko")[0].replace("-", "_") for line in f}
    order: list[str] = []

    def add(path: str) -> None:
        if path in order:
            return
        for d in deps.get(path, []):
            add(d)
        order.append(path)

    for name in names:
        if name in builtin:
            continue
        if name not in by_name:
            raise Unavailable(f"the guest kernel {version} has no module {name}")
        add(by_name[name])
    return [f"{base}/{p}" for p in order]


class _Cpio:
    """A newc cpio archive (what the kernel unpacks as an initramfs), written without a cpio binary."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        raw = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0)
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % v for v in fields) + raw)
        self.buf.write(b"\0" * (-(110 + len(raw)) % 4))
        self.buf.write(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _script(name: str) -> bytes:
    return resources.files("corral_node_agent").joinpath(f"guest/{name}").read_bytes()


def build_initramfs(version: str, helper: str) -> bytes:
    if not os.path.exists(BUSYBOX):
        raise Unavailable("busybox-static is not installed (apt-get install busybox-static)")
    a = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "mnt", "run", "tmp", "lib", "lib/modules"):
        a.dir(d)
    a.chardev("dev/console", 5, 1)
    with open(BUSYBOX, "rb") as f:
        a.file("bin/busybox", f.read(), 0o755)
    for applet in APPLETS:
        a.symlink(f"bin/{applet}", "busybox")
    with open(helper, "rb") as f:
        a.file("bin/corral-guest", f.read(), 0o755)
    names = []
    for path in module_order(version):
        with open(path, "rb") as f:
            data = f.read()
        name = os.path.basename(path)
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name[:-3]
        a.file(f"lib/modules/{name}", data)
        names.append(name)
    a.file("lib/modules/order", "".join(n + "\n" for n in names).encode())
    a.file("init", _script("init.sh"), 0o755)
    a.file("agent.sh", _script("agent.sh"), 0o755)
    return gzip.compress(a.finish(), compresslevel=1)


def ensure_guest(cache: str = GUEST_CACHE) -> Guest:
    """The kernel and initramfs for this host's newest kernel, made once (an atomic rename each)."""
    bzimage, version = find_kernel()
    with open(f"{INIT_DIR}/corral-guest.c", "rb") as f:
        helper_source = f.read()
    key = hashlib.sha256(_script("init.sh") + _script("agent.sh") + helper_source
                         + " ".join((version, *MODULES, *APPLETS)).encode()).hexdigest()[:12]
    d = os.path.join(cache, f"{version}-{key}")
    kernel, initrd = f"{d}/vmlinux", f"{d}/initrd.gz"
    os.makedirs(d, mode=0o755, exist_ok=True)
    if not os.path.exists(kernel):
        with open(bzimage, "rb") as f:
            _write_atomic(kernel, extract_vmlinux(f.read()))
    if not os.path.exists(initrd):
        _write_atomic(initrd, build_initramfs(version, ensure_binary(d, "corral-guest")))
    return Guest(kernel=kernel, initrd=initrd, version=version)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
