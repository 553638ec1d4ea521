"""Every service's metrics address comes from CORRAL_METRICS_HOST when no flag says otherwise, so
deploy files can make them reachable (0.0.0.0) without repeating flags."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SERVICES = ["corral_scheduler", "corral_node_agent", "corral_image_cache", "corral_image_cache.loader", "corral_monitor",
            "corral_env_builder"]


@pytest.mark.parametrize("module", SERVICES)
def test_metrics_host_reads_the_environment(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "300", "CORRAL_METRICS_HOST": "0.0.0.0"})
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "--metrics-host" in ln)
    assert "CORRAL_METRICS_HOST" in line and "0.0.0.0" in line, line


def test_a_node_id_is_spelled_alike_by_its_node_agent_and_its_loader(monkeypatch):
    """Both take config.node_id (their __main__): a Kubernetes node name with dots (EKS) becomes one subject token,
    the same for the loader as for its node-agent, which would otherwise never find each other."""
    from corral_common import config

    assert config.node_id("ip-10-0-1-2.ec2.internal") == "ip-10-0-1-2-ec2-internal"
    monkeypatch.setenv("CORRAL_NODE", "Node_7")
    assert config.node_id() == "node-7" == config.node_id(None)


def test_a_process_given_port_0_says_which_port_it_got(tmp_path, monkeypatch):
    """The embedded stack lets each service pick its own metrics port (ports it picked ahead for
    them collided now and then) and reads the URL from the file the service writes."""
    import urllib.request

    from corral_common import metrics

    path = tmp_path / "x.metrics-url"
    monkeypatch.setenv(metrics.URL_FILE_ENV, str(path))
    url = metrics.serve("127.0.0.1", 0)
    assert path.read_text().strip() == url and not url.endswith(":0/metrics")
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
    assert not list(tmp_path.glob("*.tmp"))
