import msgspec
import pytest

from corral_common import bus
from corral_common.contract import envelope
from corral_common.contract.errors import Code, CorralError, NotFound, from_code
from corral_common.contract.messages import CreateBatchRequest, ExecChunk, ExecRequest, SandboxSpec
from corral_common.contract.replies import DestroyReply, ExecReply, SandboxListReply, decode_exec_frame


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


def _reply_types() -> list[type]:
    """Every Reply subclass the contract package defines."""
    import importlib
    import pkgutil

    import corral_common.contract as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
    out, todo = [], [envelope.Reply]
    while todo:
        t = todo.pop()
        for sub in t.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def test_reply_envelopes():
    r = envelope.encode(DestroyReply(sandbox_id="sb-1"))
    assert msgspec.json.decode(r) == {"ok": True, "sandbox_id": "sb-1"}
    e = msgspec.json.decode(envelope.error("capacity", "full", 2.0))
    assert e == {"ok": False, "error": {"code": "capacity", "message": "full", "retry_after_s": 2.0}}


def test_every_reply_says_ok_on_the_wire():
    """A reply type that omitted defaults would drop `"ok": true`, and a client that checks `ok`
    first would read success as nothing at all."""
    types = _reply_types()
    assert len(types) >= 30, [t.__name__ for t in types]
    for t in types:
        assert not t.__struct_config__.omit_defaults, f"{t.__name__} omits defaults"
        assert "ok" in t.__struct_fields__


def test_decode_reply_raises_the_error_of_its_code():
    assert envelope.decode_reply(b'{"ok": true, "sandbox_id": "sb-1"}', DestroyReply).sandbox_id == "sb-1"
    with pytest.raises(NotFound, match="gone"):
        envelope.decode_reply(envelope.error("not_found", "gone"), DestroyReply)
    with pytest.raises(CorralError) as ei:  # an error reply for a type whose fields all have defaults
        envelope.decode_reply(envelope.error("capacity", "full", 1.5), SandboxListReply)
    assert ei.value.code is Code.CAPACITY and ei.value.retry_after_s == 1.5
    with pytest.raises(CorralError, match="does not match DestroyReply") as ei:
        envelope.decode_reply(b'{"ok": true}', DestroyReply)
    assert ei.value.code is Code.INTERNAL
    with pytest.raises(CorralError, match="does not match"):
        envelope.decode_reply(b"[1,", DestroyReply)


def test_exec_stream_frames_decode_in_one_pass():
    chunk = decode_exec_frame(b'{"kind": "chunk", "stream": "stderr", "data": "x", "seq": 3}')
    assert isinstance(chunk, ExecChunk) and chunk.stream == "stderr" and chunk.seq == 3
    final = decode_exec_frame(b'{"ok": true, "result": {"exit_code": 2}}')
    assert isinstance(final, ExecReply) and final.result.exit_code == 2
    with pytest.raises(NotFound):
        decode_exec_frame(envelope.error("not_found", "gone"))


def test_error_codes_map_to_exceptions():
    assert isinstance(from_code("not_found", "x"), NotFound)
    assert from_code("weird", "x").code is Code.INTERNAL
