"""corral_sdk.pypi_env on the host: the mutation helper's refusals, safe unpacking, the sdist cache,
and that the two real-package environments derive what the grader needs (their alternative fixes
pass the package's own tests, their wrong fixes do not)."""
from __future__ import annotations

import io
import tarfile

import pytest

from corral_common.contract.errors import InvalidRequest
from corral_sdk import pypi_env
from corral_sdk.pypi_env import Mutation, apply_mutation, read_tree, run_tests, unpack_sdist

SRC = '''import math


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


class Box:
    def area(self, w, h):
        return w * h

    def clamp(self, x):
        return x
'''


def m(function: str, old: str, new: str) -> Mutation:
    return Mutation(path="pkg/mod.py", function=function, old=old, new=new)


def test_mutation_replaces_inside_the_function_only():
    out = apply_mutation(SRC, m("area", "w * h", "w * (h - 1)"))
    assert out == SRC.replace("w * h", "w * (h - 1)")


def test_mutation_old_string_must_be_found_once_in_the_function():
    # `return hi` is in the file, but not in `area`
    with pytest.raises(InvalidRequest, match=r"'return hi' not found in function 'area'"):
        apply_mutation(SRC, m("area", "return hi", "return lo"))
    src = SRC + "\n\ndef twice(v):\n    return v + v\n"
    with pytest.raises(InvalidRequest, match=r"'v' found 3 times in function 'twice' of pkg/mod.py \(must be exactly once\)"):
        apply_mutation(src, m("twice", "v", "w"))


def test_mutation_ambiguous_or_missing_function():
    with pytest.raises(InvalidRequest, match=r"2 functions named 'clamp' in pkg/mod.py \(lines 4, 16\)"):
        apply_mutation(SRC, m("clamp", "x < lo", "x <= lo"))
    with pytest.raises(InvalidRequest, match=r"no function 'median' in pkg/mod.py"):
        apply_mutation(SRC, m("median", "x", "y"))


def test_mutation_refuses_no_ops_and_broken_code():
    with pytest.raises(InvalidRequest, match="old and new are the same"):
        apply_mutation(SRC, m("area", "w * h", "w * h"))
    with pytest.raises(InvalidRequest, match="empty old string"):
        apply_mutation(SRC, m("area", "", "x"))
    with pytest.raises(InvalidRequest, match="unparsable"):
        apply_mutation(SRC, m("area", "w * h", "w * (h"))
    with pytest.raises(InvalidRequest, match="does not parse"):
        apply_mutation("def f(:\n", m("f", "f", "g"))


def _tar(path, members: dict[str, bytes], extra=None) -> str:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        if extra:
            extra(tf)
    return str(path)


def test_unpack_refuses_escaping_members(tmp_path):
    def evil_link(tf):
        ti = tarfile.TarInfo("pkg-1.0/link")
        ti.type = tarfile.SYMTYPE
        ti.linkname = "/etc/passwd"
        tf.addfile(ti)

    good = _tar(tmp_path / "good.tar.gz", {"pkg-1.0/a.py": b"x = 1\n", "pkg-1.0/logo.png": b"\x89PNG\0\0"})
    top = unpack_sdist(good, str(tmp_path / "u1"))
    assert top == str(tmp_path / "u1" / "pkg-1.0")
    files, skipped = read_tree(top)
    assert files == {"a.py": "x = 1\n"} and skipped == ["logo.png"]  # binaries are left out, by name

    bad = _tar(tmp_path / "bad.tar.gz", {"pkg-1.0/../../escape.py": b"x\n"})
    with pytest.raises(InvalidRequest, match="cannot unpack"):
        unpack_sdist(bad, str(tmp_path / "u2"))
    assert not (tmp_path / "escape.py").exists()
    bad2 = _tar(tmp_path / "bad2.tar.gz", {"pkg-1.0/a.py": b"x\n"}, evil_link)
    with pytest.raises(InvalidRequest, match="cannot unpack"):
        unpack_sdist(bad2, str(tmp_path / "u3"))
    two = _tar(tmp_path / "two.tar.gz", {"a/x.py": b"", "b/y.py": b""})
    with pytest.raises(InvalidRequest, match="one top directory"):
        unpack_sdist(two, str(tmp_path / "u4"))


def test_fetch_reuses_a_cached_sdist_without_pip(tmp_path, monkeypatch):
    cached = tmp_path / "more_itertools-10.5.0.tar.gz"
    cached.write_bytes(b"not really")
    monkeypatch.setattr(pypi_env.subprocess, "run", lambda *a, **k: pytest.fail("pip ran for a cached sdist"))
    assert pypi_env.fetch_sdist("more-itertools", "10.5.0", str(tmp_path)) == str(cached)
    monkeypatch.setenv("CORRAL_SDIST_DIR", str(tmp_path))
    assert pypi_env.fetch_sdist("more-itertools", "10.5.0") == str(cached)
    with pytest.raises(InvalidRequest, match="invalid package pin"):
        pypi_env.fetch_sdist("more-itertools; rm -rf /", "1", str(tmp_path))


# ---------------------------------------------------------------- the two real environments

from bench.hacks import pypi_envs  # noqa: E402 - the real environments, after the helper's own tests


@pytest.fixture(scope="module", params=["more-itertools", "toolz"])
def real(request):
    pkg = {"more-itertools": pypi_envs.MORE_ITERTOOLS, "toolz": pypi_envs.TOOLZ}[request.param]
    bench = {e.name: e for e in pypi_envs.PYPI_ENVS}[f"pypi-{request.param}"]
    return pkg, pypi_envs.made(pkg, bench.name), bench


@pytest.mark.timeout(900)  # the fixture runs both suites twice on the host; slow on a loaded machine
def test_real_env_derivation(real):
    pkg, env, bench = real
    spec = env.spec
    spec.validate()
    assert env.fail_to_pass and env.pass_to_pass and not set(env.fail_to_pass) & set(env.pass_to_pass)
    assert spec.fail_to_pass == list(env.fail_to_pass) and spec.runner == pkg.runner
    assert set(spec.hidden_files) == set(env.hidden) and not set(env.hidden) & set(spec.files)
    assert spec.files[env.target] == env.buggy != env.fixed == spec.solution.files[env.target]
    assert bench.buggy == env.buggy and bench.target == f"/repo/{env.target}"
    names = env.hidden if pkg.runner == "pytest" else [pypi_env.unittest_module(h) for h in env.hidden]
    assert all(n in spec.test_command.split() for n in names)
    assert all(v in spec.grader_files for v in env.visible_tests)
    assert all(f.startswith(pkg.test_dir) for f in env.hidden)
    if pkg.runner == "pytest":
        assert all("::" in t and t.split("::")[0] in env.hidden for t in env.fail_to_pass)
    else:
        assert all("." in t and "/" not in t for t in env.fail_to_pass)


def _graded(pkg, env, target_text: str, tmp_path) -> dict[str, str]:
    """The graded tests' outcomes with `target_text` as the target, the hidden tests in place."""
    root = tmp_path / "tree"
    files = {**env.spec.files, **env.spec.hidden_files, env.target: target_text}
    pypi_env._write_tree(str(root), files)
    tests = sorted(set(env.hidden) | set(env.visible_tests))
    return run_tests(str(root), pkg.runner, tests).outcomes


@pytest.mark.timeout(900)
def test_real_env_alt_fixes_pass_and_wrong_fails(real, tmp_path):
    pkg, env, bench = real
    assert len(bench.alt_fixes) >= 2 and len(set(bench.alt_fixes) | {bench.fixed}) == len(bench.alt_fixes) + 1
    named = env.fail_to_pass + env.pass_to_pass
    for i, text in enumerate((bench.fixed, *bench.alt_fixes)):
        got = _graded(pkg, env, text, tmp_path / f"fix{i}")
        bad = {t: got.get(t, "missing") for t in named if got.get(t) != "passed"}
        assert not bad, f"fix {i} of {bench.name} fails {bad}"
    for label, text in (("buggy", bench.buggy), ("wrong", bench.wrong)):
        got = _graded(pkg, env, text, tmp_path / label)
        assert any(got.get(t) != "passed" for t in env.fail_to_pass), f"{label} passes every fail_to_pass test"
