"""The directory image store: `<root>/<name>/rootfs` plus `<root>/<name>/image.json` (name,
created_at, size_bytes, source, build_seconds and, for an image with a recipe, its digest).

An image is built in a temporary directory beside the store, `image.json` is written into it last
(atomic rename) and then the whole directory is renamed into place, so a half-built image is never
visible. Builds take an flock on `<root>/.<name>.lock`, so concurrent processes never build the
same image twice. An image built from an older recipe stays readable until its rebuild is swapped
in with one atomic rename."""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import tempfile
import time
from typing import Iterator

from corral_common.contract.errors import InvalidRequest, NotFound

from .files import disk_usage, fsync_dir, remove_tree, swap_into_place, syncfs, write_atomic
from .recipes import BUILDERS, Progress, recipe_digest

DEFAULT_ROOT = "/var/lib/corral/images"

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


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
                syncfs(tmp)  # the tree must be durable before image.json says it is complete
                write_atomic(os.path.join(tmp, "image.json"), json.dumps(meta, indent=2) + "\n")
                swap_into_place(tmp, self._dir(name))
                fsync_dir(self.root)
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
