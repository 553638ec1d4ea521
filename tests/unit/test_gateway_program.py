"""The gateway's run script (corral_gateway.languages): what a sandbox executes, run here with the
host's /bin/sh in a scratch directory, so quoting, chunking and the size limit are checked on a real
shell without a stack."""
from __future__ import annotations

import base64
import os
import subprocess

import pytest

from corral_common.contract.errors import InvalidRequest
from corral_gateway.languages import B64_CHUNK, CODE_CHUNK, LANGUAGES, PayloadTooLarge, binary, check_path, language, program


def run_here(prog, cwd, stdin: str = "") -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], **prog.env}
    return subprocess.run(prog.argv, cwd=cwd, env=env, input=stdin.encode(), capture_output=True, timeout=60)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_code_and_files_land_intact(tmp_path):
    """Odd paths are quoted, large contents are split over several variables (each below Linux's
    128 KiB per string) and joined back byte for byte; the program sees none of the variables."""
    blob = os.urandom(3 * B64_CHUNK)  # binary, several chunks once base64'd
    files = {"d ir/it's $x.bin": b64(blob), "plain.txt": b64(b"hi\n")}
    code = ("import os, sys\n"
            f"s = '{'ü' * (CODE_CHUNK + 10)}'\n"
            "print(len(s), sys.stdin.read(), sorted(k for k in os.environ if k.startswith('CORRAL_SF_')))\n")
    prog = program(LANGUAGES["python"], code, files, [])
    assert all(len(v.encode()) < 128 * 1024 for v in prog.env.values())
    assert sum(k.startswith("CORRAL_SF_CODE_") for k in prog.env) >= 2
    p = run_here(prog, tmp_path, stdin="in")
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode() == f"{CODE_CHUNK + 10} in []\n"
    assert (tmp_path / "d ir" / "it's $x.bin").read_bytes() == blob
    assert (tmp_path / prog.code_file).read_text() == code


def test_exit_status_is_the_programs(tmp_path):
    p = run_here(program(language("bash"), "echo out; echo err >&2; exit 7", {}, []), tmp_path)
    assert (p.returncode, p.stdout, p.stderr) == (7, b"out\n", b"err\n")


def test_pytest_args_are_quoted():
    prog = program(language("pytest"), "def test_x(): pass", {}, ["-k", "x; touch /tmp/no", "$(id)"])
    last = prog.argv[2].strip().splitlines()[-1]
    assert last.endswith("-k 'x; touch /tmp/no' '$(id)'")
    assert "-k" not in program(language("python"), "pass", {}, ["-k"]).argv[2]  # only pytest takes args, as SandboxFusion


def test_refusals():
    with pytest.raises(InvalidRequest, match="supported: bash, cpp, nodejs, pytest, python, rust"):
        language("java")
    with pytest.raises(PayloadTooLarge, match="at most"):
        program(LANGUAGES["python"], "pass", {"f": b64(b"z" * 1_300_000)}, [])
    with pytest.raises(InvalidRequest, match="NUL"):
        program(LANGUAGES["python"], "a\0b", {}, [])
    for bad in ("", "a\0b", ".", "/tmp/sandbox_fusion/"):
        with pytest.raises(InvalidRequest):
            check_path(bad, "file")


def test_a_compiled_language_ends_its_setup_in_the_compiler_and_names_the_program_beside_the_code():
    """The first exec of a cpp run writes the files and the code, then is the compiler (its status
    and output are the compile result); the program it makes is the second exec, by absolute path,
    named after the (random) code file, so no request file can stand in for it."""
    prog = program(language("cpp"), "int main(){}", {"corral_sf_bin": b64(b"x")}, ["ignored"])
    last = prog.argv[2].strip().splitlines()[-1]
    out = binary(prog.code_file)
    assert prog.code_file.endswith(".cpp") and out == "/tmp/sandbox_fusion/" + prog.code_file[:-4]
    assert last == f"exec g++ -std=c++17 -O2 -pipe -o {out} {prog.code_file} -lm -lpthread"
    assert "ignored" not in prog.argv[2]
    assert language("rust").compiler and language("nodejs").compiler == "" and language("nodejs").toolchain
    assert not language("python").toolchain
