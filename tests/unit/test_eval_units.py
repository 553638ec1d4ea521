"""The host-side parts of corral eval, the Gymnasium wrapper and the SWE-bench import that need no
stack: policy loading, text in Gymnasium's Text space, environment names, instance checks."""
from __future__ import annotations

import json
import subprocess

import pytest

from corral_common.contract.errors import InvalidRequest
from corral_sdk.eval import load_policy, pct
from corral_sdk.integrations.gym import CHARSET, REPLACEMENT, observation_space, to_text
from corral_sdk.swebench_import import SwebenchInstance, env_name, patch_paths, read_instances, swebench_fields


def test_load_policy_errors():
    assert load_policy("tests.integration.eval_policies:fix").name == "fix"
    for ref, why in (("x", "module:function"), ("tests.integration.eval_policies:not_async", "async function"),
                     ("tests.integration.eval_policies:missing", "no attribute")):
        with pytest.raises(InvalidRequest, match=why):
            load_policy(ref)


def test_pct():
    assert pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0], 99) == 1.0


def test_text_fits_the_space():
    s = to_text("héllo\x00\n" + "x" * 50, 20)
    assert len(s) == 20 and s.endswith("x" * 20)
    full = to_text("héllo\x00\n", 100)
    assert full == f"h{REPLACEMENT}llo{REPLACEMENT}\n" and set(full) <= CHARSET
    space = observation_space(100)
    import numpy as np

    assert space.contains({"task": full, "stdout": "", "stderr": "", "exit_code": np.asarray(3, dtype=np.int64)})


def test_env_names():
    assert env_name("astropy__astropy-12907") == "astropy-astropy-12907"
    assert env_name("Django__Django-1", prefix="swe-") == "swe-django-django-1"
    assert len(env_name("a" * 100)) == 63
    with pytest.raises(InvalidRequest):
        env_name("__")


def test_schema_is_swebenchs():
    ours = set(SwebenchInstance.__struct_fields__)
    assert swebench_fields() <= ours  # every field SWE-bench defines is read, under its own name


def test_patch_paths():
    diff = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n"
    assert patch_paths(diff, "patch") == (["x.py"], ["old.py"])
    with pytest.raises(InvalidRequest, match="changes no file"):
        patch_paths("hello\n", "patch")


def test_instance_errors_per_line(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    good = {"instance_id": "a__b-1", "repo": "a/b", "base_commit": "abcd", "patch": "p", "test_patch": "t",
            "FAIL_TO_PASS": "[]", "PASS_TO_PASS": []}
    lines = ["[1, 2]", json.dumps({"instance_id": "x"}), json.dumps(good), json.dumps(good | {"FAIL_TO_PASS": "[nope"}),
             json.dumps(good | {"FAIL_TO_PASS": ["t1"], "base_commit": "zz"}), "",
             json.dumps(good | {"FAIL_TO_PASS": ["t1"]})]
    out = read_instances(lines, str(repo))
    errs = [o.error for o in out]
    assert [o.line for o in out] == [1, 2, 3, 4, 5, 7] and all(o.spec is None for o in out)
    assert errs[0] == "an instance must be a JSON object"
    assert errs[1].startswith("missing required SWE-bench field(s): FAIL_TO_PASS, PASS_TO_PASS, base_commit, patch")
    assert "FAIL_TO_PASS is empty" in errs[2] and "neither a list nor JSON" in errs[3]
    assert "$.base_commit" in errs[4] and "matching regex" in errs[4]
    assert "base_commit abcd is not a commit" in errs[5]
