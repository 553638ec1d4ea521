"""Unpacking image sources into directories a layer can be built from: tarballs and the layers of
a `docker save` archive, with OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`) turned into overlayfs
whiteouts (a 0/0 character device, the `trusted.overlay.opaque` xattr) so that deletions in upper
layers hide lower files when the layers are stacked."""
from __future__ import annotations

import json
import os
import posixpath
import tarfile
from collections.abc import Iterator

from corral_common.contract.errors import InvalidRequest

WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"


def extract_layer_tar(tf: tarfile.TarFile, dest: str) -> dict[str, int]:
    """Extract one layer tar into dest; returns counts of files, whiteouts and opaque dirs."""
    counts = {"entries": 0, "whiteouts": 0, "opaque": 0}
    whiteouts: list[str] = []
    opaque: list[str] = []
    members = []
    for m in tf.getmembers():
        name = posixpath.normpath(m.name.lstrip("/"))
        if name.startswith("..") or name == ".":
            if name == ".":
                continue
            raise InvalidRequest(f"archive entry {m.name!r} points outside the layer")
        base = posixpath.basename(name)
        parent = posixpath.dirname(name)
        if base == WH_OPAQUE:
            opaque.append(parent)
        elif base.startswith(WH_PREFIX):
            whiteouts.append(posixpath.join(parent, base[len(WH_PREFIX):]))
        else:
            members.append(m)
    try:
        tf.extractall(dest, members=members, numeric_owner=True, filter="tar")
    except tarfile.FilterError as e:
        raise InvalidRequest(f"archive refused: {e}") from None
    counts["entries"] = len(members)
    for d in opaque:
        p = os.path.join(dest, d)
        os.makedirs(p, exist_ok=True)
        os.setxattr(p, "trusted.overlay.opaque", b"y")
        counts["opaque"] += 1
    for w in whiteouts:
        p = os.path.join(dest, w)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if os.path.lexists(p):
            continue
        os.mknod(p, 0o600 | 0o020000, os.makedev(0, 0))
        counts["whiteouts"] += 1
    return counts


def extract_tarball(path: str, dest: str) -> dict[str, int]:
    try:
        with tarfile.open(path) as tf:
            return extract_layer_tar(tf, dest)
    except (tarfile.ReadError, FileNotFoundError, IsADirectoryError) as e:
        raise InvalidRequest(f"cannot read tarball {path}: {e}") from None


def docker_archive_layers(path: str) -> Iterator[tuple[str, tarfile.TarFile]]:
    """Yield (layer name, layer tar) of a `docker save` archive, bottom layer first."""
    try:
        outer = tarfile.open(path)
    except (tarfile.ReadError, FileNotFoundError, IsADirectoryError) as e:
        raise InvalidRequest(f"cannot read docker archive {path}: {e}") from None
    with outer:
        try:
            mf = outer.extractfile("manifest.json")
        except KeyError:
            mf = None
        if mf is None:
            raise InvalidRequest(f"{path} is not a `docker save` archive (no manifest.json)")
        try:
            manifest = json.load(mf)
            layers = manifest[0]["Layers"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InvalidRequest(f"malformed manifest.json in {path}: {e}") from None
        for name in layers:
            f = outer.extractfile(name)
            if f is None:
                raise InvalidRequest(f"docker archive {path} lacks its layer {name}")
            with tarfile.open(fileobj=f) as inner:
                yield name, inner
