"""corral's agent tools, defined once (corral_sdk.integrations.tools): `corral tools --format openai`
prints them as OpenAI function schemas, `corral mcp` lists the same schemas, and a schema accepts
exactly what the tool's Struct accepts."""
from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest
from typer.testing import CliRunner

from corral_sdk.cli import app
from corral_sdk.integrations.mcp_server import mcp_tools
from corral_sdk.integrations.tools import TOOLS, input_schema, openai_tools


def test_cli_prints_the_openai_schemas():
    r = CliRunner().invoke(app, ["tools", "--format", "openai"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out == openai_tools()
    assert [t["function"]["name"] for t in out] == ["sandbox_create", "env_rollout", "exec", "read_file", "write_file", "grade", "destroy"]
    for t in out:
        assert t["type"] == "function" and len(t["function"]["description"]) > 20
        params = t["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert "$ref" not in json.dumps(params) and set(params["required"]) <= set(params["properties"])
        jsonschema.Draft202012Validator.check_schema(params)
    exec_params = out[2]["function"]["parameters"]
    assert exec_params["required"] == ["sandbox_id", "command"] and exec_params["properties"]["shell"]["enum"] == ["bash", "sh"]


def test_mcp_lists_the_same_schemas():
    assert [(t.name, t.description, t.input_schema) for t in mcp_tools()] == \
           [(f["function"]["name"], f["function"]["description"], f["function"]["parameters"]) for f in openai_tools()]
    r = CliRunner().invoke(app, ["tools", "--format", "mcp"])
    assert [t["inputSchema"] for t in json.loads(r.stdout)] == [t.input_schema for t in mcp_tools()]


def test_bad_format_is_refused():
    r = CliRunner().invoke(app, ["tools", "--format", "yaml"])
    assert r.exit_code == 2 and "expected openai or mcp" in r.output


CASES = [  # (tool, arguments): the schema and the Struct must agree on each
    ("exec", {"sandbox_id": "sb-1", "command": "ls"}),
    ("exec", {"sandbox_id": "sb-1", "command": "ls", "session": "a", "shell": "sh", "timeout_s": 5}),
    ("exec", {"sandbox_id": "sb-1"}),
    ("exec", {"sandbox_id": "sb-1", "command": ""}),
    ("exec", {"sandbox_id": "sb-1", "command": "ls", "session": "../x"}),
    ("exec", {"sandbox_id": "sb-1", "command": "ls", "shell": "zsh"}),
    ("exec", {"sandbox_id": "sb-1", "command": "ls", "timeout_s": 0}),
    ("exec", {"sandbox_id": "sb-1", "command": "ls", "extra": 1}),
    ("sandbox_create", {}),
    ("sandbox_create", {"image": "busybox", "cpu": 0.5, "memory_mb": 64, "env": {"A": "b"}}),
    ("sandbox_create", {"memory_mb": 8}),
    ("sandbox_create", {"env": {"A": 1}}),
    ("write_file", {"sandbox_id": "s", "path": "/x", "content": "", "mode": 0o755}),
    ("write_file", {"sandbox_id": "s", "path": "/x", "content": "", "mode": 0o10000}),
    ("write_file", {"sandbox_id": "s", "path": "/x"}),
    ("read_file", {"sandbox_id": "s", "path": "/x", "max_bytes": 0}),
    ("grade", {"sandbox_id": "s", "destroy": True}),
    ("grade", {"sandbox_id": "", "destroy": True}),
    ("env_rollout", {"name": "calc"}),
    ("env_rollout", {"version": "v1"}),
    ("destroy", {"sandbox_id": "s"}),
]


@pytest.mark.parametrize("tool,args", CASES)
def test_schema_and_struct_agree(tool, args):
    t = next(t for t in TOOLS if t.name == tool)
    schema_ok = jsonschema.Draft202012Validator(input_schema(t.args)).is_valid(args)
    try:
        msgspec.convert(args, type=t.args)
        struct_ok = True
    except msgspec.ValidationError:
        struct_ok = False
    assert schema_ok == struct_ok, (tool, args, schema_ok, struct_ok)
