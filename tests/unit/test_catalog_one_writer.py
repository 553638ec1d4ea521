"""Only the image-cache writes the image catalog (issue 14, "one writer per data set").

Why: the catalog's garbage collection, its import lock and the order in which an image and its
layers appear are the image-cache's to keep. A second writer (a node-agent writing a snapshot's
manifests straight into KV) races the collection and bypasses the lock. Snapshots are built and
uploaded on the node, then registered through `corral.v1.image.import` (source "snapshot").

What counts, on the AST of every module under services/ and libs/: a call of a catalog write
method (`put_image`, `put_layer`, `delete_image`) on anything, or of `.delete`/`.put`/`.create`
on a `.images` or `.layers` attribute (the catalog's KV buckets). Allowed only in the
image-cache's own modules and in the Catalog class that defines the methods (layers.py).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WRITE_METHODS = {"put_image", "put_layer", "delete_image"}
KV_WRITES = {"put", "delete", "create", "purge", "update"}
CATALOG_BUCKETS = {"images", "layers"}
WRITERS = (Path("services/image-cache"), Path("libs/common/corral_common/layers.py"))


def catalog_writes(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if f.attr in WRITE_METHODS:
            out.append((node.lineno, f.attr))
        elif f.attr in KV_WRITES and isinstance(f.value, ast.Attribute) and f.value.attr in CATALOG_BUCKETS:
            out.append((node.lineno, f"{f.value.attr}.{f.attr}"))
    return out


def test_the_detector_sees_writes() -> None:
    src = "async def f(c):\n    await c.put_layer(m)\n    await self.catalog.images.delete(n)\n    await c.layers.get(d)\n"
    assert [w for _, w in catalog_writes(ast.parse(src))] == ["put_layer", "images.delete"]


def test_only_the_image_cache_writes_the_catalog() -> None:
    found = []
    for top in ("services", "libs"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if any(rel == w or w in rel.parents for w in WRITERS):
                continue
            for line, what in catalog_writes(ast.parse(path.read_text(), str(rel))):
                found.append(f"{rel}:{line}: {what}")
    assert not found, "the image catalog is written outside the image-cache:\n" + "\n".join(found)


def test_the_image_cache_is_where_the_writes_are() -> None:
    """The rule above is not vacuous: the image-cache does write the catalog, node-agent snapshots included."""
    service = ROOT / "services/image-cache/corral_image_cache/service.py"
    writes = {w for _, w in catalog_writes(ast.parse(service.read_text()))}
    assert {"put_image", "put_layer"} <= writes
    assert '"snapshot"' in service.read_text()
