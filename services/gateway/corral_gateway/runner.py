"""One `/run_code` request as corral calls: the translation both ways.

Without `fetch_files` a run is one `corral.v1.sandbox.run` on the `function` substrate (corral's
lightest path, audited like any exec). With `fetch_files` it is a `container` sandbox created,
exec'd once, read back with `files.read` and destroyed: a function call answers only the exit
status and the output, so files could come back from it only multiplexed into stdout, where the
program could forge them and truncation could cut them off. Both paths run the same command (see
languages.py), so a request answers the same either way. A compiled language always takes the
container path: the compiler and the program are two execs, each answering for itself."""
from __future__ import annotations

import asyncio
import base64
import binascii
import posixpath
import time
from dataclasses import dataclass, field

from corral_common.contract import labels, subjects
from corral_common.contract.errors import InvalidRequest, NotFound
from corral_common.contract.messages import ExecRequest, ExecResult, RunRequest, RunSpec, SandboxSpec, encoder
from corral_common.contract.replies import RunReply
from corral_sdk.client import AsyncClient

from .admission import Admission
from .languages import WORKDIR, Language, Program, binary, check_path, language, program
from .models import CommandRunResult, RunCodeRequest, RunCodeResponse

ADAPTER = "sandbox-fusion"
MAX_OUTPUT = 1024 * 1024  # per stream, as SandboxFusion captures at most 1 MiB of each
MAX_FETCH = 4 * 1024 * 1024  # one fetched file (the reply travels on the bus, 8 MB at most)
MIN_MEMORY_MB = 16


@dataclass
class RunnerConfig:
    image: str = "debian"  # python, pytest, bash
    toolchain_image: str = "toolchain"  # the other languages (languages.py)
    cpu: float = 1.0
    memory_mb: int = 1024  # when a request sets no memory_limit_MB
    disk_mb: int = 1024
    job: str = "sandbox-fusion"
    capacity_wait_s: float = 120.0  # a run waits this long for room (see admission.py) before its `capacity` answer becomes HTTP 429
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    response: RunCodeResponse
    bus_s: float  # time spent waiting on the bus (the rest is the gateway's own)
    substrate: str


def _files(req: RunCodeRequest) -> dict[str, str]:
    out: dict[str, str] = {}
    for path, b64 in req.files.items():
        if b64 is None or "IGNORE_THIS_FILE" in path:  # as SandboxFusion's restore_files
            continue
        check_path(path, "file")
        try:
            base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"files[{path!r}] is not valid base64") from None
        out[path] = b64
    return out


def command_result(r: ExecResult) -> CommandRunResult:
    """SandboxFusion's CommandRunResult: TimeLimitExceeded carries no return code; a process killed
    by a signal has the negative signal number, as Python's subprocess reports it there."""
    secs = round(r.duration_ms / 1000, 6)
    if r.timed_out:
        return CommandRunResult(status="TimeLimitExceeded", execution_time=secs, stdout=r.stdout, stderr=r.stderr)
    rc = -r.signal if r.signal else r.exit_code
    return CommandRunResult(status="Finished", execution_time=secs, return_code=rc, stdout=r.stdout, stderr=r.stderr)


class Runner:
    def __init__(self, client: AsyncClient, cfg: RunnerConfig):
        self.client = client
        self.cfg = cfg
        self.labels = {labels.ADAPTER: ADAPTER, **cfg.labels}
        self.admission = Admission(cfg.capacity_wait_s)

    def memory_mb(self, req: RunCodeRequest) -> int:
        m = req.memory_limit_MB
        if m <= 0:
            return self.cfg.memory_mb
        if m < MIN_MEMORY_MB or m > 1_048_576:
            raise InvalidRequest(f"memory_limit_MB={m}: a sandbox needs {MIN_MEMORY_MB} to 1048576 MB (or -1 for the gateway's default)")
        return m

    async def run(self, req: RunCodeRequest) -> Outcome:
        lang = language(req.language)
        files = _files(req)
        fetch = [check_path(p, "fetch_files entry") for p in req.fetch_files]
        prog = program(lang, req.code, files, req.args)
        memory = self.memory_mb(req)
        try:
            if fetch or lang.compiler:
                return await self._run_container(req, lang, prog, memory, fetch)
            return await self._run_function(req, lang, prog, memory)
        except NotFound as e:
            image = self.image(lang)
            if repr(image) not in e.message:
                raise
            raise NotFound(f"{e.message} (language {lang.name!r} runs in image {image!r}; `corral image build {image}` "
                           "builds and imports it if it is a built-in one)") from None

    def image(self, lang: Language) -> str:
        return self.cfg.toolchain_image if lang.toolchain else self.cfg.image

    async def _run_function(self, req: RunCodeRequest, lang: Language, prog: Program, memory: int) -> Outcome:
        spec = RunSpec(image=self.image(lang), substrate="function", cpu=self.cfg.cpu, memory_mb=memory, disk_mb=self.cfg.disk_mb,
                       workdir=WORKDIR, job=self.cfg.job, labels=self.labels)
        ex = ExecRequest(cmd=prog.argv, stdin=req.stdin or "", env=prog.env, timeout_s=req.run_timeout, max_output_bytes=MAX_OUTPUT)
        payload = encoder.encode(RunRequest(spec=spec, exec=ex))
        t0 = time.perf_counter()
        reply = await self.admission.run(lambda: self.client.request(subjects.SANDBOX_RUN, payload, RunReply, req.run_timeout + 45))
        bus_s = time.perf_counter() - t0
        return Outcome(self._response(reply.result, f"{reply.node}/{reply.sandbox_id}", {}), bus_s, "function")

    async def _run_container(self, req: RunCodeRequest, lang: Language, prog: Program, memory: int, fetch: list[str]) -> Outcome:
        ttl = req.run_timeout + (req.compile_timeout if lang.compiler else 0) + 300
        spec = SandboxSpec(image=self.image(lang), substrate="container", cpu=self.cfg.cpu, memory_mb=memory, disk_mb=self.cfg.disk_mb,
                           workdir=WORKDIR, job=self.cfg.job, labels=self.labels, ttl_s=ttl)
        t0 = time.perf_counter()
        return await self.admission.run(lambda: self._container_run(req, lang, prog, spec, fetch, t0))

    async def _container_run(self, req: RunCodeRequest, lang: Language, prog: Program, spec: SandboxSpec, fetch: list[str],
                             t0: float) -> Outcome:
        sb = await self.client.create_spec(spec)
        try:
            compiled: CommandRunResult | None = None
            result: ExecResult | None = None
            if lang.compiler:
                c = await sb.exec(prog.argv, env=prog.env, timeout_s=req.compile_timeout, max_output_bytes=MAX_OUTPUT)
                compiled = command_result(c)
                if compiled.status == "Finished" and compiled.return_code == 0:
                    result = await sb.exec([binary(prog.code_file)], stdin=req.stdin or "", timeout_s=req.run_timeout,
                                           max_output_bytes=MAX_OUTPUT)
            else:
                result = await sb.exec(prog.argv, stdin=req.stdin or "", env=prog.env, timeout_s=req.run_timeout,
                                       max_output_bytes=MAX_OUTPUT)
            fetched: dict[str, str] = {}
            for name in fetch:
                try:
                    data = await sb.files.read(posixpath.join(WORKDIR, name), max_bytes=MAX_FETCH)
                except (NotFound, InvalidRequest):  # missing, a directory, too large: left out, as SandboxFusion leaves out what is not a file
                    continue
                fetched[name] = base64.b64encode(data).decode()
        finally:
            await asyncio.shield(self._destroy(sb))
        bus_s = time.perf_counter() - t0
        return Outcome(self._response(result, f"{sb.info.node}/{sb.id}", fetched, compiled), bus_s, "container")

    async def _destroy(self, sb) -> None:
        try:
            await sb.destroy()
        except NotFound:  # already gone (expired): nothing left to remove
            pass

    @staticmethod
    def _response(result: ExecResult | None, pod: str, files: dict[str, str], compiled: CommandRunResult | None = None) -> RunCodeResponse:
        """SandboxFusion's answer: `Success` only if every step finished with status 0; a failed
        compile answers its compile_result and no run_result."""
        run = None if result is None else command_result(result)
        ok = run is not None and run.status == "Finished" and run.return_code == 0
        return RunCodeResponse(status="Success" if ok else "Failed", message="", compile_result=compiled, run_result=run,
                               executor_pod_name=pod, files=files)
