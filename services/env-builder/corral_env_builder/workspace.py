"""What the builder does inside its own sandboxes: put files in, run commands, read hashes.

Files travel as one gzip'd tarball per exec (base64 on stdin, unpacked by the image's `tar`),
because one `files.write` request per file makes a repository of thousands of files slow."""
from __future__ import annotations

import base64
import io
import os
import tarfile
import time

from corral_common.contract.messages import ExecResult
from corral_sdk.client import AsyncSandbox

MAX_TAR_STDIN = 5 * 1024 * 1024  # base64 of one tarball stays under the bus payload limit (8 MB)
TAIL = 4000


def tail(r: ExecResult, limit: int = TAIL) -> str:
    """The end of a command's output, which is where test runners say what failed."""
    out = (r.stdout + ("\n" if r.stdout and r.stderr else "") + r.stderr).strip()
    if len(out) > limit:
        out = "...\n" + out[-limit:]
    note = " (timed out)" if r.timed_out else ""
    return f"exit {r.exit_code}{note}\n{out}".strip()


def _tarballs(files: dict[str, bytes]) -> list[bytes]:
    """Pack absolute path -> content into gzip'd tarballs of bounded size, parents implied."""
    out: list[bytes] = []
    buf, tf, size = None, None, 0
    for path, data in sorted(files.items()):
        if tf is None or size + len(data) > MAX_TAR_STDIN:
            if tf is not None:
                tf.close()
                out.append(buf.getvalue())
            buf = io.BytesIO()
            tf = tarfile.open(fileobj=buf, mode="w:gz")
            size = 0
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size = len(data)
        info.mode = 0o755 if data.startswith(b"#!") else 0o644
        info.mtime = int(time.time())
        tf.addfile(info, io.BytesIO(data))
        size += len(data)
    if tf is not None:
        tf.close()
        out.append(buf.getvalue())
    return out


async def put_files(sb: AsyncSandbox, files: dict[str, bytes], timeout_s: float = 120.0) -> None:
    for blob in _tarballs(files):
        r = await sb.exec(["/bin/sh", "-c", "base64 -d | tar -xzf - -C /"], stdin=base64.b64encode(blob).decode(),
                          timeout_s=timeout_s, cwd="/")
        if r.exit_code != 0:
            raise RuntimeError(f"unpacking files failed: {tail(r)}")


def read_dir(root: str) -> dict[str, bytes]:
    """A host directory as relative path -> content (regular files; symlinks and devices skipped)."""
    out: dict[str, bytes] = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not os.path.islink(os.path.join(d, x))]
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = f.read()
    return out


def scan_script(sizes: set[int]) -> str:
    """A shell script printing `sha256  path` of every regular file on the root filesystem whose
    size equals one of `sizes`: hashing only same-sized files keeps a scan of a whole distro cheap."""
    conds = " -o ".join(f"-size {s}c" for s in sorted(sizes))
    return f"find / -xdev -type f \\( {conds} \\) -exec sha256sum {{}} + 2>/dev/null; true"


def patch_targets(patch: str) -> list[str]:
    """Paths (relative, `b/` stripped) a unified diff writes to."""
    out = []
    for line in patch.splitlines():
        if line.startswith("+++ "):
            p = line[4:].split("\t")[0].strip()
            if p != "/dev/null":
                out.append(p[2:] if p.startswith("b/") else p)
    return out
