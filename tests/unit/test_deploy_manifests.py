"""deploy/: the Kubernetes manifests validate strictly against the Kubernetes API schemas (bundled
with kubernetes-validate, so no network), and both the manifests and the compose file carry what
running corral needs: a NATS cluster of 3 with 8 MB payloads, an image loader beside every
node-agent with the same node id, metrics on 0.0.0.0 with probes, pinned images, resources and
disruption budgets."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
# the oldest Kubernetes the manifests are meant for, and the newest schema the package bundles
K8S_VERSIONS = ["1.29", kubernetes_validate.latest_version()]
CORRAL_IMAGE = "corral"
CORRAL_VERSION = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]  # the image tag


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in _manifest_files():
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.relative_to(K8S)}#{i}", doc))
    return out


def _find(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in _objects() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"])
            for _, doc in _objects() if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def _is_corral(container: dict[str, Any]) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == CORRAL_IMAGE


def _env(container: dict[str, Any]) -> dict[str, Any]:
    """A container's environment: its ConfigMaps (envFrom) overlaid by its own `env` (values, or the
    valueFrom of the ones taken from the pod or a Secret)."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_find("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def _image_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schema(version: str) -> None:
    objects = _objects()
    assert len(objects) >= 15
    for where, doc in objects:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} ({doc.get('kind')} {doc.get('metadata', {}).get('name')}) is not a valid Kubernetes {version} object: {e}")


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The check above would catch a misspelt field: strict schemas forbid unknown properties."""
    doc = _find("Deployment", "scheduler")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = bad["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest_and_pins_the_image() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(str(p.relative_to(K8S)) for p in _manifest_files())
    assert kust["namespace"] == "corral"
    assert {"name": CORRAL_IMAGE, "newTag": CORRAL_VERSION} in kust["images"]
    assert not (K8S / "later").exists()


def test_node_agent_has_an_image_loader_with_the_same_node_id() -> None:
    ds = _find("DaemonSet", "node-agent")
    spec = ds["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in spec["containers"]}
    agent, loader = by_name["node-agent"], by_name["image-loader"]
    node_source = {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert _env(agent)["CORRAL_NODE"] == node_source
    assert _env(loader)["CORRAL_NODE"] == node_source
    cmd = " ".join(loader.get("command", []) + loader.get("args", []))
    assert "image-loader" in cmd and "--node" in cmd and "CORRAL_NODE" in cmd
    assert "--mount /var/lib/corral/fuse" in cmd and "--cache-dir /var/lib/corral/cache" in cmd
    # the loader's FUSE mount reaches the node-agent through the shared hostPath volume
    volumes = {v["name"]: v for v in spec["volumes"]}
    agent_mounts = {m["name"]: m for m in agent["volumeMounts"]}
    loader_mounts = {m["name"]: m for m in loader["volumeMounts"]}
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/corral"
    assert loader_mounts["state"]["mountPath"] == agent_mounts["state"]["mountPath"] == "/var/lib/corral"
    assert loader_mounts["state"]["mountPropagation"] == "Bidirectional"
    assert agent_mounts["state"]["mountPropagation"] in ("HostToContainer", "Bidirectional")
    assert loader["securityContext"]["privileged"] is True and agent["securityContext"]["privileged"] is True
    assert volumes["fuse"]["hostPath"]["path"] == "/dev/fuse" and "fuse" in loader_mounts and "fuse" in agent_mounts
    assert volumes["cgroup"]["hostPath"]["path"] == "/sys/fs/cgroup" and "cgroup" in agent_mounts


def test_node_id_sanitising_matches_the_node_agent() -> None:
    """The node-agent lower-cases its node id and replaces anything outside [a-z0-9-]; the loader
    takes --node as given, so its shell command must produce the same id from a node name with
    dots (EKS: ip-10-0-1-2.ec2.internal)."""
    if not shutil.which("sh"):
        pytest.skip("no sh")
    loader = next(c for c in _find("DaemonSet", "node-agent")["spec"]["template"]["spec"]["containers"] if c["name"] == "image-loader")
    with tempfile.TemporaryDirectory() as bin_dir:
        fake = Path(bin_dir) / "corral"
        fake.write_text('#!/bin/sh\necho "$@"\n')
        fake.chmod(0o755)
        node = "ip-10-0-1-2.EC2.internal"
        out = subprocess.run(loader["command"] + loader["args"], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CORRAL_NODE": node},
                             capture_output=True, text=True, check=True).stdout.split()
    assert out[out.index("--node") + 1] == re.sub(r"[^a-z0-9-]", "-", node.lower()) == "ip-10-0-1-2-ec2-internal"


def test_every_corral_container_serves_metrics_for_its_probes() -> None:
    seen = 0
    for where, spec in _pod_specs():
        for c in _containers(spec):
            if not _is_corral(c):
                continue
            seen += 1
            env = _env(c)
            assert env.get("CORRAL_METRICS_HOST") == "0.0.0.0", f"{where}/{c['name']}: metrics only on 127.0.0.1"
            assert env.get("CORRAL_JS_REPLICAS") == "3", f"{where}/{c['name']}: streams not replicated on the NATS cluster"
            assert len(env.get("CORRAL_NATS_URL", "").split(",")) == 3, f"{where}/{c['name']}: not given the three NATS servers"
            port = int(env["CORRAL_METRICS_PORT"])
            assert port in {p["containerPort"] for p in c["ports"]}, f"{where}/{c['name']}: metrics port {port} not declared"
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{where}/{c['name']}: no {probe}"
                get = c[probe]["httpGet"]
                assert get["path"] == "/metrics" and named.get(get["port"], get["port"]) == port, f"{where}/{c['name']}: {probe} not on the metrics port"
    assert seen == 6  # scheduler, node-agent, image-loader, image-cache, monitor, env-builder
    monitor = next(c for c in _find("Deployment", "monitor")["spec"]["template"]["spec"]["containers"])
    assert _env(monitor)["CORRAL_CLICKHOUSE"] == {"secretKeyRef": {"name": "corral-clickhouse", "key": "CORRAL_CLICKHOUSE"}}
    assert _find("Secret", "corral-clickhouse")["stringData"]["CORRAL_CLICKHOUSE"].startswith("http://")


def test_every_container_has_a_pinned_image_and_resource_requests() -> None:
    for where, spec in _pod_specs():
        for c in _containers(spec):
            assert _image_pinned(c["image"]), f"{where}/{c['name']}: image {c['image']} is not pinned"
            if _is_corral(c):
                assert c["image"] == f"{CORRAL_IMAGE}:{CORRAL_VERSION}"
            requests = c.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, f"{where}/{c['name']}: no resource requests"
            assert "readinessProbe" in c, f"{where}/{c['name']}: no readinessProbe"


def test_nats_is_a_cluster_of_three_with_8mb_payloads() -> None:
    sts = _find("StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "nats-headless"
    assert _find("Service", "nats-headless")["spec"]["clusterIP"] == "None"
    conf = _find("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert re.search(r"^\s*max_payload:\s*8MB\s*$", conf, re.M)
    assert re.search(r"^\s*server_name:\s*\$POD_NAME\s*$", conf, re.M)
    assert re.search(r"^\s*jetstream\s*\{[^}]*store_dir:", conf, re.M)
    # the routes and the authorization: `corral deploy-auth --k8s`'s Secret, included
    assert re.search(r'^\s*include "auth/accounts.conf"\s*$', conf, re.M)
    assert re.search(r'^\s*include "auth/cluster.conf"\s*$', conf, re.M)
    nats = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "nats")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in nats["volumeMounts"] if m["mountPath"] == "/etc/nats/auth")
    assert volumes[mount["name"]]["secret"]["secretName"] == "corral-nats-auth"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in nats["env"]
    assert "/etc/nats/nats.conf" in nats["command"] + nats.get("args", [])


def test_every_corral_container_authenticates_as_itself(tmp_path) -> None:
    """Each corral container mounts the Secret of its own identity where CORRAL_NATS_CREDS points,
    and `corral deploy-auth --k8s` makes exactly those Secrets (and the servers' one)."""
    from corral_sdk import deployauth

    assert _find("ConfigMap", "corral-config")["data"]["CORRAL_NATS_CREDS"] == "/etc/corral/nats/creds"
    mounted = set()
    for _, doc in _objects():
        if doc["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if c["image"].split(":")[0] != CORRAL_IMAGE:
                continue
            identity = c["name"]
            mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == "/etc/corral/nats"), None)
            assert mount is not None, f"{identity} mounts no bus credentials"
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == f"corral-nats-creds-{identity}" and not secret.get("optional"), (identity, secret)
            mounted.add(secret["secretName"])
    assert mounted == {f"corral-nats-creds-{i}" for i in ("scheduler", "node-agent", "image-loader", "image-cache",
                                                            "monitor", "env-builder")}
    # the catalog's identity: the env-builder's second, mounted by it alone
    catalog = [(doc["metadata"]["name"], v) for _, doc in _objects() if doc["kind"] == "Deployment"
               for v in doc["spec"]["template"]["spec"].get("volumes", [])
               if v.get("secret", {}).get("secretName") == "corral-nats-creds-env-catalog"]
    assert [name for name, _ in catalog] == ["env-builder"], catalog
    builder = _find("Deployment", "env-builder")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "CORRAL_CATALOG_CREDS", "value": "/etc/corral/catalog/creds"} in builder["env"]
    assert any(m["mountPath"] == "/etc/corral/catalog" and m["name"] == catalog[0][1]["name"] for m in builder["volumeMounts"])
    deployauth.render(str(tmp_path), routes=[f"nats-{i}.nats-headless:6222" for i in range(3)], k8s=True)
    made = {s["metadata"]["name"] for s in json.loads((tmp_path / "secrets.json").read_text())["items"]}
    assert mounted | {"corral-nats-auth", "corral-nats-creds-env-catalog"} <= made


def test_disruption_budgets_cover_scheduler_and_nats() -> None:
    pdbs = [doc for _, doc in _objects() if doc["kind"] == "PodDisruptionBudget"]
    labels = {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: p["spec"] for p in pdbs}
    assert labels["nats"].get("maxUnavailable") == 1
    assert "scheduler" in labels
    assert _find("Deployment", "scheduler")["spec"]["replicas"] == 2


# ---- docker compose -------------------------------------------------------------------------

def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else list(cmd)


def _flag(cmd: list[str], flag: str) -> str:
    assert flag in cmd, f"{flag} missing from {cmd}"
    return cmd[cmd.index(flag) + 1]


def test_compose_stack() -> None:
    services = _compose()["services"]
    nats = {name: s for name, s in services.items() if re.fullmatch(r"nats-\d", name)}
    assert sorted(nats) == ["nats-1", "nats-2", "nats-3"]
    conf_text = (DEPLOY / "nats" / "nats.conf").read_text()
    assert re.search(r"^max_payload:\s*8MB\s*$", conf_text, re.M)
    # authorization and the (authenticated) routes come from `corral deploy-auth` (the auth service)
    assert re.search(r'^include "auth/accounts.conf"$', conf_text, re.M)
    assert re.search(r'^include "auth/cluster.conf"$', conf_text, re.M)
    auth = services["auth"]
    cmd = _command(auth)
    assert cmd[:2] == ["deploy-auth", "/auth"] and "corral-auth:/auth" in auth["volumes"]
    assert sorted(cmd[i + 1].split(":")[0] for i, a in enumerate(cmd) if a == "--route") == sorted(nats)
    for name, s in nats.items():
        assert s["environment"]["NATS_SERVER_NAME"] == name
        assert any(str(v).startswith("./nats/nats.conf:") for v in s["volumes"])
        assert any(str(v).startswith("corral-auth:/etc/nats/auth") for v in s["volumes"])
        assert s["depends_on"]["auth"]["condition"] == "service_completed_successfully"
        assert "--config" in _command(s)

    corral = {name: s for name, s in services.items()
              if s.get("image", "").split(":")[0] == CORRAL_IMAGE and name != "auth"}
    assert sorted(corral) == ["env-builder", "image-cache", "image-loader", "monitor", "node-agent", "scheduler"]
    for name, s in corral.items():  # each service authenticates as itself, with its own seed
        assert s["environment"]["CORRAL_NATS_CREDS"] == f"/etc/corral/auth/{name}.nk", name
        assert "corral-auth:/etc/corral/auth:ro" in s["volumes"], name
        assert ("CORRAL_CATALOG_CREDS" in s["environment"]) == (name == "env-builder"), name
    assert corral["env-builder"]["environment"]["CORRAL_CATALOG_CREDS"] == "/etc/corral/auth/env-catalog.nk"
    assert corral["scheduler"]["deploy"]["replicas"] == 2
    for name, s in corral.items():
        env = s["environment"]
        assert env["CORRAL_METRICS_HOST"] == "0.0.0.0", name
        assert env["CORRAL_JS_REPLICAS"] == "3", name
        assert sorted(env["CORRAL_NATS_URL"].split(",")) == [f"nats://{n}:4222" for n in sorted(nats)], name
        assert env.get("CORRAL_METRICS_PORT"), name
        assert _command(s)[0] == name, name

    agent, loader = corral["node-agent"], corral["image-loader"]
    assert _flag(_command(agent), "--node") == _flag(_command(loader), "--node")
    assert loader["privileged"] is True and "/dev/fuse:/dev/fuse" in loader["devices"]
    assert "image-loader" in agent["depends_on"]
    state = {name: next(v for v in s["volumes"] if isinstance(v, dict) and v["target"] == "/var/lib/corral") for name, s in (("agent", agent), ("loader", loader))}
    assert state["agent"]["source"] == state["loader"]["source"]
    assert state["loader"]["bind"]["propagation"] == "rshared"
    assert state["agent"]["bind"]["propagation"] in ("rshared", "rslave")
    assert _flag(_command(loader), "--mount").startswith("/var/lib/corral/")
    assert "CORRAL_CLICKHOUSE" in corral["monitor"]["environment"]

    for name, s in services.items():
        if "image" in s:
            assert _image_pinned(s["image"]), f"{name}: image {s['image']} is not pinned"

    prometheus = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    for name, s in corral.items():
        if name != "scheduler":
            assert f"{name}:{s['environment']['CORRAL_METRICS_PORT']}" in prometheus, f"prometheus does not scrape {name}"


def test_nothing_under_deploy_is_left_for_a_later_issue() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace").lower()
            assert "later issue" not in text, f"{path}: mentions a later issue"
            assert "/work/shared" not in text, f"{path}: points outside the repository"
            assert ":latest" not in text, f"{path}: uses a latest tag"
