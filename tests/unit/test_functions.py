"""Python-function calls (corral_sdk.functions) without a sandbox: the program and stdin that are
sent run under the local python3 exactly as a sandbox would run them; plus the one-shot contract
types and the embedded stack's substrate arguments."""
from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from corral_common.contract.errors import Timeout
from corral_common.contract.messages import ExecResult, NodeRun, RunRequest
from corral_sdk.functions import RemoteError, decode_result, encode_call
from corral_sdk.stack import Stack


def add(a, b=0):
    print("noise on stdout")  # must not disturb the result
    return {"sum": a + b}


def fails(x):
    raise KeyError(x)


async def coro(x):
    return x * 2


def _deco(f):
    return f


@_deco
def decorated():
    return "ok"


def local_run(fn, *args, **kwargs) -> ExecResult:
    argv, stdin = encode_call(fn, args, kwargs)
    assert argv[:2] == ["python3", "-c"]
    p = subprocess.run([sys.executable, "-c", argv[2]], input=stdin, capture_output=True, text=True, timeout=30)
    return ExecResult(exit_code=p.returncode, stdout=p.stdout, stderr=p.stderr)


def test_round_trip_value_and_stdout_separation():
    r = local_run(add, 2, b=3)
    assert decode_result(r, add) == {"sum": 5}
    assert "noise on stdout" in r.stderr


def test_async_and_decorated():
    assert decode_result(local_run(coro, 21), coro) == 42
    assert decode_result(local_run(decorated), decorated) == "ok"


def test_remote_exception_carries_type_and_traceback():
    with pytest.raises(RemoteError) as e:
        decode_result(local_run(fails, "k"), fails)
    assert e.value.type_name == "KeyError" and "fails" in e.value.remote_traceback


def test_refused_locally():
    n = 1
    with pytest.raises(TypeError, match="enclosing"):
        encode_call(lambda_free_closure(n), (), {})
    with pytest.raises(TypeError, match="plain function"):
        encode_call(lambda: 1, (), {})
    with pytest.raises(TypeError, match="plain function"):
        encode_call(print, (), {})
    with pytest.raises(TypeError, match="JSON"):
        encode_call(add, (object(),), {})


def lambda_free_closure(n):
    def inner():
        return n
    return inner


def test_decode_failures():
    with pytest.raises(Timeout):
        decode_result(ExecResult(exit_code=137, timed_out=True), add)
    with pytest.raises(RemoteError, match="python3"):
        decode_result(ExecResult(exit_code=127, stderr="corral: cannot run python3: No such file or directory\n"), add)
    with pytest.raises(RemoteError, match="out of memory"):
        decode_result(ExecResult(exit_code=137, oom_killed=True, signal=9), add)


def test_run_request_defaults_to_function():
    r = msgspec.json.decode(b'{"exec": {"cmd": "true"}}', type=RunRequest)
    assert r.spec.substrate == "function" and r.spec.to_spec().substrate == "function"
    r = msgspec.json.decode(b'{"spec": {"substrate": "container", "cpu": 0.5}, "exec": {"cmd": ["true"]}}', type=RunRequest)
    spec = r.spec.to_spec()
    assert spec.substrate == "container" and spec.cpu == 0.5
    back = msgspec.json.decode(msgspec.json.encode(NodeRun(spec=spec, exec=r.exec)), type=NodeRun)
    assert back.spec.substrate == "container" and back.exec.cmd == ["true"]
    fn = msgspec.json.decode(b'{"exec": {"cmd": "true"}}', type=RunRequest).spec.to_spec()
    assert json.loads(msgspec.json.encode(NodeRun(spec=fn, exec=r.exec)))["spec"]["substrate"] == "function"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"spec": {"imag": "x"}, "exec": {"cmd": "true"}}', type=RunRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"spec": {}}', type=RunRequest)


def test_stack_substrate_args():
    assert Stack(data_dir="/tmp/x").substrate_args() == ["--substrate", "container", "--substrate", "function"]
    assert Stack(data_dir="/tmp/x", docker=True).substrate_args()[-2:] == ["--substrate", "docker"]
    assert Stack(data_dir="/tmp/x", node_args=["--substrate", "docker"]).substrate_args() == []
