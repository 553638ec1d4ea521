"""The substrate interface (substrates/base.py) is what the node-agent may ask of any substrate
and read of any sandbox.

Why: the agent used to probe substrates and sandboxes with hasattr/getattr for what some of them
had (a seccomp listener, a notify fd to take back, their own snapshots, a root, masks, a cgroup,
a warm-pool id). A probe is an interface nobody wrote down: a substrate that renames the
attribute silently loses the feature (no file audit, no seccomp audit after a restart) and nothing
fails. So the interface names each of them with a default, and a probe in the node-agent fails
here. The substrate modules also stay small enough to read (~600 lines at most)."""
from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest

from corral_common.contract.errors import Code, CorralError
from corral_common.contract.messages import SandboxInfo, SandboxSpec
from corral_node_agent.substrates import REGISTRY
from corral_node_agent.substrates.base import Sandbox, Substrate
from corral_node_agent.substrates.container import ContainerSubstrate
from corral_node_agent.substrates.docker import DockerSubstrate
from corral_node_agent.substrates.function import FunctionSubstrate
from corral_node_agent.substrates.gvisor import GvisorSubstrate
from corral_node_agent.substrates.microvm import MicrovmSubstrate
from corral_node_agent.substrates.vm import VmSubstrate

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "services/node-agent/corral_node_agent"
SUBSTRATES = AGENT / "substrates"
#: names the node-agent's code gives substrates and sandboxes
HOLDERS = {"sub", "substrate", "sb", "sandbox", "self.substrates", "slot"}
MAX_LINES = 600


def probes(tree: ast.AST) -> list[str]:
    """hasattr/getattr calls on a substrate or sandbox, by the name the code gives it."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and ast.unparse(node.args[0]) in HOLDERS):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scanner_finds_a_probe():
    assert probes(ast.parse('if hasattr(sub, "seccomp_listener"):\n    x = getattr(sb, "rootfs", None)\n')) == [
        '1: hasattr(sub, \'seccomp_listener\')', "2: getattr(sb, 'rootfs', None)"]


def test_the_node_agent_does_not_probe_substrates_or_sandboxes():
    found = {str(p.relative_to(ROOT)): hits for p in sorted(AGENT.rglob("*.py")) if (hits := probes(ast.parse(p.read_text())))}
    assert found == {}, "use (or add) a method or attribute of substrates/base.py instead of probing"


def test_service_modules_stay_small():
    """No module in services/ above ~600 lines (issue 14): a room a newcomer can read in one sitting."""
    big = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "services").rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_one_registry_entry_per_substrate_class():
    assert REGISTRY == {"container": ContainerSubstrate, "function": FunctionSubstrate, "docker": DockerSubstrate,
                        "gvisor": GvisorSubstrate, "microvm": MicrovmSubstrate, "vm": VmSubstrate}
    assert all(issubclass(cls, Substrate) and cls.name == name for name, cls in REGISTRY.items())


def test_what_each_substrate_offers():
    # the function substrate's warm sandboxes are container sandboxes: their denied calls are notified too
    # gvisor: the Sentry filters its own calls, nothing reaches the host's seccomp notify; microvm, vm:
    # the guest's kernel serves its calls
    assert {name: cls.supports_seccomp_notify for name, cls in REGISTRY.items()} == {
        "container": True, "function": True, "docker": False, "gvisor": False, "microvm": False, "vm": False}
    assert {name: cls.snapshots_itself for name, cls in REGISTRY.items()} == {
        "container": False, "function": False, "docker": True, "gvisor": False, "microvm": False, "vm": False}
    assert {name: cls.protects_paths for name, cls in REGISTRY.items()} == {
        "container": True, "function": True, "docker": False, "gvisor": True, "microvm": True, "vm": True}
    # in a guest, its own kernel guards them (corral-guest guard), not the node's fanotify group
    assert {name for name, cls in REGISTRY.items() if cls.guards_paths} == {"microvm", "vm"}


def _sandbox() -> Sandbox:
    now = time.time()
    return Sandbox(SandboxInfo(id="sb-000000000001", node="n", state="running", substrate="docker", image="busybox",
                               created_at=now, expires_at=now + 60), SandboxSpec(image="busybox"))


def test_a_sandbox_has_nothing_of_its_own_unless_its_substrate_sets_it():
    sb = _sandbox()
    assert (sb.rootfs, sb.cg, list(sb.masks), sb.warm_id, sb.paused) == (None, None, [], "", False)


def test_the_defaults_answer_without_a_substrate_specific_attribute(tmp_path):
    docker = DockerSubstrate("n", str(tmp_path), None)  # type: ignore[arg-type]  # (no layer mounts needed)
    container = ContainerSubstrate("n", str(tmp_path), None)  # type: ignore[arg-type]
    sb = _sandbox()
    assert docker.take_notify_fd(sb) is None
    assert container.limit_counters(sb) is None  # no cgroup of ours to read
    assert container.audit_root(sb) is None
    with pytest.raises(CorralError) as e:
        asyncio.run(container.snapshot_image(sb, "snap", {}))
    assert e.value.code == Code.INVALID_REQUEST and "container" in e.value.message
