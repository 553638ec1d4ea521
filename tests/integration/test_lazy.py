"""Lazily loaded layers seen from sandboxes on the embedded stack: many sandboxes reading one image
fetch each chunk once, destroying them leaves no layer mount behind, and a corrupted chunk in the
store is an I/O error for the reader, never wrong bytes, while the rest of the image reads fine."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time

import pytest

from corral_common.contract import subjects
from corral_common.contract.images import CHUNK_BUCKET
from corral_common.layers import Catalog

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mkfs.erofs") or not os.path.exists("/dev/fuse"),
                                reason="needs root, mkfs.erofs and /dev/fuse")

NODE = "node-1"


async def call(nc, subject: str, body: dict, timeout: float = 120) -> dict:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return json.loads(msg.data)


async def loader(nc, op: str, body: dict | None = None) -> dict:
    r = await call(nc, subjects.node_loader(NODE, op), body or {})
    assert r["ok"] is True, r
    return r


async def import_dir(nc, name: str, path: str, base: str = "busybox") -> tuple[dict, dict]:
    """(image manifest, summary of its new top layer)"""
    r = await call(nc, subjects.IMAGE_IMPORT, {"name": name, "source": "dir", "path": path, "base": base}, timeout=300)
    assert r["ok"] is True, r
    assert len(r["layers"]) == 1 and r["image"]["layers"][-1] == r["layers"][0]["digest"]
    return r["image"], r["layers"][0]


async def delete_image(nc, name: str, digest: str) -> None:
    r = await call(nc, subjects.IMAGE_DELETE, {"name": name})
    assert r["ok"] is True, r
    await call(nc, subjects.node_loader(NODE, "evict"), {"layer": digest})  # not_found is fine too


def layer_mountpoint(stack, digest: str) -> str:
    # the node-agent mounts each layer once per node at <state>/layers/<first 24 hex digits>
    return f"{stack.data_dir}/nodes/{NODE}/layers/{digest[len('sha256-'):][:24]}"


def layer_mounts(stack, digest: str) -> list[str]:
    """Every mount of this host mentioning the layer: its EROFS mount (mount point under the node's
    layers/ dir, source its FUSE file `<fuse>/<digest>`) and overlays using it as a lower dir."""
    mp = layer_mountpoint(stack, digest)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if mp in line or digest in line:
                parts = line.split()
                sep = parts.index("-")
                out.append(f"{parts[sep + 1]} {parts[sep + 2]} on {parts[4]}")
    return out


def write_random(path: str, size: int) -> bytes:
    data = os.urandom(size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return data


async def read_layer_file(path: str) -> None:
    def read() -> None:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    await asyncio.to_thread(read)


async def test_hundred_sandboxes_fetch_each_chunk_once_and_leave_no_mounts(stack, client, nc):
    name = f"lazy-hundred-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="crl-lazy-") as d:
        blob = write_random(f"{d}/data/blob.bin", 8 << 20)
        image, layer = await import_dir(nc, name, d)
    digest = layer["digest"]
    want = hashlib.md5(blob).hexdigest()
    # the busybox layer below is fetched in full first, so every byte fetched from here on is ours
    base = [x for x in image["layers"] if x != digest]
    paths = (await loader(nc, "prepare", {"image": "", "layers": base}))["paths"]
    for x in base:
        await read_layer_file(paths[x])
    await loader(nc, "release", {"layers": base})
    s0 = await loader(nc, "stats")
    assert digest not in s0["layers"] or s0["layers"][digest]["cached_chunks"] == 0
    sandboxes = []
    try:
        for _ in range(4):
            batch = await client.create_batch(25, image=name, cpu=0.1, memory_mb=64, ttl_s=600, timeout=300)
            sandboxes += batch
            assert len(batch) == 25
        assert layer_mounts(stack, digest), "the layer is not mounted while 100 sandboxes use it"
        results = await asyncio.gather(*(sb.exec(["md5sum", "/data/blob.bin"], timeout_s=120) for sb in sandboxes))
        assert [r.exit_code for r in results] == [0] * 100, [r.stderr for r in results if r.exit_code][:3]
        assert {r.stdout.split()[0] for r in results} == {want}
        s1 = await loader(nc, "stats")
        st = s1["layers"][digest]
        assert st["chunks"] == layer["chunks"]
        assert st["fetched_chunks"] == layer["chunks"], st  # each chunk fetched exactly once
        assert st["cached_chunks"] == layer["chunks"] and st["cached_bytes"] == layer["size"]
        # bytes fetched: at most the layer's size (anything else fetched meanwhile, e.g. a function
        # slot of another image being refilled, is counted per layer and taken out)
        others = sum((x["fetched_chunks"] - s0["layers"].get(d, {}).get("fetched_chunks", 0)) * x["chunk_size"]
                     for d, x in s1["layers"].items() if d != digest)
        assert 0 < s1["bytes_fetched"] - s0["bytes_fetched"] - others <= layer["size"]
        assert s1["fetch_errors"] == s0["fetch_errors"] and s1["read_errors"] == s0["read_errors"]
        assert st["refs"] == 100
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sandboxes), return_exceptions=True)
    # (b) nothing uses the layer any more: its EROFS mount (and every overlay on it) is gone
    deadline = time.monotonic() + 15
    while (left := layer_mounts(stack, digest)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert left == []
    assert not os.path.exists(layer_mountpoint(stack, digest))
    st = (await loader(nc, "stats"))["layers"][digest]
    assert st["refs"] == 0
    # the cache keeps the chunks for the next user (evictable now)
    assert st["cached_chunks"] == layer["chunks"]
    await delete_image(nc, name, digest)
    assert layer_mounts(stack, digest) == []


async def test_corrupted_chunk_in_store_is_an_io_error_in_the_sandbox(stack, client, nc):
    name = f"lazy-corrupt-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="crl-lazy-") as d:
        a = write_random(f"{d}/data/a.bin", 6 << 20)
        b = write_random(f"{d}/data/b.bin", 3 << 20)
        c = b"".join(f"line {i}\n".encode() for i in range(500))
        with open(f"{d}/data/c.txt", "wb") as f:
            f.write(c)
        image, layer = await import_dir(nc, name, d)
    digest = layer["digest"]
    js = nc.jetstream()
    manifest = await (await Catalog(js).open()).layer(digest)
    store = await js.object_store(CHUNK_BUCKET)
    # the chunks lying wholly inside a.bin (random bytes: no other file or layer holds them)
    inside = []
    for i, h in enumerate(manifest.chunks):
        data = (await store.get(h)).data
        assert hashlib.sha256(data).hexdigest() == h
        if len(data) == manifest.chunk_size and data in a:
            inside.append((i, h, data))
    assert len(inside) >= 3, f"expected a.bin to span whole chunks, found {len(inside)}"
    idx, h, good = inside[len(inside) // 2]
    # never used on this node: the chunk can only come from the store
    st = await loader(nc, "stats")
    assert digest not in st["layers"] or st["layers"][digest]["cached_chunks"] == 0
    await store.put(h, bytes(x ^ 0x5A for x in good))  # same name (hash), other bytes
    sb = await client.create(image=name, cpu=0.2, memory_mb=64, ttl_s=300)
    try:
        t0 = time.perf_counter()
        r = await sb.exec(["md5sum", "/data/a.bin"], timeout_s=60)
        assert r.exit_code != 0, f"read of a corrupted chunk succeeded: {r.stdout!r}"
        assert "I/O error" in r.stderr or "Input/output error" in r.stderr, r.stderr
        assert hashlib.md5(a).hexdigest() not in r.stdout
        assert time.perf_counter() - t0 < 30
        # the other files read correctly, before and after another try of the bad one
        r = await sb.exec(["md5sum", "/data/b.bin"], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.split()[0] == hashlib.md5(b).hexdigest(), r
        r = await sb.exec(["cat", "/data/c.txt"], timeout_s=60)
        assert r.exit_code == 0 and r.stdout == c.decode()
        r = await sb.exec(["sh", "-c", "cat /data/a.bin > /dev/null"], timeout_s=60)
        assert r.exit_code != 0 and ("I/O error" in r.stderr or "Input/output error" in r.stderr), r
        # a part of a.bin in other chunks still reads: only the bad chunk's range fails
        r = await sb.exec(["sh", "-c", "head -c 65536 /data/a.bin | md5sum"], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.split()[0] == hashlib.md5(a[:65536]).hexdigest(), r
        st = (await loader(nc, "stats"))
        assert st["fetch_errors"] >= 1 and st["read_errors"] >= 1
        assert st["layers"][digest]["cached_chunks"] < st["layers"][digest]["chunks"]
    finally:
        await sb.destroy()
        await store.put(h, good)
    await delete_image(nc, name, digest)
