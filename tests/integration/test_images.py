"""The image-cache registry and layered sandboxes: imports from every source, whiteouts across
stacked layers, dedup, composition, bad input, garbage collection."""
from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile

import pytest

from corral_common.contract import subjects
from corral_common.contract.images import KV_IMAGES


async def call(nc, op: str, body: dict, timeout: float = 120) -> dict:
    msg = await nc.request(subjects.image_op(op), json.dumps(body).encode(), timeout=timeout)
    return json.loads(msg.data)


def _tar_bytes(entries: list[tuple[str, bytes | None]]) -> bytes:
    """entries: (name, content) files; content None makes a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, content in entries:
            ti = tarfile.TarInfo(name)
            if content is None:
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                tf.addfile(ti)
            else:
                ti.size = len(content)
                ti.mode = 0o644
                tf.addfile(ti, io.BytesIO(content))
    return buf.getvalue()


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="crl-img-") as d:
        yield d


async def test_busybox_is_a_layered_image(nc):
    r = await call(nc, "inspect", {"name": "busybox"})
    assert r["ok"] is True
    assert len(r["image"]["layers"]) == 1
    layer = r["layers"][0]
    assert layer["digest"].startswith("sha256-") and layer["chunks"] >= 1 and layer["chunk_size"] == 1 << 20
    r = await call(nc, "list", {})
    assert "busybox" in [i["name"] for i in r["images"]]


async def test_three_stacked_layers_with_deletes_and_replacements(nc, client, workdir):
    # layer 2 (tar, OCI whiteouts): deletes /data/gone.txt, replaces /data/keep.txt, hides /data/old/ (opaque)
    with open(f"{workdir}/l2.tar", "wb") as f:
        f.write(_tar_bytes([("data/", None), ("data/.wh.gone.txt", b""), ("data/keep.txt", b"layer2\n"),
                            ("data/old/", None), ("data/old/.wh..wh..opq", b""), ("data/old/new.txt", b"fresh\n")]))
    base_dir = f"{workdir}/l1"
    os.makedirs(f"{base_dir}/data/old")
    for name, text in (("gone.txt", "x"), ("keep.txt", "layer1\n"), ("old/a.txt", "a"), ("old/b.txt", "b")):
        with open(f"{base_dir}/data/{name}", "w") as f:
            f.write(text)
    r1 = await call(nc, "import", {"name": "t-l1", "source": "dir", "path": base_dir, "base": "busybox"})
    assert r1["ok"] is True, r1
    r2 = await call(nc, "import", {"name": "t-l2", "source": "tar", "path": f"{workdir}/l2.tar", "base": "t-l1"})
    assert r2["ok"] is True, r2
    # layer 3 (an upper dir in overlayfs format): delete keep.txt again? no: add a file and replace new.txt
    l3 = f"{workdir}/l3"
    os.makedirs(f"{l3}/data/old")
    with open(f"{l3}/data/old/new.txt", "w") as f:
        f.write("layer3\n")
    os.mknod(f"{l3}/data/old/a.txt", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout of a (already hidden) file
    r3 = await call(nc, "import", {"name": "t-l3", "source": "upper", "path": l3, "base": "t-l2"})
    assert r3["ok"] is True, r3
    assert len(r3["image"]["layers"]) == 4 and r3["image"]["parent"] == "t-l2"

    async with await client.create(image="t-l3", cpu=0.1, memory_mb=32) as sb:
        r = await sb.exec("ls /data | sort; echo --; ls /data/old | sort; echo --; cat /data/keep.txt /data/old/new.txt; ls /bin/sh")
        assert r.exit_code == 0, r
        assert r.stdout == "keep.txt\nold\n--\nnew.txt\n--\nlayer2\nlayer3\n/bin/sh\n"
        # writes go to the sandbox's upper, lower layers are read-only and shared
        r = await sb.exec("echo mine > /data/keep.txt && cat /data/keep.txt")
        assert r.stdout == "mine\n"
    async with await client.create(image="t-l2", cpu=0.1, memory_mb=32) as sb2:
        r = await sb2.exec("cat /data/keep.txt; ls /data/old | sort")
        assert r.stdout == "layer2\nnew.txt\n"
    for n in ("t-l3", "t-l2", "t-l1"):
        assert (await call(nc, "delete", {"name": n}))["ok"] is True


async def test_dedup_and_docker_archive(nc, client, workdir):
    content = os.urandom(3 << 20)
    layer_a = _tar_bytes([("big/", None), ("big/blob.bin", content)])
    layer_b = _tar_bytes([("app/", None), ("app/run.sh", b"#!/bin/sh\necho from-docker\n"), ("big/.wh.blob.bin", b"")])
    archive = f"{workdir}/img.tar"
    with tarfile.open(archive, "w") as tf:
        for name, data in (("a/layer.tar", layer_a), ("b/layer.tar", layer_b),
                           ("manifest.json", json.dumps([{"Config": "c.json", "RepoTags": ["x:1"], "Layers": ["a/layer.tar", "b/layer.tar"]}]).encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    r1 = await call(nc, "import", {"name": "t-docker", "source": "docker_archive", "path": archive, "base": "busybox"})
    assert r1["ok"] is True, r1
    assert len(r1["image"]["layers"]) == 3 and r1["uploaded_bytes"] > 3 << 20
    # the same archive under another name: every data chunk is already stored; only each new
    # layer's first chunk (the EROFS superblock, which records the build time) is new
    r2 = await call(nc, "import", {"name": "t-docker2", "source": "docker_archive", "path": archive, "base": "busybox"})
    assert r2["ok"] is True and 0 < r2["uploaded_bytes"] <= 2 * (1 << 20)
    assert r2["image"]["layers"][0] == r1["image"]["layers"][0]
    async with await client.create(image="t-docker", cpu=0.1, memory_mb=32) as sb:
        r = await sb.exec("sh /app/run.sh; ls /big")
        assert r.stdout == "from-docker\n"
    # deleting one of two images sharing layers frees nothing; deleting the second frees them
    # (>=: unused snapshot layers that earlier tests left past their grace period go too)
    d1 = await call(nc, "delete", {"name": "t-docker"})
    assert d1["ok"] is True and d1["freed_layers"] >= 2 and d1["freed_chunks"] >= 2
    left = await call(nc, "inspect", {"name": "t-docker2"})  # the shared layer outlives t-docker
    assert left["ok"] is True and left["layers"][0]["digest"] == r1["image"]["layers"][0]
    d2 = await call(nc, "delete", {"name": "t-docker2"})
    assert d2["ok"] is True and d2["freed_layers"] == 2 and d2["freed_chunks"] >= 4


async def test_compose_from_existing_layers(nc, client):
    bb = await call(nc, "inspect", {"name": "busybox"})
    r = await call(nc, "import", {"name": "t-compose", "source": "layers", "layers": bb["image"]["layers"], "labels": {"k": "v"}})
    assert r["ok"] is True and r["image"]["layers"] == bb["image"]["layers"] and r["uploaded_bytes"] == 0
    async with await client.create(image="t-compose", cpu=0.1, memory_mb=32) as sb:
        assert (await sb.exec("echo ok")).stdout == "ok\n"
    assert (await call(nc, "delete", {"name": "t-compose"}))["freed_layers"] == 0  # busybox still uses it


@pytest.mark.parametrize("body,code,word", [
    ({"name": "Bad Name", "source": "dir", "path": "/tmp"}, "invalid_request", "image name"),
    ({"name": "x", "source": "dir", "path": "/no/such/dir"}, "invalid_request", "path"),
    ({"name": "x", "source": "tar", "path": "/etc/hostname"}, "invalid_request", "tarball"),
    ({"name": "x", "source": "docker_archive", "path": "/etc/hostname"}, "invalid_request", "docker archive"),
    ({"name": "x", "source": "layers", "layers": ["sha256-" + "0" * 64]}, "not_found", "layer"),
    ({"name": "x", "source": "layers", "layers": ["nope"]}, "invalid_request", "digest"),
    ({"name": "x", "source": "dir", "path": "/tmp", "base": "no-such-image"}, "not_found", "no-such-image"),
    ({"name": "x", "source": "dir", "path": "/tmp", "chunk_size": 1000}, "invalid_request", "chunk_size"),
    ({"name": "x", "source": "ftp"}, "invalid_request", "source"),
    ({"name": "x", "source": "dir", "bogus": 1}, "invalid_request", "bogus"),
])
async def test_import_bad_input(nc, body, code, word):
    r = await call(nc, "import", body)
    assert r["ok"] is False and r["error"]["code"] == code, r
    assert word in r["error"]["message"], r


async def test_inspect_delete_unknown_and_malformed_manifest(nc, client):
    r = await call(nc, "inspect", {"name": "no-such"})
    assert r["ok"] is False and r["error"]["code"] == "not_found" and "busybox" in r["error"]["message"]
    r = await call(nc, "delete", {"name": "no-such"})
    assert r["error"]["code"] == "not_found"
    kv = await nc.jetstream().key_value(KV_IMAGES)
    await kv.put("t-broken", b'{"name": 5}')
    r = await call(nc, "inspect", {"name": "t-broken"})
    assert r["ok"] is False and r["error"]["code"] == "internal" and "malformed" in r["error"]["message"]
    with pytest.raises(Exception, match="malformed"):
        await client.create(image="t-broken", cpu=0.1, memory_mb=32)
    await kv.delete("t-broken")


async def test_kv_keys_lists_exactly_the_live_keys(nc):
    """The catalogs (and the image GC, which frees what no listed image names) list keys from the
    bucket stream's subjects: deleted and purged keys are left out, none is missed."""
    from corral_common import bus

    js = nc.jetstream()
    kv = await bus.ensure_kv(js, "corral_test_kv_keys", history=5)
    try:
        assert await bus.kv_keys(kv) == []
        for i in range(300):
            await kv.put(f"k{i}", b"x")
        for i in range(0, 300, 2):
            await kv.delete(f"k{i}")
        await kv.purge("k3")
        await kv.put("k0", b"back")
        assert sorted(await bus.kv_keys(kv)) == sorted({f"k{i}" for i in range(1, 300, 2)} - {"k3"} | {"k0"})
    finally:
        await js.delete_key_value("corral_test_kv_keys")
