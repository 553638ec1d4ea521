"""corral as a set of agent tools, defined once: each tool's arguments are a msgspec Struct whose
JSON schema is what an MCP client (`corral mcp`) or an OpenAI-style function-calling loop
(`corral tools --format openai`) sees, and `Toolbox.call` validates raw arguments against the
same Struct before touching the bus. No MCP or OpenAI package is needed here.

Errors are values, not exceptions: a tool that fails answers `ToolResult(error=ToolError(code,
message))` with corral's own code (invalid_request, not_found, capacity, ...), which the MCP
server turns into an `isError` result the model can read and act on."""
from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from corral_common.contract.errors import CorralError, NotFound
from corral_common.contract.messages import SandboxSpec

from ..client import AsyncClient, AsyncSandbox

Id = Annotated[str, Meta(min_length=1, max_length=128, description="a sandbox id, as sandbox_create or env_rollout answered")]


class SandboxCreateArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    image: Annotated[str, Meta(description="image name: `debian` (python3, git, pytest) or `busybox`")] = "debian"
    cpu: Annotated[float, Meta(gt=0, le=64, description="cores")] = 1.0
    memory_mb: Annotated[int, Meta(ge=16, le=262144)] = 1024
    ttl_s: Annotated[float, Meta(gt=0, le=86400, description="seconds until the sandbox is destroyed unless renewed")] = 3600.0
    workdir: Annotated[str, Meta(description="working directory of commands (default /)")] = ""
    env: Annotated[dict[str, str], Meta(description="environment variables of every command")] = {}


class EnvRolloutArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=128, description="an environment of the catalog (`corral env ls`)")]
    version: Annotated[str, Meta(description="a version of it (default: the latest)")] = ""


class ExecArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Id
    command: Annotated[str, Meta(min_length=1, description="a shell command line")]
    cwd: Annotated[str, Meta(description="directory to run it in (default: the sandbox's workdir)")] = ""
    timeout_s: Annotated[float, Meta(gt=0, le=3600, description="the command and its children are killed after this")] = 60.0
    session: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$",
                                 description="run in this persistent shell: cwd and exported variables carry over "
                                             "to the next command of the same session (empty: a fresh shell)")] = ""
    shell: Annotated[Literal["sh", "bash"], Meta(description="the shell a new session starts")] = "bash"
    stdin: str = ""


class ReadFileArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Id
    path: Annotated[str, Meta(min_length=1, max_length=4096, description="absolute path in the sandbox")]
    max_bytes: Annotated[int, Meta(ge=1, le=16 * 1024 * 1024)] = 1024 * 1024


class WriteFileArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Id
    path: Annotated[str, Meta(min_length=1, max_length=4096, description="absolute path in the sandbox; parents are made")]
    content: Annotated[str, Meta(description="the whole new content (UTF-8 text)")]
    mode: Annotated[int, Meta(ge=0, le=0o7777, description="permission bits, e.g. 420 for 0644 or 493 for 0755")] = 0o644


class GradeArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Id
    destroy: Annotated[bool, Meta(description="destroy the sandbox after grading")] = False


class DestroyArgs(Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Id


class ToolDef(Struct, frozen=True):
    name: str
    description: str
    args: type


TOOLS: tuple[ToolDef, ...] = (
    ToolDef("sandbox_create", "Create an isolated Linux sandbox (no network) to run commands and edit files in. "
            "Answers its sandbox_id.", SandboxCreateArgs),
    ToolDef("env_rollout", "Start a fresh sandbox of a catalog environment (a task: its repository, limits and "
            "hidden tests); work in it, then call grade. Answers its sandbox_id and workdir.", EnvRolloutArgs),
    ToolDef("exec", "Run a shell command in a sandbox. Answers exit_code, stdout and stderr.", ExecArgs),
    ToolDef("read_file", "Read a file of a sandbox as text.", ReadFileArgs),
    ToolDef("write_file", "Create or overwrite a file in a sandbox.", WriteFileArgs),
    ToolDef("grade", "Grade an environment rollout: run the environment's hidden tests against the sandbox's "
            "files. Answers reward (0..1), passed, per-test outcomes and monitor alerts.", GradeArgs),
    ToolDef("destroy", "Destroy a sandbox and everything in it.", DestroyArgs),
)
BY_NAME = {t.name: t for t in TOOLS}


def input_schema(args: type) -> dict[str, Any]:
    """The args Struct's JSON schema, inlined (no $ref: function-calling APIs want a plain object)."""
    schema = msgspec.json.schema(args)
    root: dict[str, Any] = schema["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    root.pop("title", None)
    if "$ref" in msgspec.json.encode(root).decode():
        raise TypeError(f"{args.__name__}: tool arguments must be flat (no nested Structs)")
    root.setdefault("required", [])
    root["additionalProperties"] = False
    return root


def openai_tools() -> list[dict[str, Any]]:
    """The tools as OpenAI chat-completions `tools` entries."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": input_schema(t.args)}}
            for t in TOOLS]


class ToolError(Struct, kw_only=True):
    code: str
    message: str


class ToolResult(Struct, kw_only=True, omit_defaults=True):
    text: str  # what the model reads
    data: dict[str, Any] | None = None  # the same, structured
    error: ToolError | None = None


def _failed(code: str, message: str) -> ToolResult:
    return ToolResult(text=f"error {code}: {message}", error=ToolError(code=code, message=message),
                      data={"error": {"code": code, "message": message}})


def _struct_dict(s: Struct) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(s)
    return d


class Toolbox:
    """Runs the tools against one corral. Sandboxes it created are destroyed by `close()` unless
    `keep_sandboxes`: a model that forgets `destroy` leaks nothing past the server's life."""

    def __init__(self, client: AsyncClient, *, keep_sandboxes: bool = False):
        self.client = client
        self.keep = keep_sandboxes
        self.created: dict[str, AsyncSandbox] = {}

    async def call(self, name: str, arguments: dict[str, Any] | str | bytes | None) -> ToolResult:
        """Validate `arguments` (a dict or JSON text) against the tool's Struct and run it."""
        tool = BY_NAME.get(name)
        if tool is None:
            return _failed("invalid_request", f"unknown tool {name!r}; the tools are {', '.join(BY_NAME)}")
        args: Struct
        try:
            if isinstance(arguments, (str, bytes)):
                args = msgspec.json.decode(arguments or b"{}", type=tool.args)
            else:
                args = msgspec.convert(arguments or {}, type=tool.args)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return _failed("invalid_request", f"{name}: bad arguments: {e}")
        try:
            run: Callable[[Struct], Awaitable[ToolResult]] = getattr(self, f"_{name}")  # the method named for the tool, taking its args Struct
            return await run(args)
        except CorralError as e:
            return _failed(e.code.value, e.message)

    def _sandbox(self, sid: str) -> AsyncSandbox:
        return self.created.get(sid) or self.client.sandbox(sid)

    @staticmethod
    def _created(sb: AsyncSandbox, **extra: Any) -> ToolResult:
        data = {"sandbox_id": sb.id, "image": sb.info.image, "node": sb.info.node, "expires_at": sb.info.expires_at, **extra}
        return ToolResult(text=f"sandbox {sb.id} is running ({sb.info.image})" + (f", workdir {extra['workdir']}" if extra.get("workdir") else ""),
                          data=data)

    async def _sandbox_create(self, a: SandboxCreateArgs) -> ToolResult:
        spec = SandboxSpec(image=a.image, cpu=a.cpu, memory_mb=a.memory_mb, ttl_s=a.ttl_s, env=a.env, workdir=a.workdir,
                           labels={"via": "corral-tools"})
        sb = await self.client.create_spec(spec, wait_for_capacity_s=60)
        self.created[sb.id] = sb
        return self._created(sb)

    async def _env_rollout(self, a: EnvRolloutArgs) -> ToolResult:
        env = await self.client.envs.get(a.name, a.version)
        sb = await self.client.envs.rollout(a.name, a.version, labels={"via": "corral-tools"})
        self.created[sb.id] = sb
        return self._created(sb, env=env.name, version=env.version, workdir=env.workdir or "", description=env.description)

    async def _exec(self, a: ExecArgs) -> ToolResult:
        r = await self._sandbox(a.sandbox_id).exec(a.command, cwd=a.cwd or None, timeout_s=a.timeout_s, session=a.session,
                                                   shell=a.shell, stdin=a.stdin)
        parts = [f"exit_code: {r.exit_code}" + (" (timed out)" if r.timed_out else "") + (" (output truncated)" if r.truncated else "")]
        if r.stdout:
            parts.append(f"stdout:\n{r.stdout}")
        if r.stderr:
            parts.append(f"stderr:\n{r.stderr}")
        data = {k: v for k, v in _struct_dict(r).items() if k in ("exit_code", "stdout", "stderr", "timed_out", "truncated", "duration_ms")}
        return ToolResult(text="\n".join(parts), data=data)

    async def _read_file(self, a: ReadFileArgs) -> ToolResult:
        raw = await self._sandbox(a.sandbox_id).files.read(a.path, max_bytes=a.max_bytes)
        try:
            text, encoding = raw.decode(), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(raw).decode(), "base64"
        return ToolResult(text=text if encoding == "utf-8" else f"(binary, base64)\n{text}",
                          data={"path": a.path, "content": text, "encoding": encoding, "size": len(raw)})

    async def _write_file(self, a: WriteFileArgs) -> ToolResult:
        data = a.content.encode()
        await self._sandbox(a.sandbox_id).files.write(a.path, data, a.mode)
        return ToolResult(text=f"wrote {len(data)} bytes to {a.path}", data={"path": a.path, "size": len(data)})

    async def _grade(self, a: GradeArgs) -> ToolResult:
        g = await self.client.envs.grade(a.sandbox_id, destroy=a.destroy)
        if a.destroy:
            self.created.pop(a.sandbox_id, None)
        lines = [f"reward {g.reward:g} (passed: {g.passed}): {g.reason}"]
        lines += [f"  {t.id}: {t.outcome}" for t in g.tests]
        lines += [f"  alert [{al.severity}] {al.rule}: {al.message}" for al in g.alerts]
        return ToolResult(text="\n".join(lines), data=_struct_dict(g))

    async def _destroy(self, a: DestroyArgs) -> ToolResult:
        await self._sandbox(a.sandbox_id).destroy()
        self.created.pop(a.sandbox_id, None)
        return ToolResult(text=f"sandbox {a.sandbox_id} destroyed", data={"sandbox_id": a.sandbox_id})

    async def close(self) -> None:
        """Destroy what this toolbox created and nobody destroyed (unless keep_sandboxes)."""
        if self.keep:
            return
        for sid, sb in list(self.created.items()):
            try:
                await sb.destroy()
            except NotFound:
                pass  # expired or destroyed by someone else: gone either way
            self.created.pop(sid, None)


__all__ = ["TOOLS", "ToolDef", "Toolbox", "ToolResult", "ToolError", "input_schema", "openai_tools"]
