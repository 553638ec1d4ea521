"""Optional dependencies fail as `unavailable` naming the extra to install (corral_common.extras)."""
from __future__ import annotations

import sys

import pytest

from corral_common import extras
from corral_common.contract.errors import Code, CorralError


def test_a_missing_package_names_its_extra():
    with pytest.raises(CorralError) as e:
        extras.require("corral_no_such_package.sub", "bench", "the plot")
    assert e.value.code is Code.UNAVAILABLE
    assert "'corral_no_such_package'" in e.value.message and "pip install 'corral[bench]'" in e.value.message


def test_an_installed_package_is_returned():
    assert extras.require("json", "bench", "x") is sys.modules["json"]


def test_a_broken_package_shows_its_own_error(tmp_path, monkeypatch):
    """An installed package that fails to import one of its own dependencies is not 'not installed'."""
    (tmp_path / "corral_broken_pkg.py").write_text("import corral_dependency_that_is_gone\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="corral_dependency_that_is_gone"):
        extras.require("corral_broken_pkg", "bench", "x")


def test_require_installed_lists_every_missing_package_without_importing():
    with pytest.raises(CorralError) as e:
        extras.require_installed(["json", "corral_missing_a", "corral_missing_b"], "node", "the embedded stack")
    assert e.value.code is Code.UNAVAILABLE
    assert "corral_missing_a, corral_missing_b" in e.value.message and "pip install 'corral[node]'" in e.value.message
    extras.require_installed(["json"], "node", "x")
