"""The SandboxFusion wire format, as msgspec Structs.

Field names, defaults and enums follow SandboxFusion's server (`sandbox/server/sandbox_api.py`,
`sandbox/runners/types.py`) and the `sandbox-fusion` client's pydantic models. Unknown request
fields are ignored, as SandboxFusion's pydantic models ignore them, so a newer client's extra field
does not break an older gateway; the response always carries every field (nulls included), because
the client's models read them by name."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

CommandRunStatus = Literal["Finished", "Error", "TimeLimitExceeded"]
RunStatus = Literal["Success", "Failed", "SandboxError"]

Seconds = Annotated[float, Meta(gt=0, le=86400)]


class RunCodeRequest(Struct, kw_only=True):
    code: Annotated[str, Meta(max_length=8 * 1024 * 1024)]
    language: Annotated[str, Meta(min_length=1, max_length=64)]
    compile_timeout: Seconds = 10.0
    run_timeout: Seconds = 10.0
    # SandboxFusion: -1 (or any value <= 0) = no limit of the request's own; corral uses the
    # gateway's default sandbox memory then
    memory_limit_MB: int = -1
    stdin: str | None = None
    # path (relative to the run's directory, or absolute) -> base64 content; None entries are skipped
    files: Annotated[dict[str, str | None], Meta(max_length=1024)] = {}
    fetch_files: Annotated[list[str], Meta(max_length=1024)] = []
    # extra command-line arguments, for `pytest` (as SandboxFusion)
    args: Annotated[list[str], Meta(max_length=256)] = []


class CommandRunResult(Struct, kw_only=True):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(Struct, kw_only=True):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class ErrorDetail(Struct, kw_only=True, omit_defaults=True):
    """corral's own error, as the bus answered it (or as the gateway refused the request)."""

    code: str
    message: str
    retry_after_s: float | None = None


class ErrorResponse(Struct, kw_only=True):
    """The body of every non-200 answer: SandboxFusion's `status`/`message` pair (status
    `SandboxError`, which its client raises on) plus the original corral code and message."""

    status: RunStatus = "SandboxError"
    message: str
    error: ErrorDetail


class LanguagesResponse(Struct, kw_only=True):
    languages: list[str]
    image: str
    toolchain_image: str
