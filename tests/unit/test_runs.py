"""The identity of a run request behind a request_id (scheduler runs.py): defaults spelled out
or left out are the same request; any field that changes what runs is another."""
from __future__ import annotations

import msgspec

from corral_common.contract.messages import ExecRequest, RunRequest, RunSpec
from corral_scheduler.runs import digest_of, key_of


def _decode(raw: bytes) -> RunRequest:
    return msgspec.json.decode(raw, type=RunRequest)


def test_defaults_spelled_out_are_the_same_request():
    sparse = _decode(b'{"spec": {"request_id": "r1", "job": "j"}, "exec": {"cmd": "echo hi"}}')
    full = RunRequest(spec=RunSpec(image="busybox", substrate="function", request_id="r1", job="j", cpu=1.0),
                      exec=ExecRequest(cmd="echo hi", stdin="", env={}, cwd=None, timeout_s=60.0, max_output_bytes=1 << 20))
    assert digest_of(sparse) == digest_of(full)


def test_a_different_request_has_another_digest():
    base = _decode(b'{"spec": {"request_id": "r1"}, "exec": {"cmd": "echo hi"}}')
    for other in (b'{"spec": {"request_id": "r1"}, "exec": {"cmd": "echo ho"}}',
                  b'{"spec": {"request_id": "r1"}, "exec": {"cmd": ["echo", "hi"]}}',
                  b'{"spec": {"request_id": "r1", "memory_mb": 64}, "exec": {"cmd": "echo hi"}}',
                  b'{"spec": {"request_id": "r1"}, "exec": {"cmd": "echo hi", "env": {"A": "1"}}}'):
        assert digest_of(_decode(other)) != digest_of(base), other


def test_keys_are_valid_kv_keys_and_apart_from_create_ids():
    k = key_of("any id / with spaces and ünicode")
    assert k.startswith("u") and k[1:].isalnum() and len(k) == 41
