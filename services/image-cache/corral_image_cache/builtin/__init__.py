"""The built-in images and the directory store they are built into, for the node-agent's plain
directory substrates and as the source of the image-cache's built-in layered images.

Built-in images: `busybox` (from the host's static busybox, milliseconds), `debian` (debootstrap
minbase bookworm with python3, git and python3-pytest, ~60 s, ~290 MB), `browser` (debian with
headless Chromium, ~70 s, ~1 GB) and `toolchain` (debian with g++, rustc and Node.js, for the
SandboxFusion gateway's compiled languages); the last two are built on first request, never by default.

- `store`: `ImageStore(root).path(name)`, `.list()`, `.ensure(name, progress)`: atomic, locked builds.
- `recipes`: which images are built in, their builders and the recipe digests that force a rebuild.
- `busybox`, `debian`: the builders (`debian` builds `browser` and `toolchain` too; it also finds the machine's apt mirror and reads
  debootstrap's progress).
- `files`: durable writes, the atomic swap into place, disk usage and mount-safe removal.

CLI (`__main__`): `python -m corral_image_cache.builtin build NAME [--root DIR]` and `... ls [--root DIR]`.
"""
from .busybox import build_busybox
from .debian import DEBIAN_PACKAGES, DEBIAN_SUITE, DebootstrapProgress, apt_mirror, build_debian
from .files import disk_usage, remove_tree
from .recipes import BUILDERS, RECIPES, Progress, recipe, recipe_digest
from .store import DEFAULT_ROOT, ImageStore, default_root, validate_name

__all__ = [
    "BUILDERS", "DEBIAN_PACKAGES", "DEBIAN_SUITE", "DEFAULT_ROOT", "RECIPES", "DebootstrapProgress", "ImageStore",
    "Progress", "apt_mirror", "build_busybox", "build_debian", "default_root", "disk_usage", "recipe", "recipe_digest",
    "remove_tree", "validate_name",
]
