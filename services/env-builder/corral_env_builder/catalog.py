"""The environment catalog in NATS KV: `<name>.<version>` -> StoredEnv.

A version is reserved (`building`) with a KV create before its build starts, so two builders
racing on the next version of one name never both take it; a failed build releases it. What is
stored includes the protected content (hidden tests, solution); only EnvRecord leaves the builder."""
from __future__ import annotations

import logging
import time
from typing import Literal

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from corral_common import bus, logs
from corral_common.contract import subjects
from corral_common.contract.envs import EnvRecord, Solution
from corral_common.contract.errors import Conflict, NotFound

from .testrun import RunnerPlan

log = logging.getLogger("corral.env-builder")

STALE_BUILD_S = 3 * 3600  # a reservation older than this belongs to a builder that died mid-build


class StoredEnv(msgspec.Struct, kw_only=True, omit_defaults=True):
    state: Literal["building", "accepted"]
    record: EnvRecord
    hidden_files: dict[str, str] = {}  # absolute path -> content
    solution: Solution = msgspec.field(default_factory=Solution)
    grader_files: dict[str, str] = {}  # visible files put back (as built) before grading
    reserved_at: float = 0.0
    # how grading runs the tests, and which must pass (private: test names say what hidden tests check)
    plan: RunnerPlan | None = None  # None: an environment built before per-test grading (command)
    fail_to_pass: list[str] = []
    pass_to_pass: list[str] = []
    test_files: list[str] = []  # absolute paths of the files defining the named tests (grader-owned)


def key(name: str, version: str) -> str:
    return f"{name}.{version}"


def latest_key(name: str) -> str:
    return f"{name}._latest"  # versions start with [0-9a-z]: no clash


class EnvCatalog:
    def __init__(self, kv: KeyValue):
        self.kv = kv

    @classmethod
    async def open(cls, js, moved_from=None) -> EnvCatalog:
        """The catalog in `js`'s account; with `moved_from` (the account it was kept in before it
        had one of its own), what is still there is moved over first, then that bucket deleted."""
        cat = cls(await bus.ensure_kv(js, subjects.KV_ENVS, history=1))
        if moved_from is not None:
            await cat._move_from(moved_from)
        return cat

    async def _move_from(self, js) -> None:
        try:
            old = await js.key_value(subjects.KV_ENVS)
        except Exception:  # noqa: BLE001 - no old bucket (or no right to it): nothing to move
            return
        moved = 0
        for k in await bus.kv_keys(old):
            try:
                e = await old.get(k)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            if e is not None and e.value:
                try:
                    await self.kv.create(k, e.value)
                    moved += 1
                except KeyWrongLastSequenceError:
                    pass  # already in the new catalog: it wins
        try:
            await js.delete_key_value(subjects.KV_ENVS)
        except Exception:  # noqa: BLE001 - another replica moved it at the same time
            pass
        logs.kv(log, logging.WARNING, "environment catalog moved into its own account", entries=moved)

    async def _keys(self) -> list[str]:
        return [k for k in await bus.kv_keys(self.kv) if not k.endswith("._latest")]

    async def _entry(self, k: str) -> StoredEnv | None:
        try:
            e = await self.kv.get(k)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if e is None or not e.value:
            return None
        return msgspec.json.decode(e.value, type=StoredEnv)

    async def _all(self, prefix: str = "") -> list[StoredEnv]:
        out = []
        for k in await self._keys():
            if prefix and not k.startswith(prefix):
                continue
            env = await self._entry(k)
            if env is not None:
                out.append(env)
        return out

    async def versions(self, name: str, accepted_only: bool = True) -> list[StoredEnv]:
        now = time.time()
        envs = [e for e in await self._all(name + ".") if e.record.name == name]
        envs = [e for e in envs if e.state == "accepted" or (not accepted_only and now - e.reserved_at < STALE_BUILD_S)]
        return sorted(envs, key=lambda e: e.record.created_at)

    async def list(self, prefix: str = "") -> list[EnvRecord]:
        envs = [e for e in await self._all(prefix) if e.state == "accepted"]
        return sorted((e.record for e in envs), key=lambda r: (r.name, r.created_at))

    async def get(self, name: str, version: str = "") -> StoredEnv:
        if not version:
            try:
                e = await self.kv.get(latest_key(name))
                version = e.value.decode() if e is not None and e.value else ""
            except (KeyNotFoundError, KeyDeletedError):
                version = ""
        env = await self._entry(key(name, version)) if version else None
        if env is not None and env.state == "accepted":
            return env
        known = sorted({f"{r.name}:{r.version}" for r in await self.list()})
        what = f"{name}:{version}" if version else name
        raise NotFound(f"no environment {what!r} in the catalog; known: {', '.join(known) or 'none'}")

    async def next_version(self, name: str) -> str:
        taken = [e.record.version for e in await self._all(name + ".") if e.record.name == name]
        nums = [int(v) for v in taken if v.isdigit()]
        return str(max(nums, default=0) + 1)

    async def reserve(self, env: StoredEnv) -> None:
        """Claim `<name>.<version>`; Conflict when it exists (accepted, or a live build)."""
        k = key(env.record.name, env.record.version)
        try:
            await self.kv.create(k, msgspec.json.encode(env))
            return
        except KeyWrongLastSequenceError:
            pass
        except Exception as e:
            if "wrong last sequence" not in str(e).lower():
                raise
        try:
            cur = await self.kv.get(k)
            old = msgspec.json.decode(cur.value, type=StoredEnv)
        except Exception:
            old = None
        if old is not None and old.state == "building" and time.time() - old.reserved_at > STALE_BUILD_S:
            await self.kv.update(k, msgspec.json.encode(env), last=cur.revision)
            return
        state = old.state if old else "unknown"
        raise Conflict(f"environment {env.record.name}:{env.record.version} already exists ({state}); versions are "
                       "immutable: leave `version` empty for the next one")

    async def accept(self, env: StoredEnv) -> None:
        env.state = "accepted"
        await self.kv.put(key(env.record.name, env.record.version), msgspec.json.encode(env))
        await self.kv.put(latest_key(env.record.name), env.record.version.encode())

    async def release(self, name: str, version: str) -> None:
        try:
            await self.kv.delete(key(name, version))
        except Exception:  # best effort: a reservation left behind only blocks re-using this version number
            pass

    async def find_digest(self, name: str, digest: str) -> StoredEnv | None:
        for e in reversed(await self.versions(name)):
            if e.record.spec_digest == digest:
                return e
        return None

    async def delete(self, name: str, version: str) -> StoredEnv:
        env = await self.get(name, version)
        await self.kv.delete(key(name, env.record.version))
        rest = await self.versions(name)
        if rest:
            await self.kv.put(latest_key(name), rest[-1].record.version.encode())
        else:
            await self.kv.delete(latest_key(name))
        return env
