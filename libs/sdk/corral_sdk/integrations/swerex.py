"""A SWE-ReX deployment and runtime backed by a corral sandbox, so SWE-agent / SWE-smith code that
drives `AbstractDeployment` / `AbstractRuntime` runs on corral unchanged:

    deployment = CorralDeployment(image="debian", nats_url="nats://127.0.0.1:4222", cpu=1, memory_mb=1024)
    await deployment.start()
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    obs = await rt.run_in_session(BashAction(command="cd /repo && python3 -m pytest -q", timeout=60, check="silent"))
    await deployment.stop()

SWE-ReX's sessions are bash REPLs behind a pty; corral's are persistent `/bin/bash` shells
(ExecRequest `shell="bash"`) fed one sourced script per command, so cwd, exports and functions
carry over exactly as in a REPL. What differs, and why:
- a command that times out is killed with its whole process tree and the session restarts afresh
  (corral never leaves a runaway process behind); a later `BashInterruptAction` has nothing left to
  interrupt and answers an empty observation;
- stdin is /dev/null: interactive programs (`is_interactive_command`) are refused with a clear error;
- the output is stdout and stderr merged (`2>&1`), as a terminal shows them.

corral's errors become the SWE-ReX exception a caller already handles, carrying corral's `code`
and `message` (attributes `.corral_code`, `.corral_message`)."""
from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import re
import secrets
import shlex
import tarfile
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from corral_common.extras import require

require("swerex", "swerex", "the SWE-ReX backend")

from swerex.deployment.abstract import AbstractDeployment  # noqa: E402
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook  # noqa: E402
from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (  # noqa: E402
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from corral_common.contract.errors import CorralError, NotFound, Timeout  # noqa: E402
from corral_common.contract.messages import ExecResult, SandboxSpec  # noqa: E402

from .. import sync  # noqa: E402
from ..client import AsyncClient, AsyncSandbox  # noqa: E402

__all__ = ["CorralDeployment", "CorralRuntime", "CorralRexError", "CorralFileNotFoundError", "InteractiveCommandError"]

# corral's ceiling for one exec; SWE-ReX's `timeout=None` ("no timeout") becomes this
NO_TIMEOUT_S = 86400.0
# SWE-ReX's startup_timeout (1 s by default) times a local pexpect spawn; a session shell started
# over the bus on a busy node needs more, so the startup commands get at least this long
STARTUP_FLOOR_S = 30.0
# marks, on stderr, the bash -n diagnostics of a command that does not parse (never run)
_SYNTAX_MARK = "\x1ecorral-syntax\x1e"
_SESSION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class CorralRexError(SwerexException, RuntimeError):
    """A corral error with no closer SWE-ReX counterpart (invalid request, forbidden, capacity...)."""


class CorralFileNotFoundError(SwerexException, FileNotFoundError):
    """read_file of a path that does not exist: a FileNotFoundError, as LocalRuntime raises."""


class InteractiveCommandError(SwerexException, NotImplementedError):
    """is_interactive_command / is_interactive_quit: corral sessions read no terminal input."""


def _rex(cls: type[BaseException], e: CorralError, what: str = "") -> BaseException:
    """`cls` carrying corral's code and message (the original error is its __cause__)."""
    msg = f"{what}: " if what else ""
    exc = cls(f"{msg}corral {e.code.value}: {e.message}")
    exc.corral_code = e.code.value  # type: ignore[attr-defined]
    exc.corral_message = e.message  # type: ignore[attr-defined]
    return exc


def _raise(e: CorralError, what: str, not_found: type[BaseException] = CorralRexError) -> NoReturn:
    cls: type[BaseException] = CorralRexError
    if isinstance(e, Timeout):
        cls = CommandTimeoutError
    elif isinstance(e, NotFound):
        cls = not_found
    raise _rex(cls, e, what) from e


def session_name(name: str) -> str:
    """The corral session behind SWE-ReX session `name` (corral names are [A-Za-z0-9_.-]{1,128})."""
    if _SESSION_NAME.fullmatch(name):
        return f"rex-{name}"
    return f"rex-{hashlib.sha256(name.encode()).hexdigest()[:24]}"


def session_script(command: str) -> str:
    """The script the bash session sources for one BashAction: `bash -n` first (a command that
    does not parse raises BashIncorrectSyntaxError and runs nothing, as SWE-ReX checks before
    sending), then the command itself in the session's own shell with stderr merged into stdout.
    `return` leaves the sourced script, not the session."""
    eof = f"CORRAL_EOF_{secrets.token_hex(8)}"
    return (f"if ! __corral_syntax=$(bash -n 2>&1 <<'{eof}'\n{command}\n{eof}\n); then\n"
            f"  printf '{_SYNTAX_MARK}%s\\n' \"$__corral_syntax\" >&2; unset __corral_syntax; return 2\n"
            f"fi; unset __corral_syntax\n"
            f"{{ {command}\n}} 2>&1\n")


_T = TypeVar("_T")


async def _on(loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, _T]) -> _T:
    """Await `coro` on `loop` (None: here). SWE-agent calls every deployment and runtime method
    through its own `asyncio.run()`, a new event loop each time, while a NATS connection belongs
    to the loop it was made on: so the deployment keeps its connection on the SDK's background loop
    (the one the sync client uses) and each call crosses over to it."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class CorralRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface over one corral sandbox (see the module docstring)."""

    def __init__(self, sandbox: AsyncSandbox, *, loop: asyncio.AbstractEventLoop | None = None, logger: logging.Logger | None = None):
        """`loop`: the event loop `sandbox`'s connection lives on, when it is not the caller's (see _io)."""
        self.sandbox = sandbox
        self.logger = logger or logging.getLogger("corral.swerex")
        self._loop = loop
        self._sessions: dict[str, CreateBashSessionRequest] = {}

    async def _io(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return await _on(self._loop, coro)

    @property
    def sessions(self) -> dict[str, CreateBashSessionRequest]:
        return self._sessions

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await self._io(self.sandbox.refresh(timeout=timeout or 30.0))
        except CorralError as e:
            return IsAliveResponse(is_alive=False, message=f"corral {e.code.value}: {e.message}")
        if info.state != "running":
            return IsAliveResponse(is_alive=False, message=f"sandbox {info.id} is {info.state}")
        return IsAliveResponse(is_alive=True)

    async def _session_exec(self, name: str, script: str, timeout: float) -> ExecResult:
        try:
            return await self._io(self.sandbox.exec(script, session=session_name(name), shell="bash", timeout_s=min(timeout, NO_TIMEOUT_S)))
        except CorralError as e:
            _raise(e, f"session {name!r}")

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        cmds = [f"source {shlex.quote(p)}" for p in request.startup_source] or ["true"]
        r = await self._session_exec(request.session, "; ".join(cmds), max(request.startup_timeout, STARTUP_FLOOR_S))
        if r.timed_out:
            raise CommandTimeoutError(f"timeout after {request.startup_timeout} seconds while starting session {request.session!r}")
        self._sessions[request.session] = request
        return CreateBashSessionResponse(output=r.stdout + r.stderr)

    async def run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        if action.session not in self._sessions:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if isinstance(action, BashInterruptAction):
            # a command that timed out was killed with its process tree; nothing is left running
            return BashObservation(output="", exit_code=0)
        if action.is_interactive_command or action.is_interactive_quit:
            raise InteractiveCommandError("interactive commands are not supported on corral: a session's stdin is /dev/null; "
                                          "run the program non-interactively (e.g. with its input in a file or a heredoc)")
        timeout = action.timeout if action.timeout is not None else NO_TIMEOUT_S
        r = await self._session_exec(action.session, session_script(action.command), timeout)
        if _SYNTAX_MARK in r.stderr:
            err = r.stderr.split(_SYNTAX_MARK, 1)[1]
            raise BashIncorrectSyntaxError(
                f"Error (exit code {r.exit_code}) while checking bash command \n{action.command!r}\n---- Stderr ----\n{err}\n---- Stdout ----\n",
                extra_info={"bash_stdout": "", "bash_stderr": err})
        if r.timed_out:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {action.command!r}")
        output = r.stdout + r.stderr  # stderr holds only corral's notes (OOM kill): the command's went to stdout
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None)
        if action.check == "raise" and r.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n{output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=output, exit_code=r.exit_code)

    async def close_session(self, request: CloseSessionRequest) -> CloseBashSessionResponse:
        if request.session not in self._sessions:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        del self._sessions[request.session]
        await self._session_exec(request.session, "exit 0", 30.0)  # the shell ends; corral forgets the session
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """Like subprocess.run: a list is an argv, a string with shell=True is `/bin/sh -c`. `env`
        is added to the sandbox's environment (not a replacement of it)."""
        cmd = command.command
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd] if command.shell else [cmd]
        else:
            argv = ["/bin/sh", "-c", *cmd] if command.shell else list(cmd)
        if command.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        timeout = command.timeout if command.timeout is not None else NO_TIMEOUT_S
        try:
            r = await self._io(self.sandbox.exec(argv, env=command.env, cwd=command.cwd, timeout_s=min(timeout, NO_TIMEOUT_S)))
        except CorralError as e:
            _raise(e, f"command {cmd!r}")
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        if command.check and r.exit_code != 0:
            msg = f"Command {cmd!r} failed with exit code {r.exit_code}. Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}"
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await self._io(self.sandbox.files.read(request.path))
        except CorralError as e:
            _raise(e, f"read {request.path}", not_found=CorralFileNotFoundError)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        try:
            await self._io(self.sandbox.files.write(request.path, request.content))  # parents are made, as LocalRuntime does
        except CorralError as e:
            _raise(e, f"write {request.path}")
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file is written at target_path; a directory becomes target_path (copytree). What
        does not fit one bus message goes over the files API in parts joined in the sandbox (a
        directory as one gzip'd tar, unpacked there)."""
        src, target = request.source_path, request.target_path
        if not os.path.exists(src):
            raise FileNotFoundError(f"upload source {src} does not exist")
        try:
            if os.path.isdir(src):
                parts = await self._put_parts(await asyncio.to_thread(_tar_dir, src))
                q = " ".join(shlex.quote(p) for p in parts)
                await self._run_checked(f"mkdir -p {shlex.quote(target)} && cat {q} | tar -xzf - -C {shlex.quote(target)}; rc=$?; rm -f {q}; exit $rc",
                                        f"unpacking {src} into {target}")
                return UploadResponse()
            with open(src, "rb") as f:
                data = f.read()
            mode = os.stat(src).st_mode & 0o7777
            if len(data) <= self._part_size():
                await self._io(self.sandbox.files.write(target, data, mode))
                return UploadResponse()
            parts = await self._put_parts(data)
            q, t = " ".join(shlex.quote(p) for p in parts), shlex.quote(target)
            await self._run_checked(f'mkdir -p "$(dirname {t})" && cat {q} > {t} && chmod {mode:o} {t}; rc=$?; rm -f {q}; exit $rc',
                                    f"joining the parts of {target}")
        except CorralError as e:
            _raise(e, f"upload {src} to {target}")
        return UploadResponse()

    def _part_size(self) -> int:
        """The most file bytes one files.write message carries (base64 grows them by 4/3)."""
        return max(64 * 1024, (self.sandbox.client.nc.max_payload - 8192) * 3 // 4)

    async def _put_parts(self, data: bytes) -> list[str]:
        """`data` in /tmp of the sandbox as parts of at most one message each; their paths, in order."""
        prefix, size = f"/tmp/.corral-upload-{secrets.token_hex(6)}", self._part_size()
        paths: list[str] = []
        for i in range(0, max(len(data), 1), size):
            paths.append(f"{prefix}.{len(paths)}")
            await self._io(self.sandbox.files.write(paths[-1], data[i:i + size], 0o600))
        return paths

    async def _run_checked(self, script: str, what: str) -> None:
        r = await self._io(self.sandbox.exec(script, timeout_s=600))
        if r.exit_code != 0:
            raise CorralRexError(f"{what} failed (exit {r.exit_code}): {r.stderr.strip()[-2000:]}")

    async def close(self) -> CloseResponse:
        for name in list(self._sessions):
            try:
                await self.close_session(CloseSessionRequest(session=name))
            except SwerexException:
                pass  # the sandbox may already be gone; it takes its sessions with it
        return CloseResponse()


def _tar_dir(src: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(src, arcname=".")
    return buf.getvalue()


class CorralDeployment(AbstractDeployment):
    """SWE-ReX deployment = one corral sandbox: `start()` creates it (waiting out a full cluster
    for up to `wait_for_capacity_s`), `stop()` destroys it. `**spec` are SandboxSpec fields
    (disk_mb, ttl_s, job, labels, workdir, env, pids_max, ...). Its connection lives on the SDK's
    background loop, so any event loop may call it (SWE-agent makes one per call); `client=` shares
    a connection of the caller's instead, and then every call must come from that client's loop."""

    def __init__(self, *, image: str = "debian", nats_url: str | None = None, substrate: str = "container", cpu: float = 1.0,
                 memory_mb: int = 1024, client: AsyncClient | None = None, wait_for_capacity_s: float = 120.0,
                 logger: logging.Logger | None = None, **spec: Any):
        self.logger = logger or logging.getLogger("corral.swerex")
        self._spec = SandboxSpec(image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb, **spec)  # type: ignore[arg-type]
        self._nats_url = nats_url
        self._client = client
        self._own_client = client is None
        self._loop: asyncio.AbstractEventLoop | None = None if client is not None else sync._Loop.get()
        self._wait_s = wait_for_capacity_s
        self._sandbox: AsyncSandbox | None = None
        self._runtime: CorralRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]  # swe-rex leaves its __init__ unannotated
        return self._sandbox

    @property
    def runtime(self) -> CorralRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]  # swe-rex leaves its __init__ unannotated
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        self._hooks.on_custom_step(f"Starting a corral sandbox of {self._spec.image}")
        try:
            if self._client is None:
                self._client = await _on(self._loop, AsyncClient.connect(self._nats_url))
            self._sandbox = await _on(self._loop, self._client.create_spec(self._spec, wait_for_capacity_s=self._wait_s))
        except CorralError as e:
            await self._close_client()
            raise _rex(DeploymentStartupError, e, "corral sandbox") from e
        self._runtime = CorralRuntime(self._sandbox, loop=self._loop, logger=self.logger)
        self.logger.info("corral sandbox %s started on %s", self._sandbox.id, self._sandbox.info.node)

    async def stop(self) -> None:
        """Destroy the sandbox (its sessions with it); safe to call twice or before start."""
        sb, self._sandbox, self._runtime = self._sandbox, None, None
        try:
            if sb is not None:
                try:
                    await _on(self._loop, sb.destroy())
                except NotFound:
                    pass  # expired or destroyed already: the end state is the one asked for
        finally:
            await self._close_client()

    async def _close_client(self) -> None:
        if self._own_client and self._client is not None:
            c, self._client = self._client, None
            await _on(self._loop, c.close())

    def __del__(self) -> None:
        # AbstractDeployment.__del__ schedules stop() on whatever loop is current; only worth it
        # when a sandbox is still held
        if getattr(self, "_sandbox", None) is not None:
            super().__del__()  # type: ignore[no-untyped-call]  # swe-rex leaves __del__ unannotated
