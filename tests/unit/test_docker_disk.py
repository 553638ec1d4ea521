"""docker_disk: the tmpfs that caps a Docker container's writable layer (disk_mb), on a layer
directory shaped like overlay2's (`link`, `lower`, `diff/`, `work/work/`), without Docker."""
from __future__ import annotations

import errno
import os
import tempfile

import pytest

from corral_common import linux
from corral_node_agent.substrates import docker_disk


def _fake_layer(root: str) -> str:
    layer = f"{root}/overlay2/abc123"
    os.makedirs(f"{layer}/diff")
    os.makedirs(f"{layer}/work/work")
    os.chmod(layer, 0o710)
    os.chmod(f"{layer}/work/work", 0o000)
    for name, text in (("link", "SHORTID"), ("lower", "l/AAA:l/BBB")):
        with open(f"{layer}/{name}", "w") as f:
            f.write(text)
    return layer


def test_cap_keeps_the_entries_and_enforces_the_size():
    root = tempfile.mkdtemp(prefix="corral-ddisk-")
    layer = _fake_layer(root)
    try:
        docker_disk.cap(layer, 2)
        assert linux.mounted_under(layer) == [layer]
        assert sorted(os.listdir(layer)) == ["diff", "link", "lower", "work"]
        assert open(f"{layer}/lower").read() == "l/AAA:l/BBB" and open(f"{layer}/link").read() == "SHORTID"
        assert os.stat(layer).st_mode & 0o7777 == 0o710 and os.stat(f"{layer}/work/work").st_mode & 0o777 == 0
        with pytest.raises(OSError) as e:
            with open(f"{layer}/diff/big", "wb") as f:
                for _ in range(3):
                    f.write(b"x" * (1 << 20))
                f.flush()
        assert e.value.errno == errno.ENOSPC
        docker_disk.release(layer)
        assert linux.mounted_under(layer) == []
        assert not os.path.exists(f"{layer}/diff/big")  # it was on the tmpfs; the original dir is as it was
        assert open(f"{layer}/lower").read() == "l/AAA:l/BBB"
        docker_disk.release(layer)  # idempotent
        docker_disk.release("")
    finally:
        linux.umount_all(layer)
        os.chmod(f"{layer}/work/work", 0o700)
        import shutil

        shutil.rmtree(root)


def test_layer_of_accepts_only_overlay2_upper_dirs():
    assert docker_disk.layer_of("/var/lib/docker/overlay2/abc/diff", "/var/lib/docker/overlay2") == "/var/lib/docker/overlay2/abc"
    for bad in ("/var/lib/docker/overlay2/abc/work", "/elsewhere/abc/diff", "/var/lib/docker/overlay2/a/b/diff", "diff"):
        with pytest.raises(ValueError):
            docker_disk.layer_of(bad, "/var/lib/docker/overlay2")


def test_layers_dir_says_what_is_missing():
    with pytest.raises(SystemExit, match="vfs"):
        docker_disk.layers_dir({"Driver": "vfs", "DockerRootDir": "/var/lib/docker"})
    with pytest.raises(SystemExit, match="cannot see"):
        docker_disk.layers_dir({"Driver": "overlay2", "DockerRootDir": "/no/such/docker-root"})
