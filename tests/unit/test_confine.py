"""files.read/write confinement, on a plain directory standing in for a sandbox root."""
import os

import pytest

from corral_common.contract.errors import Forbidden, InvalidRequest, NotFound
from corral_node_agent import confine


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    (r / "etc").mkdir(parents=True)
    (r / "etc" / "hostname").write_text("inside\n")
    (tmp_path / "secret").write_text("host secret\n")
    return r


def test_dotdot_stays_inside(root):
    data, _ = confine.read(str(root), "/../../../etc/hostname", 1024)
    assert data == b"inside\n"
    with pytest.raises(NotFound):
        confine.read(str(root), "../secret", 1024)


def test_absolute_symlink_resolves_inside(root, tmp_path):
    os.symlink(str(tmp_path / "secret"), root / "link")
    with pytest.raises(NotFound):
        confine.read(str(root), "/link", 1024)
    os.symlink("/etc/hostname", root / "link2")
    assert confine.read(str(root), "/link2", 1024)[0] == b"inside\n"


def test_relative_symlink_escape_is_confined(root):
    os.symlink("../../../../secret", root / "up")
    with pytest.raises(NotFound):
        confine.read(str(root), "/up", 1024)


def test_proc_magic_links_refused(root):
    os.symlink("/proc/self/root/etc/passwd", root / "magic")
    with pytest.raises((NotFound, Forbidden)):
        confine.read(str(root), "/magic", 1 << 20)


def test_write_through_symlinked_dir_stays_inside(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), root / "d")
    # the link's target, taken inside the root, does not exist: refused, nothing written outside
    with pytest.raises(NotFound):
        confine.write(str(root), "/d/x.txt", b"hi", 0o644, True)
    assert not (outside / "x.txt").exists()
    (root / str(outside).lstrip("/")).mkdir(parents=True)
    confine.write(str(root), "/d/x.txt", b"hi", 0o644, True)
    assert not (outside / "x.txt").exists()
    assert (root / str(outside).lstrip("/") / "x.txt").read_bytes() == b"hi"


def test_write_dotdot_stays_inside(root, tmp_path):
    confine.write(str(root), "../../escape.txt", b"x", 0o644, True)
    assert not (tmp_path / "escape.txt").exists()
    assert (root / "escape.txt").read_bytes() == b"x"


def test_size_cap_and_kinds(root):
    (root / "big").write_bytes(b"x" * 100)
    with pytest.raises(InvalidRequest, match="max_bytes"):
        confine.read(str(root), "/big", 10)
    with pytest.raises(InvalidRequest, match="directory"):
        confine.read(str(root), "/etc", 10)
    os.mkfifo(root / "fifo")
    with pytest.raises(InvalidRequest, match="regular"):
        confine.read(str(root), "/fifo", 10)


def test_mode_and_parents(root):
    confine.write(str(root), "/a/b/c", b"1", 0o600, True)
    assert (root / "a" / "b" / "c").stat().st_mode & 0o777 == 0o600
    with pytest.raises(NotFound):
        confine.write(str(root), "/x/y/z", b"1", 0o600, False)
