"""Which images are built in, how each is built and from which recipe.

A recipe names what an image's content is chosen from (for debian: suite, variant and package
list); its digest goes into image.json, and an image built from another recipe counts as missing,
so the store rebuilds it once instead of silently lacking a package the recipe now has."""
from __future__ import annotations

import hashlib
from typing import Callable

from .busybox import build_busybox
from .debian import browser_recipe, build_browser, build_debian, build_toolchain, debian_recipe, toolchain_recipe

Progress = Callable[[str, "float | None"], None]

BUILDERS: dict[str, Callable[[str, "Progress | None"], str]] = {
    "busybox": build_busybox,
    "debian": build_debian,
    "browser": build_browser,
    "toolchain": build_toolchain,
}

# images whose content is chosen here (busybox is whatever the host has: no recipe)
RECIPES: dict[str, Callable[[], str]] = {"debian": debian_recipe, "browser": browser_recipe, "toolchain": toolchain_recipe}


def recipe(name: str) -> str | None:
    """What a built-in image is built from; None: no recipe, any complete image is current."""
    fn = RECIPES.get(name)
    return None if fn is None else fn()


def recipe_digest(name: str) -> str | None:
    r = recipe(name)
    return None if r is None else hashlib.sha256(r.encode()).hexdigest()[:16]
