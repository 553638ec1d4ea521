"""The SandboxFusion gateway against a real stack, driven by the unmodified `sandbox-fusion`
client from PyPI (and, for the fields that client does not send, by a raw POST shaped like verl's
sandbox_fusion reward sends it): results, failures, limits, files, bad input and 200 runs at once;
and the toolchain languages (cpp, rust, nodejs), compile results apart from run results."""
from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time

import aiohttp
import msgspec
import nats
import pytest
import pytest_asyncio
import requests
import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping

from corral_common.contract import labels, subjects
from corral_common.contract.audit import AuditBatch
from corral_common.contract.images import ImportReply, ImportRequest
from corral_sdk import AsyncClient
from corral_sdk.stack import free_port

from ..conftest import ensure_builtin_images, running_stack

pytestmark = pytest.mark.timeout(900)  # the first run on a machine builds the toolchain image


@pytest_asyncio.fixture(scope="module")
async def gw():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1, gateway_port=0, monitor=False, env_builder=False) as s:
        yield s


def run(gw, max_attempts: int = 1, **kw):
    """One /run_code through the client, off the event loop (the client is synchronous);
    max_attempts=1: the client's retries would hide a failed answer. Timeouts the test does not
    set are generous: an honest `rustc -O` took over SandboxFusion's default 10 s on a loaded CI
    machine, and a test checks behaviour, not the machine's speed."""
    kw.setdefault("compile_timeout", 120)
    kw.setdefault("run_timeout", 60)
    return asyncio.to_thread(sandbox_fusion.run_code, RunCodeRequest(**kw), endpoint=gw.gateway_url, max_attempts=max_attempts)


def post(gw, body: dict | bytes, path: str = "/run_code") -> requests.Response:
    """As verl's sandbox_fusion reward posts: a JSON body to the full /run_code URL."""
    data = body if isinstance(body, bytes) else json.dumps(body)
    return asyncio.to_thread(requests.post, gw.gateway_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60)


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


async def test_ping_and_languages(gw):
    r = await asyncio.to_thread(requests.get, gw.gateway_url + "/v1/ping", timeout=10)
    assert r.status_code == 200 and r.json() == "pong"
    r = await asyncio.to_thread(requests.get, gw.gateway_url + "/v1/languages", timeout=10)
    assert r.json()["languages"] == ["bash", "cpp", "nodejs", "pytest", "python", "rust"]
    assert (r.json()["image"], r.json()["toolchain_image"]) == ("debian", "toolchain")


async def test_success_with_stdin(gw):
    r = await run(gw, code="import sys\nprint(sys.stdin.read().upper(), end='')\nprint('err', file=sys.stderr)",
                  language="python", stdin="hello corral")
    assert r.status == RunStatus.Success, r
    assert r.compile_result is None  # python has no compile step, as in SandboxFusion
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == "HELLO CORRAL" and r.run_result.stderr == "err\n"
    assert r.run_result.execution_time > 0
    node, sid = r.executor_pod_name.split("/")
    assert node == "node-1" and sid
    assert sandbox_fusion.summary_run_code_result(r, SummaryMapping()) == "Success"


async def test_syntax_error_is_a_failed_run(gw):
    """SandboxFusion runs python without a compile step: a SyntaxError is a run that exits 1."""
    r = await run(gw, code="def f(:\n    pass\n", language="python")
    assert r.status == RunStatus.Failed
    assert r.compile_result is None
    assert r.run_result.status == "Finished" and r.run_result.return_code == 1
    assert "SyntaxError" in r.run_result.stderr
    assert sandbox_fusion.summary_run_code_result(r, SummaryMapping(RunFailed="run-failed")) == "run-failed"


async def test_runtime_error(gw):
    r = await run(gw, code="print('before')\nraise ValueError('boom')\n", language="python")
    assert r.status == RunStatus.Failed
    assert r.run_result.return_code == 1 and r.run_result.stdout == "before\n"
    assert "ValueError: boom" in r.run_result.stderr


async def test_timeout(gw):
    t0 = time.monotonic()
    r = await run(gw, code="import time\nprint('started', flush=True)\ntime.sleep(60)\n", language="python", run_timeout=3)
    assert time.monotonic() - t0 < 30
    assert r.status == RunStatus.Failed
    assert r.run_result.status == "TimeLimitExceeded" and r.run_result.return_code is None
    assert r.run_result.stdout == "started\n"
    assert sandbox_fusion.summary_run_code_result(r, SummaryMapping(RunTimeout="tle")) == "tle"


async def test_memory_limit(gw):
    """memory_limit_MB (sent by verl; this client version does not know the field) is the sandbox's
    memory: 300 MB written into 64 MB is killed, the same program with 1024 MB is not."""
    code = "x = b'x' * (300 * 1024 * 1024)\nprint(len(x))\n"
    r = await post(gw, {"code": code, "language": "python", "memory_limit_MB": 64, "run_timeout": 20, "compile_timeout": 10,
                        "stdin": None, "files": {}, "fetch_files": []})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] == -9  # SIGKILL, as subprocess reports it
    assert "out of memory" in body["run_result"]["stderr"]
    r = await post(gw, {"code": code, "language": "python", "memory_limit_MB": 1024, "run_timeout": 20})
    assert r.json()["status"] == "Success", r.text
    assert r.json()["run_result"]["stdout"] == f"{300 * 1024 * 1024}\n"
    own, bus = (float(part.split("dur=")[1]) for part in r.headers["Server-Timing"].split(", "))  # gateway;dur=X, bus;dur=Y
    assert 0 < own < bus


async def test_bash_and_pytest(gw):
    r = await run(gw, code="echo $((6 * 7))\nread line\necho \"got $line\"\n", language="bash", stdin="x\n")
    assert r.status == RunStatus.Success and r.run_result.stdout == "42\ngot x\n"
    tests = "def test_ok():\n    assert 1 + 1 == 2\n\ndef test_bad():\n    assert 1 + 1 == 3\n"
    r = await run(gw, code=tests, language="pytest")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 1
    assert "1 failed, 1 passed" in r.run_result.stdout
    r = await post(gw, {"code": tests, "language": "pytest", "args": ["-k", "test_ok"]})  # SandboxFusion's pytest args
    assert r.json()["status"] == "Success" and "1 passed, 1 deselected" in r.json()["run_result"]["stdout"]


async def test_files_in_and_out(gw):
    code = ("import json\n"
            "data = open('data/in.json').read()\n"
            "open('out.txt', 'w').write(data.upper())\n"
            "open('/tmp/abs.txt', 'w').write('absolute')\n"
            "print(json.loads(open('data/in.json').read())['k'], open('/etc/motd2').read())\n")
    files = {"data/in.json": b64('{"k": "v"}'), "/etc/motd2": b64("abs in"), "skipped.txt": None}
    r = await run(gw, code=code, language="python", files=files, fetch_files=["out.txt", "/tmp/abs.txt", "missing.txt", "data"])
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == "v abs in\n"
    # what was written comes back; what does not exist (or is a directory) is left out, as SandboxFusion does
    assert r.files == {"out.txt": b64('{"K": "V"}'), "/tmp/abs.txt": b64("absolute")}
    # files in without fetch_files: the function path
    r = await run(gw, code="print(open('a b/c.txt').read())", language="python", files={"a b/c.txt": b64("spaces ok")})
    assert r.status == RunStatus.Success and r.run_result.stdout == "spaces ok\n" and r.executor_pod_name.split("/")[1].startswith("fn-")
    # large code and files travel in chunks (each environment string is capped at 128 KiB)
    big = "y" * 300_000
    r = await run(gw, code=f"s = '{'é' * 40_000}'\nprint(len(s), len(open('big').read()))", language="python", files={"big": b64(big)})
    assert r.status == RunStatus.Success and r.run_result.stdout == "40000 300000\n", r


async def test_bad_requests_are_4xx(gw):
    async def refused(body, status: int, code: str, words: str, path: str = "/run_code"):
        r = await post(gw, body, path)
        assert r.status_code == status, r.text
        e = r.json()
        assert e["status"] == "SandboxError" and e["error"]["code"] == code and words in e["message"], e

    await refused({"code": "int main(){}", "language": "java"}, 400, "invalid_request", "supported: bash, cpp, nodejs, pytest, python, rust")
    await refused(b"{not json", 400, "invalid_request", "JSON")
    await refused({"language": "python"}, 400, "invalid_request", "code")
    await refused({"code": "print(1)", "language": "python", "run_timeout": -1}, 400, "invalid_request", "run_timeout")
    await refused({"code": "print(1)", "language": "python", "run_timeout": "soon"}, 400, "invalid_request", "run_timeout")
    await refused({"code": "print(1)", "language": "python", "files": {"a": "%%%"}}, 400, "invalid_request", "base64")
    await refused({"code": "print(1)", "language": "python", "files": {"": b64("x")}}, 400, "invalid_request", "path")
    await refused({"code": "print(1)", "language": "python", "memory_limit_MB": 4}, 400, "invalid_request", "memory_limit_MB")
    await refused({"code": "print(1)", "language": "python", "files": {"f": b64("z" * 2_000_000)}}, 413, "invalid_request", "at most")
    await refused({"code": "print(1)", "language": "python"}, 404, "not_found", "/nope", path="/nope")
    await refused({"cells": ["1"]}, 501, "invalid_request", "run_code", path="/run_jupyter")
    r = await asyncio.to_thread(requests.get, gw.gateway_url + "/run_code", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "invalid_request"
    # the unmodified client sees the refusal as its error, with the message
    with pytest.raises(Exception, match="400.*not supported"):
        await run(gw, code="x", language="go")


async def test_corral_errors_keep_their_code(gw, tmp_path):
    """A gateway whose image does not exist answers not_found as 404; a run no node has room for
    answers capacity as 429 with Retry-After: the original code and message in the body."""
    port = free_port()
    log = open(tmp_path / "gw2.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "corral_gateway", "--nats", gw.url, "--port", str(port), "--image", "no-such-image",
                          "--toolchain-image", "no-such-toolchain", "--capacity-wait-s", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                await asyncio.to_thread(requests.get, url + "/v1/ping", timeout=1)
                break
            except requests.ConnectionError:
                await asyncio.sleep(0.1)
        r = await asyncio.to_thread(requests.post, url + "/run_code", json={"code": "print(1)", "language": "python"}, timeout=60)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "not_found" and "no-such-image" in r.json()["error"]["message"]
        r = await asyncio.to_thread(requests.post, url + "/run_code", json={"code": "int main(){}", "language": "cpp"}, timeout=60)
        assert r.status_code == 404, r.text
        msg = r.json()["error"]["message"]
        assert "'no-such-toolchain'" in msg and "language 'cpp'" in msg and "corral image build" in msg, msg
        r = await asyncio.to_thread(requests.post, url + "/run_code", timeout=60,
                                    json={"code": "print(1)", "language": "python", "memory_limit_MB": 1_000_000})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "capacity" and int(r.headers["Retry-After"]) >= 1
    finally:
        p.terminate()
        p.wait(30)
        log.close()


async def test_runs_are_audited(gw):
    """A gateway run is an audited exec like any other, labelled with the adapter it came through."""
    r = await run(gw, code="print('audited')", language="python")
    node, sid = r.executor_pod_name.split("/")
    nc = await nats.connect(gw.url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subjects.audit(node, sid), ordered_consumer=True)
        execs = []
        deadline = time.monotonic() + 15
        while not execs and time.monotonic() < deadline:
            try:
                m = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # nats' TimeoutError: nothing (more) stored
                break
            execs += [e for e in msgspec.json.decode(m.data, type=AuditBatch).events if e.kind == "exec"]
        await sub.unsubscribe()
    finally:
        await nc.close()
    assert execs, f"no exec audit event for {sid}"
    # the gateway is a tenant-like identity: its jobs live under its name (docs/security.md)
    assert execs[0].labels.get(labels.ADAPTER) == "sandbox-fusion" and execs[0].job == "gateway/sandbox-fusion"
    assert execs[0].labels.get(labels.TENANT) == "gateway"
    assert execs[0].exit_code == 0


async def test_200_concurrent_requests(gw):
    """200 runs at once through the async client, each answered with its own result."""
    async def one(i: int):
        return await sandbox_fusion.run_code_async(RunCodeRequest(code=f"import sys\nprint({i} * {i}, sys.stdin.read())", language="python",
                                                                  stdin=f"in{i}", run_timeout=60), endpoint=gw.gateway_url,
                                                   max_attempts=1, client_timeout=300)

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)
    took = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 200 failed, first: {errors[0]!r}"
    wrong = [(i, r.run_result.stdout) for i, r in enumerate(results) if r.status != RunStatus.Success or r.run_result.stdout != f"{i * i} in{i}\n"]
    assert not wrong, wrong[:5]
    pods = {r.executor_pod_name for r in results}
    assert len(pods) == 200  # a fresh sandbox each
    print(f"200 concurrent runs in {took:.1f}s")
    async with aiohttp.ClientSession() as s, s.get(gw.gateway_url + "/metrics") as m:
        text = await m.text()
    assert 'corral_gateway_requests_total{language="python",outcome="Success",route="/run_code"}' in text


# ----- the toolchain languages (cpp, rust: compiled; nodejs) in the built-in `toolchain` image: a compile
# error, a compile timeout, a crash and a run timeout each land where SandboxFusion puts them

GRADES = SummaryMapping(Success="ok", CompileFailed="compile-failed", CompileTimeout="compile-timeout",
                        RunFailed="run-failed", RunTimeout="run-timeout")

SUM_CPP = """#include <iostream>
int main() {
    long a, b;
    std::cin >> a >> b;
    std::cout << a + b << std::endl;
    std::cerr << "note" << std::endl;
    return 0;
}
"""

@pytest_asyncio.fixture(scope="module")
async def toolchain(gw):
    """The gateway's stack with the built-in `toolchain` image imported (built on first use:
    debootstrap of debian + g++, rustc, nodejs, ~1 min; a no-op once on the machine)."""
    c = await AsyncClient.connect(gw.url)
    try:
        await c.request(subjects.IMAGE_IMPORT, ImportRequest(name="toolchain", source="builtin"), ImportReply, timeout=900)
    finally:
        await c.close()
    return gw


async def test_cpp_compiles_and_runs_with_stdin(toolchain):
    r = await run(toolchain, code=SUM_CPP, language="cpp", stdin="40 2\n")
    assert r.status == RunStatus.Success, r
    assert r.compile_result.status == "Finished" and r.compile_result.return_code == 0, r.compile_result
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == "42\n" and r.run_result.stderr == "note\n"
    assert sandbox_fusion.summary_run_code_result(r, GRADES) == "ok"


async def test_cpp_compile_error_has_no_run(toolchain):
    r = await run(toolchain, code="int main() { return undefined_name; }\n", language="cpp")
    assert r.status == RunStatus.Failed
    assert r.run_result is None
    assert r.compile_result.status == "Finished" and r.compile_result.return_code == 1
    assert "undefined_name" in r.compile_result.stderr and "error" in r.compile_result.stderr
    assert sandbox_fusion.summary_run_code_result(r, GRADES) == "compile-failed"


async def test_cpp_compile_timeout(toolchain):
    """A program whose constant evaluation takes the compiler minutes: compile_timeout ends it.
    (Each static_assert stays under g++'s per-evaluation limits, ~5M loop steps; 400 of them.)"""
    code = ("constexpr long f(long k) { long s = 0; for (long i = 0; i < 50000; i++) for (long j = 0; j < 100; j++) "
            "s += (i ^ j ^ k) & 7; return s; }\n" + "".join(f"static_assert(f({k}) >= 0);\n" for k in range(400)) + "int main() {}\n")
    r = await run(toolchain, code=code, language="cpp", compile_timeout=2)
    assert r.status == RunStatus.Failed and r.run_result is None
    assert r.compile_result.status == "TimeLimitExceeded" and r.compile_result.return_code is None
    assert sandbox_fusion.summary_run_code_result(r, GRADES) == "compile-timeout"


async def test_cpp_crash_and_run_timeout(toolchain):
    r = await run(toolchain, code="#include <cstdlib>\nint main() { std::abort(); }\n", language="cpp")
    assert r.status == RunStatus.Failed and r.compile_result.return_code == 0
    assert r.run_result.status == "Finished" and r.run_result.return_code == -6  # SIGABRT, as subprocess reports it
    assert sandbox_fusion.summary_run_code_result(r, GRADES) == "run-failed"
    r = await run(toolchain, code="#include <cstdio>\nint main() { puts(\"spin\"); fflush(stdout); for (;;) {} }\n",
                  language="cpp", run_timeout=3)
    assert r.status == RunStatus.Failed and r.compile_result.return_code == 0
    assert r.run_result.status == "TimeLimitExceeded" and r.run_result.stdout == "spin\n"
    assert sandbox_fusion.summary_run_code_result(r, GRADES) == "run-timeout"


async def test_cpp_reads_request_files_and_hands_back_its_own(toolchain):
    code = ('#include <fstream>\n#include <string>\nint main() { std::ifstream in("data/in.txt"); std::string s; in >> s;\n'
            '  std::ofstream("out.txt") << s << s; return 0; }\n')
    r = await run(toolchain, code=code, language="cpp", files={"data/in.txt": base64.b64encode(b"ab").decode()}, fetch_files=["out.txt"])
    assert r.status == RunStatus.Success, r
    assert base64.b64decode(r.files["out.txt"]) == b"abab"


async def test_cpp_memory_limit_is_the_runs(toolchain):
    """memory_limit_MB is the sandbox's: 600 MB touched in a 256 MB run is killed (the compile fits)."""
    code = ("#include <cstdlib>\n#include <cstdio>\n"
            "int main() { size_t n = 600UL << 20; volatile char *p = (volatile char *)malloc(n);\n"
            "  for (size_t i = 0; i < n; i += 4096) p[i] = 1;\n  printf(\"%p\\n\", (void *)p); }\n")
    body = {"code": code, "language": "cpp", "memory_limit_MB": 256, "run_timeout": 20, "compile_timeout": 30}
    resp = await asyncio.to_thread(requests.post, toolchain.gateway_url + "/run_code", json=body, timeout=120)
    out = resp.json()
    assert resp.status_code == 200 and out["status"] == "Failed", out
    assert out["compile_result"]["return_code"] == 0 and out["run_result"]["return_code"] == -9, out


async def test_rust_and_nodejs(toolchain):
    r = await run(toolchain, code='use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();\n'
                           '  println!("{}", s.trim().len()); }\n', language="rust", stdin="hello\n")
    assert r.status == RunStatus.Success, r
    assert r.compile_result.return_code == 0 and r.run_result.stdout == "5\n"
    r = await run(toolchain, code="fn main() { let x: u8 = \"no\"; }\n", language="rust")
    assert r.run_result is None and r.compile_result.return_code != 0 and "mismatched types" in r.compile_result.stderr
    r = await run(toolchain, code="process.stdin.on('data', d => console.log(String(d).trim().split('').reverse().join('')));",
                  language="nodejs", stdin="corral")
    assert r.status == RunStatus.Success, r
    assert r.compile_result is None and r.run_result.stdout == "larroc\n"
    r = await run(toolchain, code="throw new Error('boom')", language="nodejs")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 1 and "boom" in r.run_result.stderr
