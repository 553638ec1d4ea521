"""A simple directory image store for the node-agent.

Each image is a plain directory tree: `<root>/<name>/rootfs` plus `<root>/<name>/image.json`
(name, created_at, size_bytes, source). An image is built in a temporary directory beside the
store, `image.json` is written into it last (atomic rename) and then the whole directory is renamed
into place, so a half-built image is never visible. Builds take an flock on `<root>/.<name>.lock`,
so concurrent processes never build the same image twice.

Built-in images: `busybox` (from the host's static busybox, milliseconds) and `debian` (debootstrap
minbase bookworm with python3, git and python3-pytest, ~60 s, ~290 MB).

An image whose recipe (for debian: suite, variant and package list) is in RECIPES is ready only if
its image.json carries that recipe's digest: a machine whose cached image was built from an older
recipe rebuilds it once (into a temporary directory, then swapped in with one atomic rename)
instead of silently lacking a package the recipe now has.

A later issue replaces this with layered, lazily loaded EROFS images; keep the interface small:
`ImageStore(root).path(name)`, `.list()`, `.ensure(name, progress)`.

CLI: `python -m corral_image_cache.builtin build NAME [--root DIR]` and `... ls [--root DIR]`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

from corral_common.contract.errors import Internal, InvalidRequest, NotFound

DEFAULT_ROOT = "/var/lib/corral/images"
DEBIAN_SUITE = "bookworm"
DEBIAN_FALLBACK_MIRROR = "http://deb.debian.org/debian"
# python3-pytest: environments whose tests are pytest suites run them with the image's own pytest
DEBIAN_PACKAGES = ("python3", "git", "python3-pytest")

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")

Progress = Callable[[str, "float | None"], None]


def default_root() -> str:
    return os.environ.get("CORRAL_IMAGE_DIR") or DEFAULT_ROOT


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"invalid image name {name!r}: must match [a-z0-9][a-z0-9._-]* (at most 128 characters)"
        )
    return name


class ImageStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    # ---- reading

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _ready(self, name: str) -> bool:
        """Complete (image.json is written last) and, for an image with a recipe, built from the
        current one: an image built from an older recipe counts as missing, so `ensure` rebuilds it."""
        d = self._dir(name)
        if not (os.path.isfile(os.path.join(d, "image.json")) and os.path.isdir(os.path.join(d, "rootfs"))):
            return False
        want = recipe_digest(name)
        if want is None:
            return True
        try:
            with open(os.path.join(d, "image.json")) as f:
                return json.load(f).get("recipe") == want
        except (OSError, ValueError):
            return False

    def _complete(self, name: str) -> bool:
        d = self._dir(name)
        return (os.path.isdir(d) and not os.path.islink(d) and os.path.isfile(os.path.join(d, "image.json"))
                and os.path.isdir(os.path.join(d, "rootfs")))

    def list(self) -> list[str]:
        """Names of the complete images, sorted."""
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(e for e in entries if _NAME.fullmatch(e) and self._ready(e))

    def path(self, name: str) -> str:
        """The rootfs directory of a complete image."""
        validate_name(name)
        if self._ready(name):
            return os.path.join(self._dir(name), "rootfs")
        raise NotFound(self._unknown(name))

    def info(self, name: str) -> dict:
        """The image's image.json."""
        self.path(name)
        with open(os.path.join(self._dir(name), "image.json")) as f:
            return json.load(f)

    def _unknown(self, name: str) -> str:
        msg = f"unknown image {name!r}; available: {', '.join(self.list()) or 'none'}"
        if name in BUILDERS:
            msg += (f" (built-in image {name!r} is not built yet: "
                    f"run `python -m corral_image_cache.builtin build {name} --root {self.root}`)")
        return msg

    # ---- building

    def ensure(self, name: str, progress: Progress | None = None) -> str:
        """The rootfs of `name`, building it first if it is a missing built-in image."""
        validate_name(name)
        if self._ready(name):
            return self.path(name)
        builder = BUILDERS.get(name)
        if builder is None:
            raise NotFound(self._unknown(name) + f"; built-in: {', '.join(sorted(BUILDERS))}")
        os.makedirs(self.root, exist_ok=True)
        with self._lock(name, progress):
            if self._ready(name):  # a concurrent process built it while we waited
                return self.path(name)
            self._clean_stale(name)
            t0 = time.monotonic()
            tmp = tempfile.mkdtemp(prefix=f".{name}.build-", dir=self.root)
            try:
                os.chmod(tmp, 0o755)  # mkdtemp makes 0700; user-namespaced containers must traverse
                rootfs = os.path.join(tmp, "rootfs")
                source = builder(rootfs, progress)
                if progress:
                    progress("finishing", 0.995)
                meta = {
                    "name": name,
                    "created_at": time.time(),
                    "size_bytes": disk_usage(rootfs),
                    "source": source,
                    "build_seconds": round(time.monotonic() - t0, 3),
                }
                if recipe_digest(name) is not None:
                    meta["recipe"] = recipe_digest(name)
                _syncfs(tmp)  # the tree must be durable before image.json says it is complete
                _write_atomic(os.path.join(tmp, "image.json"), json.dumps(meta, indent=2) + "\n")
                _swap_into_place(tmp, self._dir(name))
                _fsync_dir(self.root)
            except BaseException:
                with contextlib.suppress(Exception):
                    remove_tree(tmp)
                raise
        if progress:
            progress("done", 1.0)
        return self.path(name)

    @contextlib.contextmanager
    def _lock(self, name: str, progress: Progress | None) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, f".{name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if progress:
                    progress(f"waiting for a concurrent build of {name}", None)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _clean_stale(self, name: str) -> None:
        """Under the lock: remove leftovers of crashed builds and an incomplete image directory.

        A complete image built from an older recipe stays in place (others may be reading it)
        until the new build replaces it in one atomic swap."""
        for d in glob.glob(os.path.join(glob.escape(self.root), f".{glob.escape(name)}.build-*")):
            remove_tree(d)
        d = self._dir(name)
        if os.path.lexists(d) and not self._ready(name) and not self._complete(name):
            if os.path.isdir(d) and not os.path.islink(d):
                stale = tempfile.mkdtemp(prefix=f".{name}.build-stale-", dir=self.root)
                os.rename(d, os.path.join(stale, "old"))
                remove_tree(stale)
            else:
                os.unlink(d)


# ---------------------------------------------------------------- helpers

def _debian_recipe() -> str:
    return f"debootstrap --variant=minbase {DEBIAN_SUITE} include={','.join(sorted(DEBIAN_PACKAGES))}"


# images whose content is chosen here (busybox is whatever the host has: no recipe)
RECIPES: dict[str, Callable[[], str]] = {"debian": _debian_recipe}


def recipe(name: str) -> str | None:
    """What a built-in image is built from; None: no recipe, any complete image is current."""
    fn = RECIPES.get(name)
    return None if fn is None else fn()


def recipe_digest(name: str) -> str | None:
    r = recipe(name)
    return None if r is None else hashlib.sha256(r.encode()).hexdigest()[:16]


_RENAME_EXCHANGE = 2


def _swap_into_place(new: str, dest: str) -> None:
    """Rename the built directory `new` to `dest`. If `dest` exists (an image from an older
    recipe), the two are exchanged in one renameat2(RENAME_EXCHANGE), so readers always see a
    complete image at `dest`, and the old tree (now at `new`) is removed. A filesystem without
    RENAME_EXCHANGE gets two renames (dest briefly absent, never half-built)."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return
    rc = _libc.renameat2(-100, os.fsencode(new), -100, os.fsencode(dest), _RENAME_EXCHANGE)  # AT_FDCWD
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

def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)
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


# ---------------------------------------------------------------- busybox

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


# ---------------------------------------------------------------- debian

def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if cur:
                stanzas.append(cur)
            cur, key = {}, None
            continue
        if line[0] in " \t" and key:
            cur[key] += " " + line.strip()
            continue
        if ":" in line:
            k, v = line.split(":", 1)
            key = k.strip().lower()
            cur[key] = v.strip()
    if cur:
        stanzas.append(cur)
    return stanzas


def _usable_uri(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def apt_mirror(suite: str = DEBIAN_SUITE, etc_apt: str = "/etc/apt") -> str:
    """The machine's Debian mirror for `suite`: deb822 `*.sources` first, then the one-line format
    (`sources.list`, `sources.list.d/*.list`), else deb.debian.org."""
    for path in sorted(glob.glob(os.path.join(etc_apt, "sources.list.d", "*.sources"))):
        try:
            text = open(path).read()
        except OSError:
            continue
        for st in _deb822_stanzas(text):
            if "deb" not in st.get("types", "").split() or st.get("enabled", "yes").lower() == "no":
                continue
            if suite not in st.get("suites", "").split():
                continue
            for uri in st.get("uris", "").split():
                if _usable_uri(uri):
                    return uri.rstrip("/")
    lists = [os.path.join(etc_apt, "sources.list")] + sorted(
        glob.glob(os.path.join(etc_apt, "sources.list.d", "*.list")))
    for path in lists:
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.split("#", 1)[0].strip()
            line = re.sub(r"\[[^\]]*\]", " ", line)  # [arch=amd64 signed-by=...]
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite and _usable_uri(parts[1]):
                return parts[1].rstrip("/")
    return DEBIAN_FALLBACK_MIRROR


class DebootstrapProgress:
    """Turns debootstrap's `I:` lines into (phase, approximate fraction).

    Phase boundaries are the shares of a measured run (minbase bookworm + python3, git: 43 s,
    129 packages of which 88 "required"); within a phase the fraction follows the package count.
    """

    # (start, width) of each phase as a share of the whole build
    INDEX = (0.00, 0.03)
    RESOLVE_REQUIRED = 0.03
    RESOLVE_BASE = 0.09
    CHECK_COMPONENT = 0.18
    DOWNLOAD = (0.20, 0.19)
    EXTRACT = (0.40, 0.06)
    INSTALL_CORE = 0.46
    UNPACK_REQUIRED = (0.50, 0.14)
    CONFIGURE_REQUIRED = (0.64, 0.04)
    UNPACK_BASE = (0.68, 0.28)
    CONFIGURE_BASE = (0.96, 0.025)
    DONE = 0.985

    _INDEX_FILE = re.compile(r"(Retrieving|Validating) (InRelease|Release(\.gpg)?|Packages)\s*$")
    _PKG = re.compile(r"(Retrieving|Validating|Extracting|Unpacking|Configuring) ([a-z0-9][a-z0-9+.:-]*?)(\.\.\.| .*)?$")

    def __init__(self, expected_packages: int = 130):
        self.expected = expected_packages
        self.retrieved = 0
        self.extracted = 0
        self.stage = ""  # "", "required", "base"
        self.count = 0
        self.fraction = 0.0

    def _at(self, phase: str, fraction: float) -> tuple[str, float]:
        self.fraction = max(self.fraction, min(fraction, 1.0))
        return phase, self.fraction

    @staticmethod
    def _share(span: tuple[float, float], done: int, total: int) -> float:
        start, width = span
        return start + width * min(done / max(total, 1), 1.0)

    def feed(self, line: str) -> tuple[str, float] | None:
        if not line.startswith("I: "):
            return None
        msg = line[3:].strip()
        if self._INDEX_FILE.match(msg) or msg.startswith(("Checking Release", "Valid Release")):
            return self._at("fetching package lists", self.INDEX[0] + self.INDEX[1] / 2)
        if msg.startswith("Resolving dependencies of required"):
            return self._at("resolving dependencies", self.RESOLVE_REQUIRED)
        if msg.startswith("Resolving dependencies of base"):
            return self._at("resolving dependencies", self.RESOLVE_BASE)
        if msg.startswith("Checking component"):
            return self._at("resolving dependencies", self.CHECK_COMPONENT)
        if msg.startswith("Installing core packages"):
            return self._at("installing core packages", self.INSTALL_CORE)
        if msg.startswith("Unpacking required packages"):
            self.stage, self.count = "required", 0
            return self._at("unpacking required packages", self.UNPACK_REQUIRED[0])
        if msg.startswith("Configuring required packages"):
            self.stage, self.count = "required", 0
            return self._at("configuring required packages", self.CONFIGURE_REQUIRED[0])
        if msg.startswith("Unpacking the base system"):
            self.stage, self.count = "base", 0
            return self._at("unpacking the base system", self.UNPACK_BASE[0])
        if msg.startswith("Configuring the base system"):
            self.stage, self.count = "base", 0
            return self._at("configuring the base system", self.CONFIGURE_BASE[0])
        if msg.startswith("Base system installed"):
            return self._at("base system installed", self.DONE)
        m = self._PKG.match(msg)
        if m:
            verb, pkg = m.group(1), m.group(2)
            if verb == "Validating":
                return None
            if verb == "Retrieving":
                self.retrieved += 1
                return self._at(f"downloading {pkg}", self._share(self.DOWNLOAD, self.retrieved, self.expected))
            if verb == "Extracting":
                self.extracted += 1
                est = max(int(self.retrieved * 0.68), 1)
                return self._at(f"extracting {pkg}", self._share(self.EXTRACT, self.extracted, est))
            self.count += 1
            required = self.extracted or self.retrieved
            total = required if self.stage != "base" else max(self.retrieved - self.extracted, 1)
            span = {
                ("Unpacking", "required"): self.UNPACK_REQUIRED,
                ("Configuring", "required"): self.CONFIGURE_REQUIRED,
                ("Unpacking", "base"): self.UNPACK_BASE,
                ("Configuring", "base"): self.CONFIGURE_BASE,
            }.get((verb, self.stage or "required"))
            return self._at(f"{verb.lower()} {pkg}", self._share(span, self.count, total))
        return self._at(msg.rstrip(".").lower(), self.fraction)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the building process dies (PR_SET_PDEATHSIG), so an
    orphaned debootstrap does not go on writing into a build directory the next build removes."""
    _libc.prctl(1, signal.SIGTERM, 0, 0, 0)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return list(collections.deque(f, maxlen=n))
    except OSError:
        return []


def _clean_apt(rootfs: str) -> None:
    for p in glob.glob(os.path.join(rootfs, "var/cache/apt/archives/*.deb")):
        os.unlink(p)
    for p in glob.glob(os.path.join(rootfs, "var/cache/apt/*.bin")):
        os.unlink(p)
    lists = os.path.join(rootfs, "var/lib/apt/lists")
    for p in glob.glob(os.path.join(lists, "*")):
        if os.path.isdir(p) and not os.path.islink(p):
            for q in glob.glob(os.path.join(p, "*")):  # lists/partial: keep the directory
                os.unlink(q)
        elif os.path.basename(p) != "lock":
            os.unlink(p)


def build_debian(rootfs: str, progress: Progress | None = None) -> str:
    deb = shutil.which("debootstrap", path="/usr/sbin:/sbin:/usr/bin:/bin:" + os.environ.get("PATH", ""))
    if not deb:
        raise Internal("debootstrap not found: install the debootstrap package")
    mirror = apt_mirror(DEBIAN_SUITE)
    args = ["--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", DEBIAN_SUITE]
    if progress:
        progress(f"debootstrap {DEBIAN_SUITE} from {mirror}", 0.0)
    env = dict(os.environ, LC_ALL="C", LANG="C", DEBIAN_FRONTEND="noninteractive",
               PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    tracker = DebootstrapProgress()
    tail: collections.deque[str] = collections.deque(maxlen=30)
    proc = subprocess.Popen(
        [deb, *args, rootfs, mirror], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, env=env,
        start_new_session=True, preexec_fn=_die_with_parent,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            update = tracker.feed(line)
            if update and progress:
                progress(*update)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0:
        msg = [f"debootstrap {' '.join(args)} {mirror} failed with exit status {rc}; last output:"]
        msg += ["  " + line for line in tail]
        log = _tail(os.path.join(rootfs, "debootstrap", "debootstrap.log"), 15)
        if log:
            msg.append("tail of debootstrap.log:")
            msg += ["  " + line.rstrip("\n") for line in log]
        raise Internal("\n".join(msg))
    if progress:
        progress("cleaning apt caches", 0.99)
    _clean_apt(rootfs)
    # debootstrap copies the host's hostname into the target; an image must not carry it
    with open(os.path.join(rootfs, "etc", "hostname"), "w") as f:
        f.write("sandbox\n")
    return f"debootstrap {' '.join(args)} {mirror}"


BUILDERS: dict[str, Callable[[str, "Progress | None"], str]] = {
    "busybox": build_busybox,
    "debian": build_debian,
}


# ---------------------------------------------------------------- CLI

def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _cmd_build(store: ImageStore, name: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    console = Console(stderr=True)
    t0 = time.monotonic()
    with Bar(SpinnerColumn(), TextColumn(f"[bold]{name}[/bold]"), BarColumn(), TaskProgressColumn(),
             TimeElapsedColumn(), TextColumn("{task.description}", markup=False), console=console, transient=False) as bar:
        task = bar.add_task("starting", total=1.0)

        def on_progress(phase: str, fraction: float | None) -> None:
            if fraction is None:
                bar.update(task, description=phase)
            else:
                bar.update(task, description=phase, completed=fraction)

        try:
            path = store.ensure(name, on_progress)
        except Exception as e:  # noqa: BLE001 - a CLI reports every failure the same way
            bar.stop()
            console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            return 1
    info = store.info(name)
    print(f"{name}: {path} ({_human(info['size_bytes'])}, "
          f"built in {info.get('build_seconds', time.monotonic() - t0):.2f} s)")
    return 0


def _cmd_ls(store: ImageStore) -> int:
    names = store.list()
    if not names:
        print(f"no images in {store.root} (built-in: {', '.join(sorted(BUILDERS))})", file=sys.stderr)
        return 0
    for n in names:
        info = store.info(n)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("created_at", 0)))
        print(f"{n:<20} {_human(info.get('size_bytes', 0)):>10}  {created}  {info.get('source', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m corral_image_cache.builtin",
                                 description="corral node-agent directory image store")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build a built-in image ({', '.join(sorted(BUILDERS))}) if missing")
    b.add_argument("name")
    ls = sub.add_parser("ls", help="list the images")
    for p in (b, ls):
        p.add_argument("--root", default=default_root(),
                       help="image directory (default: $CORRAL_IMAGE_DIR or %(default)s)")
    a = ap.parse_args(argv)
    store = ImageStore(a.root)
    try:
        if a.cmd == "build":
            return _cmd_build(store, a.name)
        return _cmd_ls(store)
    except Exception as e:  # noqa: BLE001
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
