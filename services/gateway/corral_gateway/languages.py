"""Which SandboxFusion languages a corral image can run, and the one shell command that runs one.

A run is a single exec in a fresh sandbox: a short `/bin/sh` script writes the request's files
and the code into the run's directory, then `exec`s the interpreter, so the program's exit status,
signal and output are the exec's own. The code and the files travel in the exec's environment
(not its argv or stdin: stdin is the program's), each variable at most 120 KiB because
Linux caps one argument or environment string at 128 KiB (MAX_ARG_STRLEN), and all of them
together at most `MAX_PAYLOAD` (the whole of argv + environment is capped by ARG_MAX, a quarter of
the stack limit: 2 MiB by default). The script unsets them before the program starts.

Languages beyond python, pytest and bash run in the gateway's toolchain image (the built-in
`toolchain`: debian with g++, rustc and Node.js). A compiled language's run is two execs in one
sandbox: the setup script ending in the compiler (its result is SandboxFusion's `compile_result`,
under `compile_timeout`), then the binary (`run_result`, under `run_timeout`), so a program can
never write into its compile result. Other languages are answered with a clear error naming the
ones that run."""
from __future__ import annotations

import posixpath
import secrets
import shlex
from dataclasses import dataclass

from corral_common.contract.errors import InvalidRequest

WORKDIR = "/tmp/sandbox_fusion"  # the run's directory: relative file paths and fetch_files resolve against it
B64_CHUNK = 96 * 1024  # base64 is ASCII: one byte a character
CODE_CHUNK = 30 * 1024  # code is any UTF-8: up to four bytes a character
MAX_PAYLOAD = 1536 * 1024
ENV_PREFIX = "CORRAL_SF_"


class PayloadTooLarge(InvalidRequest):
    """Code plus files larger than one exec can carry (HTTP 413)."""


@dataclass(frozen=True)
class Language:
    name: str
    suffix: str
    runner: str = ""  # shell words before the code file (interpreted languages)
    takes_args: bool = False  # SandboxFusion passes `args` to pytest only
    # compiled languages: the compiler's command, `{src}` the code file and `{bin}` the program
    compiler: str = ""
    toolchain: bool = False  # runs in the gateway's toolchain image, not its base image

    def command(self, code_file: str, args: list[str]) -> str:
        """The last line of the setup script: the interpreter, or (compiled) the compiler."""
        if self.compiler:
            return "exec " + self.compiler.format(src=shlex.quote(code_file), bin=shlex.quote(binary(code_file)))
        extra = " ".join(shlex.quote(a) for a in args) if self.takes_args else ""
        return f"exec {self.runner} {shlex.quote(code_file)} {extra}".rstrip()


LANGUAGES: dict[str, Language] = {
    # the built-in `debian` image (python3, python3-pytest, bash), as SandboxFusion runs them
    "python": Language("python", ".py", "python3"),
    "pytest": Language("pytest", ".py", "python3 -m pytest", takes_args=True),
    "bash": Language("bash", ".sh", "bash"),
    # the built-in `toolchain` image (Debian's g++ 12, rustc 1.63, Node.js 18)
    "cpp": Language("cpp", ".cpp", compiler="g++ -std=c++17 -O2 -pipe -o {bin} {src} -lm -lpthread", toolchain=True),
    "rust": Language("rust", ".rs", compiler="rustc -O --edition 2021 -o {bin} {src}", toolchain=True),
    "nodejs": Language("nodejs", ".js", "node", toolchain=True),
}


def binary(code_file: str) -> str:
    """Where a compiled program goes: beside its code file, named like it (so, like it, never a
    request file's name)."""
    return posixpath.join(WORKDIR, posixpath.splitext(code_file)[0])


def language(name: str) -> Language:
    lang = LANGUAGES.get(name)
    if lang is None:
        raise InvalidRequest(f"language {name!r} is not supported by this gateway (its images have no toolchain for it); "
                             f"supported: {', '.join(sorted(LANGUAGES))}")
    return lang


@dataclass
class Program:
    """One run's exec: argv (`/bin/sh -c SCRIPT`) and the environment carrying code and files."""

    argv: list[str]
    env: dict[str, str]
    code_file: str


def _chunks(name: str, text: str, env: dict[str, str], size: int) -> str:
    """Store `text` in env vars `name_0..n`; returns the shell words that expand to them in order."""
    words = []
    for j in range(0, max(len(text), 1), size):
        var = f"{name}_{j // size}"
        env[var] = text[j:j + size]
        words.append(f'"${var}"')
    return " ".join(words)


def check_path(path: str, what: str) -> str:
    if not path or "\0" in path or len(path) > 4096:
        raise InvalidRequest(f"{what} {path!r}: a path must be 1 to 4096 characters without NUL")
    if posixpath.normpath(posixpath.join(WORKDIR, path)) in ("/", WORKDIR):
        raise InvalidRequest(f"{what} {path!r} names a directory, not a file")
    return path


def program(lang: Language, code: str, files: dict[str, str], args: list[str]) -> Program:
    """`files`: path -> base64 content, already validated. Paths resolve as SandboxFusion resolves
    them: relative to the run's directory, absolute ones as given."""
    if "\0" in code:
        raise InvalidRequest("code must not contain NUL characters")
    env: dict[str, str] = {}
    lines = ["set -e"]
    made: set[str] = set()
    for i, (path, b64) in enumerate(files.items()):
        parent = posixpath.dirname(path)  # relative to the run's directory (the exec's cwd), or absolute
        if parent not in ("", "/") and parent not in made:
            lines.append(f"mkdir -p -- {shlex.quote(parent)}")
            made.add(parent)
        words = _chunks(f"{ENV_PREFIX}F{i}", b64, env, B64_CHUNK)
        lines.append(f"printf %s {words} | base64 -d > {shlex.quote(path)}")
    # a name of its own, like SandboxFusion's temporary file, so a request file never collides with it
    code_file = f"tmp{secrets.token_hex(4)}{lang.suffix}"
    words = _chunks(f"{ENV_PREFIX}CODE", code, env, CODE_CHUNK)
    lines.append(f"printf %s {words} > {code_file}")
    lines.append("unset " + " ".join(sorted(env)))
    lines.append(lang.command(code_file, args))
    script = "\n".join(lines) + "\n"
    size = len(script.encode()) + sum(len(k) + len(v.encode()) + 2 for k, v in env.items())
    if size > MAX_PAYLOAD:
        raise PayloadTooLarge(f"code and files take {size} bytes once encoded; one run carries at most {MAX_PAYLOAD} "
                              "(the sandbox's exec argument limit): send smaller files")
    return Program(argv=["/bin/sh", "-c", script], env=env, code_file=code_file)
