import msgspec
import pytest

from corral_common import bus
from corral_common.contract.errors import Code, CorralError, NotFound, from_code
from corral_common.contract.messages import CreateBatchRequest, ExecRequest, SandboxSpec, error, ok


def test_spec_defaults_and_roundtrip():
    s = bus.decode(b'{"image": "debian", "cpu": 0.5, "labels": {"a": "b"}}', SandboxSpec)
    assert s.image == "debian" and s.cpu == 0.5 and s.substrate == "container" and s.network == "none"
    assert msgspec.json.decode(msgspec.json.encode(s), type=SandboxSpec) == s


@pytest.mark.parametrize("raw,field", [
    (b'{"cpu": 0}', "cpu"),
    (b'{"memory_mb": "x"}', "memory_mb"),
    (b'{"ttl_s": -1}', "ttl_s"),
    (b'{"network": "host"}', "network"),
    (b'{"bogus": 1}', "bogus"),
])
def test_spec_rejects_with_field_name(raw, field):
    with pytest.raises(CorralError) as ei:
        bus.decode(raw, SandboxSpec)
    assert ei.value.code is Code.INVALID_REQUEST and field in ei.value.message


def test_malformed_json_is_invalid_request():
    with pytest.raises(CorralError, match="malformed JSON"):
        bus.decode(b"{", ExecRequest)


def test_exec_cmd_forms():
    assert bus.decode(b'{"cmd": "ls"}', ExecRequest).cmd == "ls"
    assert bus.decode(b'{"cmd": ["ls", "-l"]}', ExecRequest).cmd == ["ls", "-l"]
    with pytest.raises(CorralError):
        bus.decode(b'{"cmd": []}', ExecRequest)


def test_batch_count_bounds():
    with pytest.raises(CorralError, match="count"):
        bus.decode(b'{"spec": {}, "count": 0}', CreateBatchRequest)


def test_reply_envelopes():
    assert msgspec.json.decode(ok(x=1)) == {"ok": True, "x": 1}
    e = msgspec.json.decode(error("capacity", "full", 2.0))
    assert e == {"ok": False, "error": {"code": "capacity", "message": "full", "retry_after_s": 2.0}}


def test_error_codes_map_to_exceptions():
    assert isinstance(from_code("not_found", "x"), NotFound)
    assert from_code("weird", "x").code is Code.INTERNAL
