"""`client.envs`: build, list, show, grade and start rollouts of environments (`corral.v1.env.*`).

Builds are long (set-up, a snapshot, four verification sandboxes): `build()` waits for the reply
and, when given `progress=`, calls it with every EnvProgress the builder publishes meanwhile."""
from __future__ import annotations

import builtins
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from corral_common.contract import subjects
from corral_common.contract.envs import (
    ENV_LABEL,
    ENV_VERSION_LABEL,
    EnvBuildReply,
    EnvBuildRequest,
    EnvBuildResult,
    EnvDeleteReply,
    EnvGetReply,
    EnvGradeReply,
    EnvGradeRequest,
    EnvGradeResult,
    EnvListReply,
    EnvListRequest,
    EnvProgress,
    EnvRecord,
    EnvRef,
    EnvSpec,
    ServiceSpec,
)
from corral_common.contract.errors import Unavailable
from corral_common.contract.messages import SandboxSpec

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from .client import AsyncClient, AsyncSandbox

ProgressCallback = Callable[[EnvProgress], Awaitable[None] | None]


class Envs:
    def __init__(self, client: AsyncClient):
        self.client = client

    async def build(self, spec: EnvSpec | dict[str, Any], *, job: str = "", progress: ProgressCallback | None = None,
                    timeout: float = 1800.0) -> EnvBuildResult:
        """Build and verify; `result.accepted` says whether it entered the catalog, `result.report`
        says which check failed and why."""
        if isinstance(spec, dict):
            spec = msgspec.convert(spec, type=EnvSpec)
        build_id = f"b-{secrets.token_hex(6)}"
        sub = None
        if progress is not None:
            async def on_msg(msg: Msg) -> None:
                try:
                    ev = msgspec.json.decode(msg.data, type=EnvProgress)
                except msgspec.DecodeError:
                    return
                out = progress(ev)
                if out is not None:
                    await out

            sub = await self.client.nc.subscribe(subjects.env_progress(build_id), cb=on_msg)
        try:
            r = await self.client.request(subjects.ENV_BUILD, EnvBuildRequest(spec=spec, job=job, build_id=build_id), EnvBuildReply, timeout)
            return r.build
        finally:
            if sub is not None:
                await sub.unsubscribe()

    async def list(self, prefix: str = "") -> list[EnvRecord]:
        return (await self.client.request(subjects.ENV_LIST, EnvListRequest(prefix=prefix), EnvListReply, 30)).envs

    async def get(self, name: str, version: str = "") -> EnvRecord:
        return (await self.client.request(subjects.ENV_GET, EnvRef(name=name, version=version), EnvGetReply, 30)).env

    async def versions(self, name: str) -> builtins.list[str]:
        return (await self.client.request(subjects.ENV_GET, EnvRef(name=name), EnvGetReply, 30)).versions

    async def delete(self, name: str, version: str = "") -> None:
        await self.client.request(subjects.ENV_DELETE, EnvRef(name=name, version=version), EnvDeleteReply, 60)

    async def rollout(self, name: str, version: str = "", *, job: str = "", labels: dict[str, str] | None = None,
                      wait_for_capacity_s: float = 120.0, **spec: Any) -> AsyncSandbox:
        """A fresh sandbox of the environment for an agent: its image, limits, workdir and canaries;
        labelled so that `grade()` finds the environment. `**spec` overrides SandboxSpec fields.
        A full or hot cluster is waited out for up to `wait_for_capacity_s` (0: fail at once)."""
        return await self.rollout_of(await self.get(name, version), job=job, labels=labels,
                                     wait_for_capacity_s=wait_for_capacity_s, **spec)

    async def rollout_of(self, env: EnvRecord, *, job: str = "", labels: dict[str, str] | None = None,
                         wait_for_capacity_s: float = 120.0, **spec: Any) -> AsyncSandbox:
        """`rollout` of a record already fetched (`get`): many rollouts of one version cost one
        catalog lookup, not one each."""
        lim = env.limits
        base = SandboxSpec(image=env.image, cpu=lim.cpu, memory_mb=lim.memory_mb, disk_mb=lim.disk_mb, pids_max=lim.pids_max,
                           ttl_s=lim.ttl_s, workdir=env.workdir, job=job, canaries=env.canaries,
                           labels={**(labels or {}), ENV_LABEL: env.name, ENV_VERSION_LABEL: env.version})
        sb = await self.client.create_spec(msgspec.structs.replace(base, **spec), wait_for_capacity_s=wait_for_capacity_s)
        try:
            await start_services(sb, env.services)
        except BaseException:
            with contextlib.suppress(Exception):
                await sb.destroy()
            raise
        return sb

    async def grade(self, sandbox: AsyncSandbox | str, *, destroy: bool = False, fail_on: str = "high",
                    require_monitor: bool = True, alert_wait_s: float = 10.0, timeout: float = 600.0,
                    name: str = "", version: str = "") -> EnvGradeResult:
        sid = sandbox if isinstance(sandbox, str) else sandbox.id
        req = EnvGradeRequest(sandbox_id=sid, name=name, version=version, destroy=destroy, fail_on=fail_on,  # type: ignore[arg-type]
                              require_monitor=require_monitor, alert_wait_s=alert_wait_s)
        return (await self.client.request(subjects.ENV_GRADE, req, EnvGradeReply, timeout)).grade


async def start_services(sb: AsyncSandbox, services: builtins.list[ServiceSpec]) -> None:
    """Start an environment's services in a fresh rollout, each in a session of its own (so it
    outlives the exec that started it) with its output in /tmp/corral-service-N.log, and wait
    until its `ready` command exits 0 (one exec looping inside the sandbox, not one per try).
    Raises Unavailable with the log's end when one does not come up in time."""
    for i, svc in enumerate(services):
        log = f"/tmp/corral-service-{i}.log"
        r = await sb.exec(f"({svc.cmd}) </dev/null >{log} 2>&1 &", session=f"corral-service-{i}", harness=svc.harness, timeout_s=30)
        if r.exit_code != 0:
            raise Unavailable(f"service {i} of the environment did not start (exit {r.exit_code}): {(r.stdout + r.stderr)[-500:]}")
        if not svc.ready:
            continue
        wait = (f"end=$(( $(date +%s) + {int(svc.ready_timeout_s + 0.999)} )); "
                f"until ({svc.ready}) >/dev/null 2>&1; do [ $(date +%s) -ge $end ] && exit 124; sleep 0.2; done")
        r = await sb.exec(wait, harness=svc.harness, timeout_s=svc.ready_timeout_s + 15)
        if r.exit_code != 0:
            tail = await sb.exec(f"tail -c 1500 {log}", harness=svc.harness, timeout_s=10)
            raise Unavailable(f"service {i} of the environment ({svc.cmd[:80]!r}) was not ready within {svc.ready_timeout_s:g}s "
                              f"(its ready command {svc.ready[:80]!r} never exited 0); its log ends with: {tail.stdout[-1500:]!r}")
