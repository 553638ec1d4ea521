"""The `corral` CLI against the running stack, as a user types it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

CORRAL = os.path.join(os.path.dirname(sys.executable), "corral")


def corral(stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([CORRAL, *args], env={**os.environ, "CORRAL_NATS_URL": stack.url, "COLUMNS": "200"},
                       capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


async def test_sandbox_commands(stack, client):
    sid = corral(stack, "sandbox", "create", "--image", "busybox", "--cpu", "0.1", "--memory-mb", "32", "--job", "cli").stdout.strip()
    assert sid.startswith("sb-")
    p = corral(stack, "sandbox", "exec", sid, "echo out; echo err >&2; exit 3", check=False)
    assert p.returncode == 3 and p.stdout == "out\n" and p.stderr == "err\n"
    listed = json.loads(corral(stack, "sandbox", "ls", "--job", "cli", "--json").stdout)
    assert [i["id"] for i in listed] == [sid]
    # two forks of it: its files (checked through the SDK: each CLI call is a Python start-up)
    await client.sandbox(sid).exec("echo from-source > /root/f")
    forks = corral(stack, "sandbox", "create", "--fork-of", sid, "--count", "2", "--cpu", "0.1", "--memory-mb", "32",
                   "--job", "cli").stdout.split()
    assert len(set(forks)) == 2 and sid not in forks, forks
    for f in forks:
        assert (await client.sandbox(f).exec("cat /root/f")).stdout == "from-source\n"
    assert corral(stack, "sandbox", "rm", sid, *forks).stdout.split() == [sid, *forks]
    p = corral(stack, "sandbox", "exec", sid, "true", check=False)
    assert p.returncode == 1 and "not_found" in p.stderr
    p = corral(stack, "sandbox", "create", "--fork-of", sid, check=False)
    assert p.returncode == 1 and "not_found" in p.stderr and "to fork" in p.stderr, (p.stdout, p.stderr)


async def test_image_and_traj_commands(stack, client, tmp_path):
    (tmp_path / "hello.txt").write_text("hi from cli\n")
    p = corral(stack, "image", "import", "cli-img", str(tmp_path), "--base", "busybox")
    assert "cli-img: 2 layer(s)" in p.stderr + p.stdout
    assert "cli-img" in corral(stack, "image", "ls").stdout
    info = json.loads(corral(stack, "image", "inspect", "cli-img").stdout)
    assert len(info["layers"]) == 2
    async with client.trajectory("cli-traj", image="cli-img", cpu=0.1, memory_mb=32, snapshot_every=0) as t:
        assert (await t.exec("cat /hello.txt")).stdout == "hi from cli\n"
        sb = t.sandbox
    assert "cli-traj" in corral(stack, "traj", "ls").stdout
    assert "cat /hello.txt" in corral(stack, "traj", "show", "cli-traj").stdout
    corral(stack, "traj", "rm", "cli-traj")
    p = corral(stack, "traj", "show", "cli-traj", check=False)
    assert p.returncode == 1 and "not_found" in p.stderr
    await sb.destroy()
    assert "freed" in corral(stack, "image", "rm", "cli-img").stdout


async def test_run_one_shot(stack):
    p = corral(stack, "run", "echo one-shot; exit 4", check=False)
    assert p.returncode == 4 and "one-shot" in p.stdout, (p.stdout, p.stderr)
