"""dockerd for the tests and benchmarks that need Docker: used when `docker info` answers, else
started here in the background (the caller stops what it started)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

DOCKER_SOCK = "unix:///var/run/docker.sock"


def docker_ok() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_dockerd(log_path: str, timeout: float = 90.0, extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen | None, str]:
    """Start dockerd (with `extra_args`) and wait for `docker info`: (the process, "") or (None,
    why). Tries twice (a stale pid file of a dead dockerd is the usual reason for a first failure)."""
    if not shutil.which("dockerd"):
        return None, "dockerd is not installed (apt-get install docker.io)"
    why = ""
    for attempt in range(2):
        if attempt:
            for stale in ("/var/run/docker.pid", "/var/run/docker/containerd/containerd.pid"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        log = open(log_path, "ab")
        p = subprocess.Popen(["dockerd", "--host", DOCKER_SOCK, *extra_args], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if docker_ok():
                return p, ""
            if p.poll() is not None:
                break
            time.sleep(0.5)
        stop_dockerd(p, 20)
        with open(log_path, errors="replace") as f:
            why = f.read()[-1500:]
    return None, f"dockerd did not come up; its log ({log_path}) ends with:\n{why}"


def stop_dockerd(p: subprocess.Popen, timeout: float = 30.0) -> None:
    if p.poll() is None:
        p.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout)
