"""The substrate interface: every way of running a sandbox (runc container, one-shot function,
Docker, later microVMs) is one class with these async methods and a registry entry."""
from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, ClassVar

import msgspec

from corral_common.contract.errors import InvalidRequest
from corral_common.contract.messages import ChangesReply, ChangesRequest, ExecRequest, ExecResult, SandboxInfo, SandboxSpec

if TYPE_CHECKING:
    from corral_common.contract.images import GuestMemory
    from corral_common.layers import ImageManifest, LayerManifest

    from ..cgroups import Cgroups
    from ..masks import Mask

ChunkCallback = Callable[[str, bytes], None]


class Usage(msgspec.Struct, kw_only=True):
    cpu_ns: int = 0
    memory_bytes: int = 0
    pids: int = 0


class Sandbox:
    """What the agent knows about a live sandbox; substrates subclass it for their own state.
    The class attributes below are what the agent reads of any sandbox; a substrate that has the
    thing sets it on its instances, the others keep the default."""

    #: host path of the sandbox's root filesystem, which the agent reads for protected paths and
    #: canaries (file audit); None: no root the host can see
    rootfs: str | None = None
    #: the sandbox's cgroup when corral made it (limits, usage, OOM and pids-limit counters);
    #: None: the agent asks the substrate for usage and reads no limit counters
    cg: Cgroups | None = None
    #: protected paths covered by decoys inside the sandbox (masks.py), so the file audit can
    #: tell a decoy's activity from the real file's
    masks: Sequence[Mask] = ()
    #: the internal id it ran under in a warm pool before a create claimed it ("" if built cold)
    warm_id: str = ""
    #: frozen by its substrate's pause (and not yet resumed)
    paused: bool = False
    #: execs in flight (handlers/ops.py caps them per sandbox)
    running_execs: int = 0

    def __init__(self, info: SandboxInfo, spec: SandboxSpec):
        self.info = info
        self.spec = spec
        # freeze-and-read operations on one sandbox take turns (`changes`: Substrate.frozen_changes;
        # snapshots: snapshot.py)
        self.changes_lock = asyncio.Lock()

    @property
    def id(self) -> str:
        return self.info.id


class GuardedOpen(msgspec.Struct, frozen=True):
    """What a substrate guarding its sandboxes itself saw (`Substrate.guard_paths`): an open of a
    guarded path, `kind` "p" a protected one (`denied`), "c" a canary; or file activity, `kind`
    "open", "write" or "exec"; or "dropped" / "overflow", activity lost to the rate limit or the
    kernel's queue (`path`: how many, when known). `who` whose open: an exec's or a session's
    name, "read" for the node's files.read, "?" for a process gone before it could be told."""
    kind: str
    pid: int
    denied: bool
    who: str
    comm: str
    path: str


class AdoptReport(msgspec.Struct, kw_only=True):
    adopted: list[str] = []
    cleaned: list[str] = []
    notes: list[str] = []


class Substrate(abc.ABC):
    name: ClassVar[str]
    #: whether its sandboxes' denied syscalls can go to the agent's seccomp-notify listener
    #: (audit/seccomp.py) to be answered and audited; if so the agent sets `seccomp_listener`
    #: and `seccomp_fds` before `start`, and hands adopted sandboxes' fds back (`take_notify_fd`)
    supports_seccomp_notify: ClassVar[bool] = False
    #: protected paths (masked by decoys, opens audited) and canaries (planted, reads audited)
    #: are enforced on its sandboxes; specs asking for them elsewhere are refused
    protects_paths: ClassVar[bool] = False
    #: enforces them inside its sandboxes itself (a guest's own kernel: `guard_paths`), not
    #: through the node's fanotify group on a root the host sees
    guards_paths: ClassVar[bool] = False
    #: the listener's socket path; None keeps denied syscalls SCMP_ACT_ERRNO, unaudited
    seccomp_listener: str | None = None
    #: that listener's notify fds by sandbox id
    seccomp_fds: dict[str, int] | None = None
    #: snapshots are whole images the substrate makes (`snapshot_image`; docker: commit, save,
    #: import) instead of a writable layer the agent packs (`snapshot_dir`)
    snapshots_itself: ClassVar[bool] = False
    #: the host cgroup its sandboxes are made under ('' none of its own); removed when the node stops for good
    cgroup_parent: str = ""
    #: snapshots may hold the processes' memory too (SnapshotRequest.memory: `save_memory`)
    snapshots_memory: ClassVar[bool] = False
    #: why not, for the error a `memory: true` snapshot gets
    memory_snapshot_gap: ClassVar[str] = "a container's processes cannot be saved (no CRIU on this kernel)"

    async def start(self) -> None:
        """Check prerequisites; raise with a clear message when this substrate cannot run here."""

    def warm_serves(self, spec: SandboxSpec) -> bool:
        """Whether a warm-pool sandbox of this substrate (`create_warm`) can become a sandbox of
        `spec` (`claim_warm`); False for substrates without warm pools."""
        return False

    async def create_warm(self, image: str) -> Sandbox:
        """A sandbox of `image` built ahead under an internal id and paused, for a warm pool."""
        raise InvalidRequest(f"substrate {self.name!r} has no warm pools")

    async def claim_warm(self, sb: Sandbox, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        """Turn the warm sandbox `sb` into the running sandbox `info.id` of `spec`; on failure
        it is torn down and the error raised (the caller builds a cold one)."""
        raise InvalidRequest(f"substrate {self.name!r} has no warm pools")

    @abc.abstractmethod
    async def create(self, info: SandboxInfo, spec: SandboxSpec) -> Sandbox: ...

    @abc.abstractmethod
    async def exec(self, sb: Sandbox, req: ExecRequest, on_chunk: ChunkCallback | None) -> ExecResult: ...

    @abc.abstractmethod
    async def read_file(self, sb: Sandbox, path: str, max_bytes: int) -> tuple[bytes, int]: ...

    @abc.abstractmethod
    async def write_file(self, sb: Sandbox, path: str, data: bytes, mode: int, make_parents: bool) -> None: ...

    @abc.abstractmethod
    async def pause(self, sb: Sandbox) -> None: ...

    @abc.abstractmethod
    async def resume(self, sb: Sandbox) -> None: ...

    @abc.abstractmethod
    async def destroy(self, sb: Sandbox) -> None: ...

    async def guard_paths(self, sb: Sandbox, on_open: Callable[[GuardedOpen], None],
                          activity: tuple[float, float] | None = None) -> None:
        """Deny the sandbox's protected paths and watch its canaries (`guards_paths`), every open
        reported to `on_open`, and with `activity` (events/s, burst) its file activity too;
        returns once they are guarded."""
        raise InvalidRequest(f"substrate {self.name!r} does not guard paths itself")

    async def audit_barrier(self, sb: Sandbox) -> None:
        """Return once every event the sandbox's own audit sources (a guest's guard) sent before
        now has been handed on: the `audit` op's consistent point."""

    def settle(self, sb: Sandbox) -> None:
        """Finish the bookkeeping a create left for after its reply (records, runtime state that
        nothing reads until a later operation). Idempotent; operations that need it call it."""

    def snapshot_dir(self, sb: Sandbox) -> AbstractAsyncContextManager[tuple[str, list[str]]]:
        """While entered: the sandbox's writable layer as a directory in overlayfs format
        (whiteouts as 0/0 devices), and the image layers below it. The caller freezes the sandbox
        around reading it."""
        raise InvalidRequest(f"substrate {self.name!r} cannot snapshot")

    async def snapshot_image(self, sb: Sandbox, name: str, labels: dict[str, str]) -> tuple[ImageManifest, LayerManifest, int]:
        """For substrates that `snapshots_itself`: the sandbox as the image `name` (registered in
        the catalog), its top layer and the bytes uploaded."""
        raise InvalidRequest(f"substrate {self.name!r} does not make its own snapshot images")

    async def save_memory(self, sb: Sandbox, fd: int) -> tuple[GuestMemory, list[str]]:
        """For substrates that `snapshots_memory`: write the running sandbox's memory and device
        state into `fd` (a pipe whose other end the caller drains and uploads meanwhile); the
        sandbox runs on after, or stays paused if it was. Returns what a restore needs (its
        `layer` left for the caller to fill) and the image layers under it."""
        raise InvalidRequest(f"substrate {self.name!r} cannot snapshot memory: {self.memory_snapshot_gap}")

    async def connect_port(self, sb: Sandbox, port: int) -> socket.socket:
        """A non-blocking TCP socket connected to 127.0.0.1:`port` in the sandbox's own network
        namespace: the node's end of a port forward. It opens no route into the sandbox; the
        bytes travel over the bus (corral_common/tunnel.py)."""
        raise InvalidRequest(f"substrate {self.name!r} cannot forward ports (the container substrate can)")

    def take_notify_fd(self, sb: Sandbox) -> int | None:
        """For substrates that `supports_seccomp_notify`: the seccomp notify fd of a sandbox
        adopted after a restart, taken back from where it was kept (None: none was kept)."""
        return None

    async def changes(self, sb: Sandbox, req: ChangesRequest) -> ChangesReply:
        """What the sandbox changed against its image, read host-side (nothing inside the sandbox
        is trusted to list or pack it), and the regular files and symlinks under `req.include`
        as a gzip'd tar. The sandbox is frozen while it is read, unless it cannot be."""
        raise InvalidRequest(f"substrate {self.name!r} cannot list changes")

    async def frozen_changes(self, sb: Sandbox, upper: str, req: ChangesRequest) -> ChangesReply:
        """`changes` for substrates whose writable layer is an overlay upper directory the host
        sees: frozen (this substrate's pause) while it is walked, thawed after unless it was
        paused before. Requests for one sandbox take turns, so one's thaw cannot land in the
        middle of another's walk."""
        from ..changes import list_changes

        async with self.frozen(sb):
            return await asyncio.to_thread(list_changes, upper, req)

    @contextlib.asynccontextmanager
    async def frozen(self, sb: Sandbox) -> AsyncIterator[None]:
        """The sandbox frozen (this substrate's pause) while its files are read, thawed after
        unless it was paused before. Reads of one sandbox take turns (`changes_lock`), so one's
        thaw cannot land in the middle of another's read."""
        async with sb.changes_lock:
            was_paused = sb.paused
            if not was_paused:
                await self.pause(sb)
            try:
                yield
            finally:
                if not was_paused:
                    await self.resume(sb)

    async def fork(self, source: Sandbox, info: SandboxInfo, spec: SandboxSpec) -> Sandbox:
        """A new sandbox `info` on this node whose files start as a copy of the running `source`'s
        (SandboxSpec.fork_of); the caller checked that the source may be forked by this request."""
        raise InvalidRequest(f"substrate {self.name!r} cannot fork sandboxes (the container substrate can)")

    @abc.abstractmethod
    async def usage(self, sb: Sandbox) -> Usage: ...

    async def run(self, info: SandboxInfo, spec: SandboxSpec, req: ExecRequest,
                  on_chunk: ChunkCallback | None) -> tuple[ExecResult, Callable[[], Awaitable[None]]]:
        """One-shot (`corral.v1.sandbox.run`): a fresh sandbox, one exec, then gone.

        Returns the result and a finaliser that removes the sandbox; the agent replies first and
        then awaits the finaliser, so teardown is off the caller's clock. A substrate may set
        `info.id` (the `function` substrate hands out sandboxes prepared ahead under their own
        id). The default is this substrate's own create, exec and destroy."""
        sb = await self.create(info, spec)
        try:
            async with self.watch_run(sb.info, self.audit_root(sb)):
                result = await self.exec(sb, req, on_chunk)
        except BaseException:
            await asyncio.shield(self.destroy(sb))
            raise
        return result, lambda: self.destroy(sb)

    #: set by the agent: starts auditing a one-shot run's file activity (given the run's info and
    #: its root) and returns what stops it; None: one-shot runs are not watched
    run_watcher: Callable[[SandboxInfo, str], Awaitable[Callable[[], None]]] | None = None

    @contextlib.asynccontextmanager
    async def watch_run(self, info: SandboxInfo, root: str | None) -> AsyncIterator[None]:
        """Around a one-shot run's command: its file activity audited like a sandbox's (a run is
        a sandbox too, and one-shot graders are where a cheat would hide)."""
        stop = await self.run_watcher(info, root) if self.run_watcher is not None and root else None
        try:
            yield
        finally:
            if stop is not None:
                stop()

    #: `spec.image` names an image in corral's catalog (checked by the agent before create);
    #: False for substrates that resolve images themselves (docker: local Docker images)
    uses_catalog: ClassVar[bool] = True

    def limit_counters(self, sb: Sandbox) -> tuple[int, int, str] | None:
        """(OOM kills, pids-limit hits, pids limit) so far, from the sandbox's cgroup; None when the
        substrate has no cgroup to read. The agent turns increases into `oom`/`pids` audit events."""
        cg = sb.cg
        if cg is None:
            return None
        return cg.oom_kills(), cg.pids_max_hits(), cg.pids_max()

    def audit_root(self, sb: Sandbox) -> str | None:
        """The host path of the sandbox's root filesystem mount, whose file activity the agent
        audits (audit/files.py); None when there is none to watch."""
        return sb.rootfs

    def watch_exit(self, sb: Sandbox, callback: Callable[[Sandbox], None]) -> None:
        """Call `callback` if the sandbox dies on its own (not through destroy)."""

    async def reconcile(self) -> tuple[list[Sandbox], AdoptReport]:
        """Find what a crashed predecessor left: adopt live sandboxes, clean up the rest."""
        return [], AdoptReport()

    async def close(self) -> None:
        pass
