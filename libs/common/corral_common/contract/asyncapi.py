"""The contract as documents: a JSON Schema per message (msgspec's own schema of each Struct, so
constraints such as `cpu > 0` come along) and an AsyncAPI 3.0 document of every subject, both
generated from operations.py. `corral contract` writes them under docs/contract/; a test checks
the committed copies are current and valid against the AsyncAPI 3.0.0 JSON Schema."""
from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from . import operations as ops
from . import subjects

VERSION = "1.0.0"  # of the v1 contract's documents; the subjects say v1
_PARAM = re.compile(r"\{([a-z_]+)\}")
_PARAM_DOC = {
    "sandbox_id": "A sandbox id (sb-<hex>), as create answered",
    "node": "A node's name, as its heartbeat gives it",
    "kind": "The event kind",
    "batch_id": "The batch id of a create_batch",
    "severity": "low, medium, high or critical",
    "rule": "The detection rule's name",
    "trajectory": "A trajectory id",
    "step": "The step number, from 0",
    "build_id": "The build id given in EnvBuildRequest",
}


def schemas() -> dict[str, Any]:
    """name -> JSON Schema (components form: references are `#/components/schemas/<Name>`)."""
    _, components = msgspec.json.schema_components(ops.all_types(), ref_template="#/components/schemas/{name}")
    return dict(sorted(components.items()))


def _params(subject: str) -> dict[str, Any]:
    return {p: {"description": _PARAM_DOC.get(p, p)} for p in _PARAM.findall(subject)}


def _msg_ref(t: type) -> dict[str, str]:
    return {"$ref": f"#/components/messages/{t.__name__}"}


def document() -> dict[str, Any]:
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}

    def message(t: type) -> None:
        doc = (t.__doc__ or "").strip()
        m: dict[str, Any] = {"name": t.__name__, "contentType": "application/json",
                             "payload": {"$ref": f"#/components/schemas/{t.__name__}"}}
        if doc and not doc.startswith(t.__name__ + "("):
            m["summary"] = doc.split("\n\n")[0].replace("\n", " ")
        messages.setdefault(t.__name__, m)

    def channel(name: str, subject: str | None, types: list[type], description: str) -> None:
        for t in types:
            message(t)
        ch: dict[str, Any] = {"address": subject, "description": description,
                              "messages": {t.__name__: _msg_ref(t) for t in types}}
        if subject:
            params = _params(subject)
            if params:
                ch["parameters"] = params
        channels[name] = ch

    for o in ops.OPERATIONS:
        channel(o.name, o.subject, [o.request], o.summary)
        # a reply goes to the requester's inbox (the NATS reply subject), so its address is dynamic
        channel(o.name + "Reply", None, [o.reply, o.errors, *o.streams],
                f"Replies to {o.subject}" + (": stream messages first, then the reply" if o.streams else ""))
        operations[o.name] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{o.name}"},
            "summary": o.summary,
            "messages": [{"$ref": f"#/channels/{o.name}/messages/{o.request.__name__}"}],
            "reply": {
                "channel": {"$ref": f"#/channels/{o.name}Reply"},
                "messages": [{"$ref": f"#/channels/{o.name}Reply/messages/{t.__name__}"} for t in (o.reply, o.errors, *o.streams)],
            },
            "tags": [{"name": o.service}, {"name": "public" if o.public else "internal"}],
            **({"bindings": {"nats": {"queue": o.queue, "bindingVersion": "0.1.0"}}} if o.queue else {}),
        }
    for c in ops.CHANNELS:
        desc = c.summary + (f" (JetStream stream {c.stream})" if c.stream else "")
        channel(c.name, c.subject, [c.message], desc)
        operations[c.name + "Publish"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{c.name}"},
            "summary": f"{c.publisher} publishes: {c.summary}",
            "messages": [{"$ref": f"#/channels/{c.name}/messages/{c.message.__name__}"}],
            "tags": [{"name": c.publisher}],
        }
    for b in ops.BUCKETS:
        name = "kv_" + b.name
        types = [b.value] if b.value is not None else []
        channel(name, subjects.kv_key(b.name, "{key}"), types,
                f"JetStream KV bucket `{b.name}` (key: {b.key}; written by {b.writer}): {b.summary}")
        channels[name]["parameters"] = {"key": {"description": b.key}}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "corral bus contract",
            "version": VERSION,
            "description": ("Sandboxes for training and evaluating AI agents, as services on NATS. Every request gets exactly "
                            "one reply on its NATS reply subject: `{\"ok\": true, ...}` (the operation's reply) or "
                            "`{\"ok\": false, \"error\": {\"code\", \"message\", \"retry_after_s\"}}` (ErrorReply). "
                            "Requests refuse unknown fields. Operations tagged `internal` are between corral's own services."),
        },
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats", "description": "the embedded stack of `corral up`"}},
        "channels": channels,
        "operations": operations,
        "components": {"messages": dict(sorted(messages.items())), "schemas": schemas()},
    }


def render(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def files() -> dict[str, str]:
    """Relative path -> content of everything `corral contract` writes."""
    out = {"asyncapi.json": render(document())}
    for name, schema in schemas().items():
        out[f"schemas/{name}.json"] = render({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": name,
                                               **_standalone(schema)})
    return out


def _standalone(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema whose references point at sibling files (`<Name>.json`) instead of components."""
    text = json.dumps(schema)
    text = re.sub(r'"#/components/schemas/([A-Za-z0-9_]+)"', r'"\1.json"', text)
    out: dict[str, Any] = json.loads(text)
    return out
