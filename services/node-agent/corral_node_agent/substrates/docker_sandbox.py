"""What a `docker` sandbox is to the node-agent: its state (DockerSandbox, and the record a
restarted agent adopts it from), where its cgroup is, and corral's error for Docker's."""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from corral_common.contract.errors import Conflict, CorralError, Forbidden, Internal, InvalidRequest, NotFound, Unavailable
from corral_common.contract.messages import SandboxInfo, SandboxSpec

from .. import cgroups
from .common import StayingSandbox

if TYPE_CHECKING:
    from .docker_exec import Bridge


class Record(msgspec.Struct, kw_only=True):
    info: SandboxInfo
    spec: SandboxSpec
    container_id: str
    image_ref: str
    layer_dir: str = ""  # the overlay2 layer dir whose tmpfs caps the writable layer (disk_mb)


class DockerSandbox(StayingSandbox):
    """A Docker container: its id and image, its init (tini) pid, cgroup and overlay2 dirs once it
    runs, and the exec streams behind its sessions."""

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, container, cid: str, sdir: str, image_ref: str):
        super().__init__(info, spec, sdir, None)  # cg and pidfd: from _attach, once it runs
        self.container = container
        self.cid = cid
        self.image_ref = image_ref
        self.init_pid = 0
        self.merged = ""  # the container's overlay2 merged dir (file-activity audit)
        self.session_links: dict[str, Bridge] = {}
        self.layer_dir = ""


def cgroup_rel(pid: int) -> str:
    """The container's cgroup path (the same in every v1 hierarchy for Docker's cgroupfs driver)."""
    rel = ""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            if "pids" in ctrl.split(",") or (ctrl == "" and cgroups.is_v2()):
                rel = path
                if ctrl:
                    break
    if not rel or rel == "/":
        raise Internal(f"cannot find the cgroup of docker container process {pid}")
    return rel


def docker_error(e, what: str) -> CorralError:
    """corral's error for a DockerError (`e`) in doing `what`, by its HTTP status."""
    msg = f"docker: {what}: {e.message}"
    if e.status == 404:
        return NotFound(msg)
    if e.status == 409:
        return Conflict(msg)
    if e.status == 400:
        return InvalidRequest(msg)
    if e.status == 403:
        return Forbidden(msg)
    return Unavailable(msg)
