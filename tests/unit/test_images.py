import json
import os
import stat
import subprocess
import threading
import time

import pytest

from corral_common.contract.errors import InvalidRequest, NotFound
from corral_image_cache import builtin as images
from corral_image_cache.builtin import DebootstrapProgress, ImageStore, apt_mirror, debian


def test_busybox_build(tmp_path):
    store = ImageStore(str(tmp_path))
    assert store.list() == []
    phases = []
    t0 = time.monotonic()
    rootfs = store.ensure("busybox", lambda phase, frac: phases.append((phase, frac)))
    elapsed = time.monotonic() - t0
    assert elapsed < 5, elapsed  # well under a second normally; loose bound for a busy machine
    assert rootfs == str(tmp_path / "busybox" / "rootfs") == store.path("busybox")
    assert phases[-1] == ("done", 1.0)

    sh = os.path.join(rootfs, "bin", "sh")
    assert os.path.islink(sh)
    assert os.readlink(sh) == "busybox"
    assert os.path.realpath(sh) == os.path.join(os.path.realpath(rootfs), "bin", "busybox")
    bb = os.path.join(rootfs, "bin", "busybox")
    assert stat.S_ISREG(os.lstat(bb).st_mode) and os.access(bb, os.X_OK)
    assert os.readlink(os.path.join(rootfs, "usr", "bin", "env")) == "../../bin/busybox"
    assert stat.S_IMODE(os.stat(os.path.join(rootfs, "tmp")).st_mode) == 0o1777
    passwd = open(os.path.join(rootfs, "etc", "passwd")).read()
    assert passwd.startswith("root:x:0:0:") and "nobody:x:65534:" in passwd
    assert "127.0.0.1" in open(os.path.join(rootfs, "etc", "hosts")).read()
    out = subprocess.run([sh, "-c", "echo hello"], capture_output=True, text=True, check=True).stdout
    assert out == "hello\n"

    meta = json.loads((tmp_path / "busybox" / "image.json").read_text())
    assert meta["name"] == "busybox" and meta["size_bytes"] > 500_000 and "busybox" in meta["source"].lower()
    assert store.list() == ["busybox"]
    assert [p for p in os.listdir(tmp_path) if ".build-" in p] == []

    # a second ensure is a no-op
    assert store.ensure("busybox") == rootfs
    assert json.loads((tmp_path / "busybox" / "image.json").read_text())["created_at"] == meta["created_at"]


@pytest.mark.parametrize("name", ["", "Busybox", "../etc", "a/b", ".hidden", "-x", "a b", "x" * 200, None])
def test_invalid_names(tmp_path, name):
    store = ImageStore(str(tmp_path))
    with pytest.raises(InvalidRequest):
        store.path(name)
    with pytest.raises(InvalidRequest):
        store.ensure(name)


def test_unknown_image_lists_available(tmp_path):
    store = ImageStore(str(tmp_path / "images"))
    with pytest.raises(NotFound, match="unknown image 'nope'; available: none"):
        store.path("nope")
    store.ensure("busybox")
    with pytest.raises(NotFound, match="unknown image 'nope'; available: busybox"):
        store.path("nope")
    with pytest.raises(NotFound, match="built-in: browser, busybox, debian"):
        store.ensure("nope")
    with pytest.raises(NotFound, match="not built yet"):
        store.path("debian")


def test_incomplete_images_are_ignored_and_replaced(tmp_path):
    (tmp_path / "half" / "rootfs").mkdir(parents=True)  # no image.json: never used
    (tmp_path / "busybox" / "rootfs").mkdir(parents=True)
    (tmp_path / "busybox" / "rootfs" / "junk").write_text("x")
    (tmp_path / ".busybox.build-crashed" / "rootfs").mkdir(parents=True)
    store = ImageStore(str(tmp_path))
    assert store.list() == []
    with pytest.raises(NotFound):
        store.path("half")
    rootfs = store.ensure("busybox")
    assert not os.path.exists(os.path.join(rootfs, "junk"))
    assert os.path.islink(os.path.join(rootfs, "bin", "sh"))
    assert store.list() == ["busybox"]
    assert [p for p in os.listdir(tmp_path) if ".build-" in p] == []


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(rootfs, progress):
        os.makedirs(os.path.join(rootfs, "bin"))
        raise RuntimeError("boom")

    monkeypatch.setitem(images.BUILDERS, "busybox", broken)
    store = ImageStore(str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        store.ensure("busybox")
    assert store.list() == []
    assert sorted(os.listdir(tmp_path)) == [".busybox.lock"]


def test_concurrent_ensure_builds_once(tmp_path, monkeypatch):
    builds = []
    real = images.BUILDERS["busybox"]

    def slow(rootfs, progress):
        builds.append(1)
        time.sleep(0.3)
        return real(rootfs, progress)

    monkeypatch.setitem(images.BUILDERS, "busybox", slow)
    results, errors = [], []

    def run():
        try:
            results.append(ImageStore(str(tmp_path)).ensure("busybox"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(builds) == 1
    assert len(set(results)) == 1 and len(results) == 4


def test_apt_mirror(tmp_path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    assert apt_mirror("bookworm", str(etc)) == "http://deb.debian.org/debian"
    (etc / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://list.example/debian/ bookworm main\n")
    assert apt_mirror("bookworm", str(etc)) == "http://list.example/debian"
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# http://snapshot.debian.org/\nURIs: http://sec.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n")
    assert apt_mirror("bookworm", str(etc)) == "http://mirror.example/debian"


def test_debootstrap_progress():
    lines = [
        "I: Retrieving InRelease ", "I: Checking Release signature", "I: Retrieving Packages ",
        "I: Validating Packages ", "I: Resolving dependencies of required packages...",
        "I: Resolving dependencies of base packages...", "I: Checking component main on http://x/debian...",
    ]
    names = [f"pkg{i}" for i in range(10)]
    lines += [f"I: Retrieving {n} 1.0-1" for n in names] + [f"I: Validating {n} 1.0-1" for n in names]
    lines += ["I: Chosen extractor for .deb packages: dpkg-deb"]
    lines += [f"I: Extracting {n}..." for n in names[:7]]
    lines += ["I: Installing core packages...", "I: Unpacking required packages..."]
    lines += [f"I: Unpacking {n}..." for n in names[:7]] + ["I: Configuring required packages..."]
    lines += [f"I: Configuring {n}..." for n in names[:7]] + ["I: Unpacking the base system..."]
    lines += [f"I: Unpacking {n}..." for n in names[7:]] + ["I: Configuring the base system..."]
    lines += [f"I: Configuring {n}..." for n in names[7:]] + ["I: Base system installed successfully.", "W: x"]
    p = DebootstrapProgress(expected_packages=10)
    updates = [u for u in map(p.feed, lines) if u]
    fracs = [f for _, f in updates]
    assert fracs == sorted(fracs) and 0 <= fracs[0] and fracs[-1] < 1
    phases = [ph for ph, _ in updates]
    assert "downloading pkg3" in phases and "extracting pkg0" in phases
    assert "unpacking pkg8" in phases and "configuring pkg9" in phases
    assert dict(updates)["downloading pkg9"] == pytest.approx(0.39)
    assert dict(updates)["unpacking pkg9"] == pytest.approx(0.96)


def _toy_image(monkeypatch, recipe_text: list[str]) -> list[str]:
    """Register a built-in `toy` image with a recipe (as debian has) whose builder writes the recipe
    it was built from into the rootfs; returns the list of recipes built, in order."""
    built: list[str] = []

    def build(rootfs, progress):
        os.makedirs(os.path.join(rootfs, "etc"))
        with open(os.path.join(rootfs, "etc", "recipe"), "w") as f:
            f.write(recipe_text[0])
        built.append(recipe_text[0])
        return f"toy {recipe_text[0]}"

    monkeypatch.setitem(images.BUILDERS, "toy", build)
    monkeypatch.setitem(images.RECIPES, "toy", lambda: recipe_text[0])
    return built


def test_changed_recipe_is_rebuilt_once(tmp_path, monkeypatch):
    recipe = ["python3 git"]
    built = _toy_image(monkeypatch, recipe)
    store = ImageStore(str(tmp_path))
    rootfs = store.ensure("toy")
    assert json.loads((tmp_path / "toy" / "image.json").read_text())["recipe"] == images.recipe_digest("toy")
    store.ensure("toy")
    assert built == ["python3 git"]  # same recipe: the cached image is current

    # an old reader keeps its directory open across the rebuild
    old_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        recipe[0] = "python3 git python3-pytest"
        assert store.list() == []  # an image from an older recipe is not offered
        with pytest.raises(NotFound):
            store.path("toy")
        assert store.ensure("toy") == rootfs
        assert open(os.path.join(rootfs, "etc", "recipe")).read() == "python3 git python3-pytest"
        store.ensure("toy")
        assert built == ["python3 git", "python3 git python3-pytest"]
        assert store.list() == ["toy"]
        # the old tree was swapped out and removed, no build directory is left
        assert sorted(os.listdir(tmp_path)) == [".toy.lock", "toy"]
        assert os.listdir(f"/proc/self/fd/{old_fd}") == []  # the old rootfs: removed under the reader
    finally:
        os.close(old_fd)


def test_image_without_recipe_digest_is_stale(tmp_path, monkeypatch):
    """An image built before recipes existed (image.json without `recipe`) is rebuilt once."""
    recipe = ["python3 git python3-pytest"]
    built = _toy_image(monkeypatch, recipe)
    d = tmp_path / "toy"
    (d / "rootfs").mkdir(parents=True)
    (d / "image.json").write_text(json.dumps({"name": "toy", "created_at": 0, "size_bytes": 0, "source": "old"}))
    store = ImageStore(str(tmp_path))
    assert store.list() == []
    store.ensure("toy")
    assert built == recipe
    assert store.info("toy")["source"] == "toy python3 git python3-pytest"


def test_failed_rebuild_keeps_the_old_image(tmp_path, monkeypatch):
    recipe = ["v1"]
    _toy_image(monkeypatch, recipe)
    store = ImageStore(str(tmp_path))
    rootfs = store.ensure("toy")
    recipe[0] = "v2"

    def broken(rootfs, progress):
        os.makedirs(rootfs)
        raise RuntimeError("mirror down")

    monkeypatch.setitem(images.BUILDERS, "toy", broken)
    with pytest.raises(RuntimeError, match="mirror down"):
        store.ensure("toy")
    assert open(os.path.join(rootfs, "etc", "recipe")).read() == "v1"  # still there for its readers
    assert sorted(os.listdir(tmp_path)) == [".toy.lock", "toy"]


def test_debian_recipe_names_its_packages(monkeypatch):
    assert "python3-pytest" in images.DEBIAN_PACKAGES
    now = images.recipe_digest("debian")
    monkeypatch.setattr(debian, "DEBIAN_PACKAGES", ("python3", "git"))  # what the recipe reads
    assert images.recipe_digest("debian") != now
    assert images.recipe_digest("busybox") is None
