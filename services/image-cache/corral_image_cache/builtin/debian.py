"""The built-in `debian` image: debootstrap minbase of DEBIAN_SUITE with DEBIAN_PACKAGES from the
machine's own Debian mirror, with progress read from debootstrap's output (~60 s, ~290 MB); and
`browser`, the same with Chromium (~70 s, ~1 GB), and `toolchain`, with g++, rustc and Node.js.

Its recipe (suite, variant, packages) is digested into image.json, so a change here rebuilds the
image once on every machine that has the older one."""
from __future__ import annotations

import collections
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
from typing import TYPE_CHECKING

from corral_common.contract.errors import Internal

from .files import libc

if TYPE_CHECKING:
    from .recipes import Progress

DEBIAN_SUITE = "bookworm"
DEBIAN_FALLBACK_MIRROR = "http://deb.debian.org/debian"
# python3-pytest: environments whose tests are pytest suites run them with the image's own pytest
DEBIAN_PACKAGES = ("python3", "git", "python3-pytest")
# the `browser` image: debian plus headless Chromium (driven over the DevTools protocol through a
# port forwarded over the bus, docs/integrations.md). debootstrap resolves Depends but not
# alternatives: dconf-service needs `dbus-session-bus`, which dbus-x11 provides without systemd
BROWSER_PACKAGES = (*DEBIAN_PACKAGES, "chromium", "fonts-dejavu-core", "dbus-x11")
# the `toolchain` image: debian plus the compilers and runtimes the SandboxFusion gateway's other
# languages run with (cpp: g++, rust: rustc, nodejs: node)
TOOLCHAIN_PACKAGES = (*DEBIAN_PACKAGES, "g++", "rustc", "nodejs")


def debian_recipe(packages: tuple[str, ...] | None = None) -> str:
    pkgs = DEBIAN_PACKAGES if packages is None else packages  # read at call time (the tests vary it)
    return f"debootstrap --variant=minbase {DEBIAN_SUITE} include={','.join(sorted(pkgs))}"


def browser_recipe() -> str:
    return debian_recipe(BROWSER_PACKAGES)


def toolchain_recipe() -> str:
    return debian_recipe(TOOLCHAIN_PACKAGES)


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
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)


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


def build_browser(rootfs: str, progress: Progress | None = None) -> str:
    return build_debian(rootfs, progress, BROWSER_PACKAGES)


def build_toolchain(rootfs: str, progress: Progress | None = None) -> str:
    return build_debian(rootfs, progress, TOOLCHAIN_PACKAGES)


def build_debian(rootfs: str, progress: Progress | None = None, packages: tuple[str, ...] = DEBIAN_PACKAGES) -> str:
    deb = shutil.which("debootstrap", path="/usr/sbin:/sbin:/usr/bin:/bin:" + os.environ.get("PATH", ""))
    if not deb:
        raise Internal("debootstrap not found: install the debootstrap package")
    mirror = apt_mirror(DEBIAN_SUITE)
    args = ["--variant=minbase", f"--include={','.join(packages)}", DEBIAN_SUITE]
    if progress:
        progress(f"debootstrap {DEBIAN_SUITE} from {mirror}", 0.0)
    env = dict(os.environ, LC_ALL="C", LANG="C", DEBIAN_FRONTEND="noninteractive",
               PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    tracker = DebootstrapProgress(130 if packages == DEBIAN_PACKAGES else 330)
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
