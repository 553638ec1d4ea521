"""`python -m corral_image_cache.builtin build NAME [--root DIR]` builds a built-in image if it is
missing, with a progress bar; `... ls [--root DIR]` lists the store."""
from __future__ import annotations

import argparse
import sys
import time

from .recipes import BUILDERS
from .store import ImageStore, default_root


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
