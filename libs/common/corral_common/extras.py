"""Optional dependencies: the base install (SDK + CLI) carries only nats-py, msgspec, typer and rich;
a feature that needs more imports it here, inside the function that uses it, so a missing package
is a clear `unavailable` error naming the extra to install instead of a ModuleNotFoundError
traceback (and importing the SDK never pulls the heavy packages in)."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .contract.errors import Unavailable


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """`module`, imported; Unavailable saying `pip install 'corral[<extra>]'` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:  # the package is there but broken: show the real error
            raise
        raise Unavailable(f"{purpose} needs the Python package {e.name!r}, which is not installed: "
                          f"pip install 'corral[{extra}]'") from None


def require_installed(modules: list[str], extra: str, purpose: str) -> None:
    """Unavailable unless every module can be found, without importing any (chdb alone takes
    seconds and ~0.5 GB): for a process that starts others which import them (the embedded stack)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Unavailable(f"{purpose} needs Python packages that are not installed ({', '.join(missing)}): "
                          f"pip install 'corral[{extra}]'")
