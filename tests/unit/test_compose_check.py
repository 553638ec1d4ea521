"""deploy/compose_check.py brings the compose file up on this machine after adapting it (no
registry, Compose 1.29): the adaptation changes only what its report says it changes, so what the
check proves holds for the file users run."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _check():
    spec = importlib.util.spec_from_file_location("compose_check", ROOT / "deploy" / "compose_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FULL = (1 << 41) - 1
NO_SYS_RESOURCE = FULL & ~(1 << 24)  # this machine's bounding set


def _adapted(bounding: int = FULL):
    cc = _check()
    original = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    adapted, changed = cc.adapt(original, "/var/lib/corral-compose/x", bounding)
    return cc, original, adapted, changed


def test_every_corral_service_runs_as_the_compose_file_says():
    cc, original, adapted, _ = _adapted()
    kept = set(original["services"]) - set(cc.LEFT_OUT)
    assert set(adapted["services"]) == kept
    for name in kept:
        a, o = adapted["services"][name], original["services"][name]
        for key in ("command", "privileged", "devices", "init", "restart", "healthcheck", "ports", "stop_grace_period"):
            assert a.get(key) == o.get(key), (name, key)
        env_a, env_o = dict(a.get("environment") or {}), dict(o.get("environment") or {})
        if name == "monitor":  # the one deliberate difference: embedded ClickHouse
            assert env_a.pop("CORRAL_CLICKHOUSE") == cc.CHDB_DSN and env_o.pop("CORRAL_CLICKHOUSE").startswith("http://")
        assert env_a == env_o, name
        if o.get("image") == "corral:0.1.0":
            assert a["image"] == "corral:0.1.0"
        else:
            assert a["image"] in cc.LOCAL_IMAGES.values(), name
        deps = o.get("depends_on") or {}
        assert {d for d in deps if d not in cc.LEFT_OUT} == set(a.get("depends_on") or {}), name


def test_only_what_compose_1_29_cannot_read_is_removed_and_each_change_is_reported():
    cc, original, adapted, changed = _adapted()
    assert "name" not in adapted
    for name, svc in adapted["services"].items():
        assert "cgroup" not in svc and "build" not in svc and "deploy" not in svc, name
        for v in svc.get("volumes", []):
            if isinstance(v, dict):
                assert "create_host_path" not in v.get("bind", {}) and v["source"] == "/var/lib/corral-compose/x", name
    # the bind propagation that lets the loader's FUSE mount reach the node-agent stays as it was
    props = {n: [v["bind"]["propagation"] for v in s.get("volumes", []) if isinstance(v, dict)] for n, s in adapted["services"].items()}
    assert props["image-loader"] == ["rshared"] and props["node-agent"] == ["rslave"]
    assert original["services"]["node-agent"].get("cgroup") == "host"
    report = "\n".join(changed)
    for svc in cc.LEFT_OUT:
        assert f"service {svc} left out" in report
    assert "cgroup: host" in report and "CORRAL_CLICKHOUSE" in report and "--scale scheduler=2" in report


def test_privileged_runs_through_a_shim_only_where_the_bounding_set_lacks_a_capability(tmp_path):
    cc, original, adapted, changed = _adapted(NO_SYS_RESOURCE)
    privileged = [n for n, svc in original["services"].items() if svc.get("privileged") and n not in cc.LEFT_OUT]
    assert {"image-cache", "image-loader", "node-agent"} <= set(privileged)
    for name in privileged:
        assert adapted["services"][name]["privileged"] is True
        assert any(line.startswith(f"{name}: privileged, through a runc shim that leaves out SYS_RESOURCE (") for line in changed)
    assert cc.runc_shim(tmp_path, FULL) is None
    shim = cc.runc_shim(tmp_path, NO_SYS_RESOURCE)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    caps = ["CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_MKNOD"]
    (bundle / "config.json").write_text(json.dumps({"process": {"capabilities": {"bounding": caps, "effective": caps}}}))
    shim_text = shim.read_text().replace(repr(shutil.which("runc")), repr("/bin/true"))  # runc itself is not run here
    shim.write_text(shim_text)
    subprocess.run([str(shim), "create", "--bundle", str(bundle), "id"], check=True)
    got = json.loads((bundle / "config.json").read_text())["process"]["capabilities"]
    assert got == {"bounding": ["CAP_SYS_ADMIN", "CAP_MKNOD"], "effective": ["CAP_SYS_ADMIN", "CAP_MKNOD"]}
