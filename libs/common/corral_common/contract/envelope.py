"""The reply envelope every request/reply subject shares.

On the wire a reply is one flat JSON object: `{"ok": true, ...fields}` on success,
`{"ok": false, "error": {"code", "message", "retry_after_s"}}` on failure. Each operation's success
reply is a `Reply` subclass naming its fields, so a handler returns a typed value that
`bus.Responder` encodes, and a caller gets the same type back from `decode_reply`, which turns an
error reply into the `CorralError` its code stands for. Replies never omit defaults (`ok` must
always be on the wire, and a non-Python client reads every field the schema names).
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from .errors import CorralError, Internal, from_code


class ErrorBody(Struct, kw_only=True, omit_defaults=True):
    code: str  # one of errors.Code
    message: str  # for a person: what was wrong and, where it helps, what to do
    retry_after_s: float | None = None  # capacity/unavailable: when a retry may succeed


class Reply(Struct, kw_only=True):
    """A success reply; subclasses add the operation's fields."""

    ok: bool = True


class ErrorReply(Struct, kw_only=True):
    ok: bool = False
    error: ErrorBody


R = TypeVar("R", bound=Reply)
_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_error_decoder = msgspec.json.Decoder(ErrorReply)


def encode(reply: Reply | ErrorReply) -> bytes:
    return _encoder.encode(reply)


def error(code: str, message: str, retry_after_s: float | None = None) -> bytes:
    return _encoder.encode(ErrorReply(error=ErrorBody(code=code, message=message, retry_after_s=retry_after_s)))


def error_of(e: CorralError) -> ErrorBody:
    return ErrorBody(code=e.code.value, message=e.message, retry_after_s=e.retry_after_s)


def raise_error(body: ErrorBody) -> None:
    raise from_code(body.code, body.message, body.retry_after_s)


def decode_reply(data: bytes, typ: type[R]) -> R:
    """Decode a reply as `typ`; an error reply raises the CorralError of its code, and a reply
    that is neither (a peer speaking another contract version, a truncated message) raises
    `internal` naming what did not match."""
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.json.Decoder(typ)
    try:
        r: R = dec.decode(data)
    except msgspec.DecodeError as e:
        bad: Exception = e
    else:
        if r.ok:
            return r
        bad = Internal("error reply without an error body")
    try:
        err = _error_decoder.decode(data)
    except msgspec.DecodeError:
        raise Internal(f"reply does not match {typ.__name__}: {bad}") from None
    raise from_code(err.error.code, err.error.message, err.error.retry_after_s)
