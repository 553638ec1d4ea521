"""Error codes of the v1 contract and the exception that carries one across a service boundary."""
from __future__ import annotations

import enum


class Code(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    CAPACITY = "capacity"
    TIMEOUT = "timeout"
    CONFLICT = "conflict"
    FORBIDDEN = "forbidden"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class CorralError(Exception):
    """Raised inside a service handler; the bus helper turns it into an error reply.

    `retry_after_s` is a hint for `capacity` and `unavailable` errors.
    """

    code: Code = Code.INTERNAL

    def __init__(self, message: str, code: Code | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class InvalidRequest(CorralError):
    code = Code.INVALID_REQUEST


class NotFound(CorralError):
    code = Code.NOT_FOUND


class Capacity(CorralError):
    code = Code.CAPACITY


class Timeout(CorralError):
    code = Code.TIMEOUT


class Conflict(CorralError):
    code = Code.CONFLICT


class Forbidden(CorralError):
    code = Code.FORBIDDEN


class Unavailable(CorralError):
    code = Code.UNAVAILABLE


class Internal(CorralError):
    code = Code.INTERNAL


BY_CODE: dict[Code, type[CorralError]] = {
    cls.code: cls
    for cls in (InvalidRequest, NotFound, Capacity, Timeout, Conflict, Forbidden, Unavailable, Internal)
}


def from_code(code: str, message: str, retry_after_s: float | None = None) -> CorralError:
    try:
        c = Code(code)
    except ValueError:
        c = Code.INTERNAL
    return BY_CODE[c](message, retry_after_s=retry_after_s)
