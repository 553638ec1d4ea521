"""docs/contract/ is what the code speaks: the committed AsyncAPI document and JSON Schemas equal
what `corral contract` generates now, the AsyncAPI document is valid against the AsyncAPI 3.0.0
JSON Schema (the official one, fetched by scripts/fetch-specs.py in `make setup`), and every
subject of subjects.py is in the operations table."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jsonschema
import msgspec
import pytest
from referencing import Registry, Resource

from corral_common.contract import asyncapi, images, messages, operations, subjects

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "contract")
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _spec_path() -> str:
    import importlib

    fetch = importlib.import_module("fetch-specs")
    path = fetch.spec_path()
    if not os.path.exists(path):  # `make setup` fetches it; a bare pytest run fetches it here
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fetch-specs.py")], check=True, capture_output=True)
    return path


def test_committed_documents_are_current():
    r = subprocess.run([sys.executable, "-m", "corral_sdk.cli", "contract", "--out", DOCS, "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_notices_a_stale_document(tmp_path):
    out = tmp_path / "contract"
    r = subprocess.run([sys.executable, "-m", "corral_sdk.cli", "contract", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (out / "schemas" / "SandboxSpec.json").write_text("{}\n")
    (out / "schemas" / "Gone.json").write_text("{}\n")
    r = subprocess.run([sys.executable, "-m", "corral_sdk.cli", "contract", "--out", str(out), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "SandboxSpec.json" in r.stderr and "Gone.json" in r.stderr, r.stderr


def test_asyncapi_document_is_valid_asyncapi_3():
    with open(_spec_path()) as f:
        spec = json.load(f)
    validator = jsonschema.Draft7Validator(spec)
    doc = asyncapi.document()
    errors = [f"{list(e.path)}: {e.message[:200]}" for e in validator.iter_errors(doc)]
    assert not errors, errors[:5]
    # the validator is not vacuous: a document that breaks the spec in three ways is refused
    bad = copy.deepcopy(doc)
    bad["asyncapi"] = "2.6.0"
    bad["operations"]["sandboxCreate"]["action"] = "publish"
    bad["channels"]["sandboxCreate"]["address"] = 7
    assert len(list(validator.iter_errors(bad))) >= 3


def test_every_subject_has_its_types():
    names = {o.subject for o in operations.OPERATIONS}
    request_subjects = [v for k, v in vars(subjects).items()
                        if k.isupper() and isinstance(v, str) and v.startswith(subjects.PREFIX + ".")]
    assert len(request_subjects) >= 20
    missing = [s for s in request_subjects if s not in names]
    assert not missing, f"subjects without an Operation in contract/operations.py: {missing}"
    ops = {o.subject.split("{sandbox_id}.", 1)[1] for o in operations.OPERATIONS
           if "{sandbox_id}" in o.subject and o.service == "node-agent"}
    assert set(subjects.SANDBOX_OPS) <= ops, set(subjects.SANDBOX_OPS) - ops
    buckets = {b.name for b in operations.BUCKETS}
    kv_names = [v for k, v in [*vars(subjects).items(), *vars(images).items()] if k.startswith("KV_") and isinstance(v, str)]
    assert set(kv_names) <= buckets, set(kv_names) - buckets
    streams = {c.stream for c in operations.CHANNELS}
    assert set(subjects.STREAMS) - {subjects.DEADLETTER_STREAM} <= streams


def test_operation_names_are_unique():
    names = [o.name for o in operations.OPERATIONS] + [c.name for c in operations.CHANNELS]
    assert len(names) == len(set(names))


def _validator(name: str) -> jsonschema.protocols.Validator:
    """The committed standalone schema of `name`, its sibling files resolvable by name."""
    resources = []
    for fn in os.listdir(os.path.join(DOCS, "schemas")):
        with open(os.path.join(DOCS, "schemas", fn)) as f:
            resources.append((fn, Resource.from_contents(json.load(f))))
    registry = Registry().with_resources(resources)
    with open(os.path.join(DOCS, "schemas", f"{name}.json")) as f:
        schema = json.load(f)
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("name,good,bad", [
    ("SandboxSpec", {"image": "debian", "cpu": 0.5}, {"cpu": 0}),
    ("SandboxSpec", {}, {"memroy_mb": 64}),
    ("ExecRequest", {"cmd": ["ls", "-l"], "timeout_s": 5}, {"cmd": []}),
    ("CreateBatchRequest", {"spec": {}, "count": 3}, {"spec": {}, "count": 0}),
    ("ExecReply", {"ok": True, "result": {"exit_code": 0}}, {"ok": True}),
])
def test_json_schemas_carry_the_constraints(name, good, bad):
    """A client generated from the schemas refuses what the services refuse."""
    v = _validator(name)
    assert not list(v.iter_errors(good))
    assert list(v.iter_errors(bad))


def test_a_message_the_code_encodes_validates_against_its_schema():
    spec = messages.SandboxSpec(image="debian", labels={"a": "b"}, canaries={"/x": "y"})
    assert not list(_validator("SandboxSpec").iter_errors(json.loads(msgspec.json.encode(spec))))
