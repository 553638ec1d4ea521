"""`corral mcp` with the official `mcp` client against a real stack: over stdio (the client spawns
`python -m corral_sdk.cli mcp`, as Claude Desktop or an agent framework would) an agent takes a
rollout of an environment, works in it and is graded; tool errors come back as isError results
with corral's code; a sandbox the model forgot is destroyed when the client goes away; and one
round trip over streamable HTTP."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest
import pytest_asyncio
from mcp import Client, StdioServerParameters

from corral_sdk.demo_env import STATS_FIXED, demo_spec
from corral_sdk.integrations import mcp_server
from corral_sdk.integrations.tools import TOOLS, Toolbox, input_schema

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(client):
    res = await client.envs.build(demo_spec("mcp-calc"), job="mcp-tests")
    assert res.accepted, res.report.summary()
    yield res.env
    await client.envs.delete("mcp-calc", res.env.version)


def stdio_server(stack) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "corral_sdk.cli", "mcp", "--nats", stack.url], env=dict(os.environ))


def ok(result) -> dict:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def failed(result, code: str) -> str:
    assert result.is_error, result
    assert result.structured_content["error"]["code"] == code, result.structured_content
    text = result.content[0].text
    assert text.startswith(f"error {code}: ") and result.structured_content["error"]["message"] in text
    return text


async def test_an_agent_over_stdio_rolls_out_works_and_is_graded(stack, client, env):
    async with Client(stdio_server(stack)) as mcp:
        listed = (await mcp.list_tools()).tools
        assert [t.name for t in listed] == [t.name for t in TOOLS]
        assert all(t.input_schema == input_schema(d.args) for t, d in zip(listed, TOOLS))

        ro = ok(await mcp.call_tool("env_rollout", {"name": "mcp-calc"}))
        sid, workdir = ro["sandbox_id"], ro["workdir"]
        assert ro["env"] == "mcp-calc" and workdir == "/repo"
        # a session keeps the cwd between calls, as a terminal would
        ok(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "cd calc && export N=1", "session": "t"}))
        r = ok(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "pwd; echo $N; ls", "session": "t"}))
        assert r["stdout"].startswith("/repo/calc\n1\n") and "stats.py" in r["stdout"] and r["exit_code"] == 0
        src = ok(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/repo/calc/stats.py"}))
        assert src["encoding"] == "utf-8" and "def median" in src["content"]
        ok(await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/repo/calc/stats.py", "content": STATS_FIXED}))
        r = await mcp.call_tool("exec", {"sandbox_id": sid, "command": "python3 -m unittest discover -s tests -t . 2>&1 | tail -1; exit 3"})
        assert not r.is_error and r.structured_content["exit_code"] == 3 and "OK" in r.structured_content["stdout"]
        assert r.content[0].text.startswith("exit_code: 3\nstdout:\n")
        g = ok(await mcp.call_tool("grade", {"sandbox_id": sid, "destroy": True}))
        assert g["reward"] == 1.0 and g["passed"] is True and {t["outcome"] for t in g["tests"]} == {"passed"}
        failed(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "true"}), "not_found")  # destroyed by the grade

        # a sandbox the model never destroys goes with the server
        left = ok(await mcp.call_tool("sandbox_create", {"image": "busybox", "cpu": 0.25, "memory_mb": 64}))["sandbox_id"]
        assert left in {i.id for i in await client.list()}
    assert left not in {i.id for i in await client.list()}


async def test_tool_errors_carry_corral_codes(client, stack):
    async with mcp_server.toolbox(stack.url) as tb, Client(mcp_server.build_server(tb)) as mcp:
        sid = ok(await mcp.call_tool("sandbox_create", {"image": "busybox", "cpu": 0.25, "memory_mb": 64}))["sandbox_id"]
        assert "memory_mb" in failed(await mcp.call_tool("sandbox_create", {"memory_mb": 1}), "invalid_request")
        assert "command" in failed(await mcp.call_tool("exec", {"sandbox_id": sid}), "invalid_request")
        assert "nope" in failed(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "true", "nope": 1}), "invalid_request")
        assert "unknown tool" in failed(await mcp.call_tool("rm_rf", {}), "invalid_request")
        failed(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/no/such"}), "not_found")
        assert "directory" in failed(await mcp.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp"}), "invalid_request")
        failed(await mcp.call_tool("env_rollout", {"name": "no-such-env"}), "not_found")
        failed(await mcp.call_tool("grade", {"sandbox_id": sid}), "invalid_request")  # not an environment rollout
        failed(await mcp.call_tool("exec", {"sandbox_id": "sb-gone", "command": "true"}), "not_found")
        r = ok(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "sleep 5", "timeout_s": 0.5}))
        assert r["timed_out"] is True and r["exit_code"] != 0
        ok(await mcp.call_tool("write_file", {"sandbox_id": sid, "path": "/bin/x.sh", "content": "echo hi", "mode": 0o755}))
        assert ok(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "/bin/x.sh"}))["stdout"] == "hi\n"
        ok(await mcp.call_tool("destroy", {"sandbox_id": sid}))
        # once the scheduler has followed the destroy (a list waits for that), a second one is
        # not_found; a moment earlier it may be `ok` (docs/contract.md: it cannot tell it from one
        # in flight when the sandbox went)
        assert sid not in {i.id for i in await client.list()}
        failed(await mcp.call_tool("destroy", {"sandbox_id": sid}), "not_found")
        assert tb.created == {}


async def test_streamable_http_round_trip(client, stack):
    stop, ready = asyncio.Event(), asyncio.Future()
    server = asyncio.create_task(mcp_server.serve_http(stack.url, "127.0.0.1", 0, stop=stop, ready=ready.set_result))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 30)
        async with Client(url) as mcp:
            assert len((await mcp.list_tools()).tools) == len(TOOLS)
            sid = ok(await mcp.call_tool("sandbox_create", {"image": "busybox", "cpu": 0.25, "memory_mb": 64}))["sandbox_id"]
            assert ok(await mcp.call_tool("exec", {"sandbox_id": sid, "command": "echo $((6*7))"}))["stdout"] == "42\n"
    finally:
        stop.set()
        await server
    assert sid not in {i.id for i in await client.list()}  # the server's exit took the forgotten sandbox along


async def test_toolbox_validates_json_text_arguments(client):
    """The OpenAI path: arguments arrive as JSON text from the model."""
    tb = Toolbox(client)
    r = await tb.call("exec", '{"sandbox_id": "x"}')
    assert r.error is not None and r.error.code == "invalid_request" and "command" in r.error.message
    r = await tb.call("exec", "{not json")
    assert r.error is not None and r.error.code == "invalid_request"
