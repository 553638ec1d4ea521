"""The SWE-ReX backend against a real stack, driven through swe-rex's own API the way SWE-agent
drives a deployment: start, a bash session with startup files, multi-step edits of a repository
uploaded from this machine, its tests, the diff, then stop. Plus the error conventions (timeout,
nonzero exit with check="raise", syntax errors, missing sessions and files) with corral's codes."""
from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import pytest_asyncio
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from corral_sdk import Conflict, NotFound
from corral_sdk.integrations.swerex import CorralDeployment, CorralFileNotFoundError, CorralRexError

pytestmark = pytest.mark.asyncio(loop_scope="session")

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deployment(stack):
    d = CorralDeployment(image="debian", nats_url=stack.url, cpu=1, memory_mb=512, ttl_s=900, job="swerex")
    await d.start()
    yield d
    await d.stop()


def run(command: str, **kw) -> BashAction:
    return BashAction(command=command, timeout=kw.pop("timeout", 60), **kw)


async def test_swe_agent_style_session_edits_a_repository_and_runs_its_tests(deployment, tmp_path):
    rt = deployment.runtime
    assert await deployment.is_alive()
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "test_calc.py").write_text(TEST)
    (repo / "tests" / "conftest.py").write_text("import sys, pathlib\nsys.path.insert(0, str(pathlib.Path(__file__).parent.parent))\n")
    await rt.upload(UploadRequest(source_path=str(repo), target_path="/repo"))

    # SWE-agent: a session sourcing the shell's rc file, then env variables, then cd into the repo
    await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"], session="default"))
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest(session="default"))
    # no bytecode cache: the sed edit below keeps calc.py's size and can land in the same second as
    # the first pytest run, and Python would then trust the stale .pyc (mtime+size) and test old code
    await rt.run_in_session(run("export PAGER=cat GIT_PAGER=cat PYTHONDONTWRITEBYTECODE=1 && cd /repo"))
    await rt.run_in_session(run("git init -q && git add -A && git -c user.name=a -c user.email=a@b commit -qm base && echo committed"))
    obs = await rt.run_in_session(run("pwd; [[ $BASH_VERSION == 5* ]] && echo bash; echo $PAGER"))
    assert obs.output.splitlines() == ["/repo", "bash", "cat"] and obs.exit_code == 0

    obs = await rt.run_in_session(run("python3 -m pytest -q tests", check="silent"))
    assert obs.exit_code == 1 and "1 failed, 1 passed" in obs.output, obs.output

    # edits the way agents make them: a bash function defined in one step and used in the next,
    # a heredoc, sed, and the runtime's write_file
    await rt.run_in_session(run("show() { nl -ba \"$1\" | sed -n \"$2p\"; }"))
    obs = await rt.run_in_session(run("show calc.py 2"))
    assert obs.output.strip() == "2\t    return a - b"
    await rt.run_in_session(run("sed -i 's/return a - b/return a + b/' calc.py"))
    await rt.run_in_session(run("cat > tests/test_more.py <<'EOF'\nfrom calc import add\n\n\ndef test_neg():\n    assert add(-1, 1) == 0\nEOF"))
    await rt.write_file(WriteFileRequest(path="/repo/tests/test_str.py", content="from calc import add\n\n\ndef test_str():\n    assert add('a', 'b') == 'ab'\n"))

    obs = await rt.run_in_session(run("python3 -m pytest -q tests 2>&1 | tail -1", check="raise"))
    assert "4 passed" in obs.output, obs.output
    obs = await rt.run_in_session(run("git diff"))
    assert "-    return a - b\n+    return a + b" in obs.output
    assert (await rt.read_file(ReadFileRequest(path="/repo/calc.py"))).content == CALC.replace("a - b", "a + b")
    obs = await rt.run_in_session(run("git status --porcelain"))
    changed = set(obs.output.splitlines())
    assert {" M calc.py", "?? tests/test_more.py", "?? tests/test_str.py"} <= changed
    assert [c for c in changed if c.startswith(" M")] == [" M calc.py"]
    await rt.close_session(CloseBashSessionRequest(session="default"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(run("true"))


async def test_session_errors_follow_swerex_conventions(deployment):
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest(session="err s/1"))  # a name corral would refuse is mapped
    s = "err s/1"
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(run("true", session="nope"))

    await rt.run_in_session(run("cd /tmp && export KEEP=1", session=s))
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await rt.run_in_session(run("echo out; echo err >&2; (exit 3)", session=s))
    obs = await rt.run_in_session(run("echo out; echo err >&2; (exit 3)", session=s, check="silent"))
    assert obs.exit_code == 3 and obs.output == "out\nerr\n"
    obs = await rt.run_in_session(run("false", session=s, check="ignore"))
    assert obs.exit_code is None
    obs = await rt.run_in_session(run("pwd; echo $KEEP", session=s))  # a failed command ends nothing
    assert obs.output == "/tmp\n1\n"

    # a command that does not parse raises before any of it runs
    with pytest.raises(BashIncorrectSyntaxError) as ei:
        await rt.run_in_session(run("touch /tmp/ran\nif then fi", session=s))
    assert "syntax error" in ei.value.extra_info["bash_stderr"]
    obs = await rt.run_in_session(run("test -e /tmp/ran; echo $?", session=s))
    assert obs.output == "1\n"

    # a timeout kills the command's tree: the session starts afresh, an interrupt finds it idle
    with pytest.raises(CommandTimeoutError, match="timeout after 1"):
        await rt.run_in_session(run("sleep 30", session=s, timeout=1))
    obs = await rt.run_in_session(BashInterruptAction(session=s))
    assert obs.exit_code == 0
    obs = await rt.run_in_session(run("pwd; echo ${KEEP:-unset}; grep -l sleep /proc/[0-9]*/comm 2>/dev/null | wc -l", session=s))
    assert obs.output == "/\nunset\n0\n"
    await rt.close_session(CloseBashSessionRequest(session=s))


async def test_execute_files_and_upload(deployment, tmp_path):
    rt = deployment.runtime
    r = await rt.execute(Command(command=["python3", "-c", "import sys; print(sys.argv[1]); print('e', file=sys.stderr)", "a b"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("a b\n", "e\n", 0)
    r = await rt.execute(Command(command="echo $X; echo e >&2; exit 4", shell=True, env={"X": "x"}, cwd="/tmp", merge_output_streams=True))
    assert (r.stdout, r.exit_code) == ("x\ne\n", 4)
    with pytest.raises(NonZeroExitCodeError, match="my step"):
        await rt.execute(Command(command="exit 2", shell=True, check=True, error_msg="my step"))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "30"], timeout=1))
    with pytest.raises(CorralRexError) as ei:  # corral's refusal, with its code and message
        await rt.execute(Command(command=["true"], env={"A=B": "1"}))
    assert ei.value.corral_code == "invalid_request" and "A=B" in ei.value.corral_message

    with pytest.raises(FileNotFoundError) as fe:
        await rt.read_file(ReadFileRequest(path="/no/such/file"))
    assert isinstance(fe.value, CorralFileNotFoundError) and fe.value.corral_code == "not_found"
    await rt.write_file(WriteFileRequest(path="/w/deep/x.txt", content="hé\n"))
    assert (await rt.read_file(ReadFileRequest(path="/w/deep/x.txt"))).content == "hé\n"

    # larger than one bus message: sent in parts and joined in the sandbox
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(deployment.sandbox.client.nc.max_payload * 2 + 123))
    os.chmod(big, 0o750)
    await rt.upload(UploadRequest(source_path=str(big), target_path="/up/big.bin"))
    r = await rt.execute(Command(command="sha256sum /up/big.bin | cut -d' ' -f1; stat -c %a /up/big.bin; ls /tmp", shell=True))
    assert r.stdout.split("\n")[:2] == [hashlib.sha256(big.read_bytes()).hexdigest(), "750"]
    assert ".corral-upload" not in r.stdout
    with pytest.raises(FileNotFoundError):
        await rt.upload(UploadRequest(source_path=str(tmp_path / "none"), target_path="/x"))


async def test_bash_sessions_in_the_contract(client):
    """The node-agent's `shell="bash"`: a live session keeps its shell; asking another is a conflict."""
    async with await client.create(image="debian", cpu=0.25, memory_mb=128, ttl_s=300) as sb:
        r = await sb.exec("echo ${BASH_VERSION:-none}", session="plain")
        assert r.stdout == "none\n"
        with pytest.raises(Conflict, match="runs sh"):
            await sb.exec("true", session="plain", shell="bash")
        await sb.exec("exit", session="plain")
        r = await sb.exec("echo ${BASH_VERSION:-none}", session="plain", shell="bash")
        assert r.stdout.startswith("5.")


def swe_agent_style(url: str) -> tuple[str, list[str]]:
    """What SWE-agent's SWEEnv does: synchronous code, every deployment call in its own asyncio.run."""
    d = CorralDeployment(image="debian", nats_url=url, cpu=0.5, memory_mb=256, ttl_s=300)
    asyncio.run(d.start())
    try:
        rt = d.runtime
        asyncio.run(rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"])))
        outs = [asyncio.run(rt.run_in_session(run(c))).output for c in ("cd /tmp && X=1", "pwd; echo $X")]
        asyncio.run(rt.write_file(WriteFileRequest(path="/tmp/f", content="x")))
        outs.append(asyncio.run(rt.read_file(ReadFileRequest(path="/tmp/f"))).content)
        assert asyncio.run(d.is_alive())
        return d.sandbox.id, outs
    finally:
        asyncio.run(d.stop())


async def test_each_call_on_its_own_event_loop_as_swe_agent_makes_them(stack, client):
    sid, outs = await asyncio.to_thread(swe_agent_style, stack.url)
    assert outs == ["", "/tmp\n1\n", "x"]
    with pytest.raises(NotFound):  # stop() destroyed it
        await client.sandbox(sid).refresh()


async def test_deployment_lifecycle(stack, client):
    d = CorralDeployment(image="debian", nats_url=stack.url, cpu=0.5, memory_mb=256, ttl_s=300)
    with pytest.raises(DeploymentNotStartedError):
        d.runtime
    await d.start()
    assert (await d.runtime.execute(Command(command=["true"]))).exit_code == 0
    await client.sandbox(d.sandbox.id).destroy()  # gone behind the deployment's back: not alive, with corral's reason
    alive = await d.is_alive()
    assert not alive and "not_found" in alive.message
    await d.stop()
    await d.stop()
    with pytest.raises(DeploymentNotStartedError):
        await d.is_alive()

    bad = CorralDeployment(image="no-such-image", nats_url=stack.url, wait_for_capacity_s=0)
    with pytest.raises(DeploymentStartupError) as ei:
        await bad.start()
    assert ei.value.corral_code in ("not_found", "invalid_request") and "no-such-image" in ei.value.corral_message
    with pytest.raises(DeploymentNotStartedError):
        bad.runtime
