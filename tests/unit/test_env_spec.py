"""EnvSpec validation and the env-builder's per-job admission, without a bus."""
from __future__ import annotations

import msgspec
import pytest

from corral_common.contract.envs import EnvSpec, spec_digest
from corral_common.contract.errors import Capacity, InvalidRequest
from corral_env_builder.limits import BuildLimits
from corral_env_builder.workspace import patch_targets, scan_script
from corral_sdk.demo_env import demo_spec
from corral_sdk.demo_web import shop_spec


def spec(**kw) -> EnvSpec:
    base = dict(name="e", test_command="true", hidden_files={"t.py": "x"}, solution={"files": {"a.py": "y"}})
    return msgspec.convert({**base, **kw}, type=EnvSpec)


def test_paths_relative_to_workdir_and_no_escape():
    s = spec(workdir="/w")
    assert s.abspath("a/b.py") == "/w/a/b.py" and s.abspath("/etc/x") == "/etc/x" and s.abspath("./a//b") == "/w/a/b"
    for bad in ("../x", "a/../../x", "", "/"):
        with pytest.raises(InvalidRequest):
            s.abspath(bad)


@pytest.mark.parametrize("kw, words", [
    ({"network": True}, "no network"),
    ({"hidden_files": {}}, "hidden tests"),
    ({"solution": {}}, "reference solution"),
    ({"files": {"t.py": "visible"}}, "must not be agent-visible"),
    ({"canaries": {"../x": "c"}}, "canaries"),
    ({"service_state": ["state/db"]}, "no service runs as the harness"),
    ({"service_state": ["state/db"], "services": [{"cmd": "sleep 9", "harness": False}]}, "no service runs as the harness"),
    ({"service_state": ["../db"], "services": [{"cmd": "sleep 9"}]}, "service_state"),
    ({"service_state": ["/w"], "workdir": "/w", "hidden_files": {"/w/t.py": "x"}, "services": [{"cmd": "sleep 9"}]},
     "holds the hidden file"),
])
def test_validate_names_the_problem(kw, words):
    with pytest.raises(InvalidRequest, match=words):
        spec(**kw).validate()


def test_solution_may_replace_a_visible_file():
    spec(files={"a.py": "buggy"}).validate()
    demo_spec().validate()
    shop_spec().validate()


def test_services_are_checked_like_every_field():
    for bad in ({"cmd": ""}, {"cmd": "x", "ready_timeout_s": 0}, {"cmd": "x", "harness": "yes"}, {"command": "x"}):
        with pytest.raises(msgspec.ValidationError):
            spec(services=[bad])
    with pytest.raises(msgspec.ValidationError):
        spec(services=[{"cmd": "x"}] * 9)


def test_spec_digest_ignores_version_only():
    a, b = demo_spec(version="1"), demo_spec(version="2")
    assert spec_digest(a) == spec_digest(b)
    b.description = "other"
    assert spec_digest(a) != spec_digest(b)


def test_limits_per_job_concurrency_rate_and_backlog():
    lim = BuildLimits(per_job_concurrent=2, per_job_per_minute=60, burst=3, max_backlog=4)
    lim.admit("a")
    lim.admit("a")
    with pytest.raises(Capacity, match="already has 2 builds running") as e:
        lim.admit("a")
    assert e.value.retry_after_s
    lim.release("a")
    lim.admit("a")  # third token of the burst
    lim.release("a")
    with pytest.raises(Capacity, match="over its build rate") as e:
        lim.admit("a")
    assert 0 < e.value.retry_after_s <= 1.0
    lim.release("a")
    assert lim.total == 0
    for j in ("b", "b", "c", "c"):
        lim.admit(j)
    with pytest.raises(Capacity, match="in flight"):
        lim.admit("d")
    for j in ("b", "b", "c", "c"):
        lim.release(j)
    assert lim.total == 0 and not lim.running


def test_patch_targets_and_scan_script():
    diff = "--- a/calc/x.py\n+++ b/calc/x.py\n@@ -1 +1 @@\n-a\n+b\n--- a/gone.py\n+++ /dev/null\n"
    assert patch_targets(diff) == ["calc/x.py"]
    s = scan_script({12, 5})
    assert "-size 5c -o -size 12c" in s and "-xdev" in s
