"""The node-local lazy loader (corral_image_cache.loader) against a real nats-server: layers are
built with mkfs.erofs into the JetStream object store, the loader runs as its own process, and
its FUSE files are mounted as EROFS (file-backed, mount(2)) and read through the kernel."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.js.api import DeliverPolicy

from corral_common.bus import ensure_streams
from corral_common.contract import subjects
from corral_common.contract.audit import AuditBatch
from corral_common.contract.images import ImageManifest, LayerManifest
from corral_common.layers import Catalog, DirBackend, ObjectStoreBackend, build_layer
from corral_sdk.stack import free_port, nats_server_binary

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mkfs.erofs") or not os.path.exists("/dev/fuse"),
                                reason="needs root, mkfs.erofs and /dev/fuse")

CHUNK = 256 << 10
_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------- helpers


def mount_erofs(src: str, dst: str) -> None:
    """A file-backed EROFS mount through mount(2) (util-linux's mount(8) would set up a loop device)."""
    os.makedirs(dst, exist_ok=True)
    if _libc.mount(src.encode(), dst.encode(), b"erofs", 1, None) != 0:  # MS_RDONLY
        e = ctypes.get_errno()
        raise OSError(e, f"mount -t erofs {src} {dst}: {os.strerror(e)}")


def umount(path: str, detach: bool = False) -> None:
    if _libc.umount2(path.encode(), 2 if detach else 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {path}: {os.strerror(e)}")


def mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        out = []
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            if parts[4].startswith(prefix) or parts[sep + 2].startswith(prefix):
                out.append(f"{parts[sep + 1]} {parts[sep + 2]} on {parts[4]}")
        return out


def make_tree(root: str, files: int, size: int, seed: int) -> dict[str, str]:
    """Random files; returns name -> sha256."""
    rnd = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    sums = {}
    for i in range(files):
        data = rnd.randbytes(size + rnd.randrange(size // 4))
        name = f"f{i:03d}"
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    return sums


def sha_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class LoaderProc:
    def __init__(self, env: Env, node: str, cache: str | None = None, mount: str | None = None, args: tuple[str, ...] = ()):
        self.env = env
        self.node = node
        self.cache = cache or os.path.join(env.tmp, f"cache-{node}")
        self.mount = mount or os.path.join(env.tmp, f"fuse-{node}")
        self.args = list(args)
        self.log = os.path.join(env.tmp, f"loader-{node}.log")
        self.p: subprocess.Popen | None = None

    async def start(self) -> LoaderProc:
        with open(self.log, "ab") as log:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "corral_image_cache.loader", "--nats", self.env.url, "--node", self.node,
                 "--mount", self.mount, "--cache-dir", self.cache, "--fetch-timeout-s", "3", "--fetch-retries", "1",
                 "--read-timeout-s", "20", "--shutdown-grace-s", "1", *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.p.poll() is None, f"loader exited {self.p.returncode}: {self.logs()[-3000:]}"
            try:
                await self.request("stats", {}, timeout=0.5)
                return self
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.05)
        raise AssertionError(f"loader {self.node} not ready: {self.logs()[-3000:]}")

    async def request(self, op: str, body, timeout: float = 10.0) -> dict:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        msg = await self.env.nc.request(subjects.node_loader(self.node, op), data, timeout=timeout)
        return json.loads(msg.data)

    async def call(self, op: str, body) -> dict:
        r = await self.request(op, body)
        assert r["ok"], r
        return r

    async def stats(self) -> dict:
        """Stats once no chunk load is in flight (the kernel's readahead may still be reading)."""
        for _ in range(100):
            st = await self.call("stats", {})
            if st["pending"] == 0:
                return st
            await asyncio.sleep(0.02)
        return st

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p is None or self.p.poll() is not None:
            return self.p.returncode if self.p else 0
        self.p.send_signal(sig)
        try:
            return await asyncio.to_thread(self.p.wait, 20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            await asyncio.to_thread(self.p.wait)
            raise AssertionError(f"loader {self.node} did not stop on SIGTERM: {self.logs()[-3000:]}") from None

    def logs(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


class Env:
    def __init__(self, tmp: str, url: str, nc, js, catalog: Catalog):
        self.tmp = tmp
        self.url = url
        self.nc = nc
        self.js = js
        self.catalog = catalog
        self.store = ObjectStoreBackend(js)
        self.loaders: list[LoaderProc] = []
        self.mounted: list[str] = []

    async def layer(self, name: str, files: int, size: int, seed: int, image: str | None = None) -> tuple[LayerManifest, dict[str, str]]:
        src = os.path.join(self.tmp, "src", name)
        sums = make_tree(src, files, size, seed)
        m, _ = await build_layer(src, self.store, chunk_size=CHUNK, source=f"test:{name}")
        await self.catalog.put_layer(m)
        if image:
            await self.catalog.put_image(ImageManifest(name=image, layers=[m.digest], created_at=time.time(), size=m.size))
        return m, sums

    def loader(self, node: str, **kw) -> LoaderProc:
        lp = LoaderProc(self, node, **kw)
        self.loaders.append(lp)
        return lp

    def mount(self, src: str, name: str) -> str:
        dst = os.path.join(self.tmp, "mnt", name)
        mount_erofs(src, dst)
        self.mounted.append(dst)
        return dst

    def umount(self, dst: str) -> None:
        umount(dst)
        self.mounted.remove(dst)


async def read_all(root: str, names, workers: int = 1) -> dict[str, str | OSError]:
    """sha256 of each file, or the OSError reading it raised."""

    def one(name: str):
        try:
            return name, sha_file(os.path.join(root, name))
        except OSError as e:
            return name, e

    if workers == 1:
        return dict(await asyncio.to_thread(lambda: [one(n) for n in names]))
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return dict(await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(ex, one, n) for n in names)))


async def audit_events(env: Env, node: str, want: int = 1, timeout: float = 5.0) -> list:
    sub = await env.js.subscribe(subjects.audit(node, "loader"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    events = []
    deadline = time.monotonic() + timeout
    try:
        while len(events) < want and time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=max(0.05, deadline - time.monotonic()))
            except nats.errors.TimeoutError:
                break
            events.extend(msgspec.json.decode(msg.data, type=AuditBatch).events)
    finally:
        await sub.unsubscribe()
    return events


@pytest_asyncio.fixture(scope="module")
async def env():
    tmp = tempfile.mkdtemp(prefix="crl-ld-", dir="/tmp")
    port = free_port()
    with open(os.path.join(tmp, "nats.log"), "ab") as log:
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", os.path.join(tmp, "js")],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"nats://127.0.0.1:{port}"
    nc = None
    for _ in range(100):
        try:
            nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0)
            break
        except Exception:
            await asyncio.sleep(0.05)
    assert nc is not None, "nats-server did not start"
    js = nc.jetstream()
    await ensure_streams(js)
    e = Env(tmp, url, nc, js, await Catalog(js).open())
    try:
        yield e
    finally:
        for m in reversed(list(e.mounted)):
            try:
                umount(m, detach=True)
            except OSError:
                pass
        stop_running_loaders(e)
        await nc.close()
        server.terminate()
        server.wait(10)
        left = mounts_under(tmp)
        for line in left:  # never leave the machine dirty, even when failing
            try:
                umount(line.split(" on ")[-1], detach=True)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"mounts left behind: {left}"


def stop_running_loaders(e: Env) -> None:
    """After a failure: stop what is still running, gracefully first, and wait for its FUSE mount."""
    for lp in e.loaders:
        if lp.p is not None and lp.p.poll() is None:
            lp.p.terminate()
            try:
                lp.p.wait(10)
            except subprocess.TimeoutExpired:
                lp.p.kill()
                lp.p.wait()
    for _ in range(40):  # fusermount3's auto_unmount of a killed loader is asynchronous
        if not any(line.startswith("fuse") for line in mounts_under(e.tmp)):
            break
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_leaked_mounts(env):
    yield
    left = list(env.mounted)
    for dst in left:  # unmounted either way, so one failing test does not fail every later one
        with contextlib.suppress(OSError):
            env.umount(dst)
    stop_running_loaders(env)  # nor does a loader a failing test left running
    assert left == [], f"test left EROFS mounts: {left}"


# ---------------------------------------------------------------- tests


async def test_read_through_erofs_and_many_concurrent_readers_fetch_each_chunk_once(env):
    """(b) 100 concurrent readers through one EROFS mount and three mounts of the same layer
    file: every byte right, each chunk fetched from the store exactly once."""
    m, sums = await env.layer("conc", files=48, size=150_000, seed=1)
    lp = await env.loader("n-conc").start()
    r = await lp.call("prepare", {"image": "", "layers": [m.digest]})
    path = r["paths"][m.digest]
    assert path == os.path.join(lp.mount, m.digest)
    assert os.path.getsize(path) == m.size
    assert os.listdir(lp.mount) == [m.digest]
    mounts = [env.mount(path, f"conc-{i}") for i in range(3)]
    names = sorted(sums)

    def reader(k: int):
        rnd = random.Random(k)
        order = names[:]
        rnd.shuffle(order)
        root = mounts[0] if k < 50 else mounts[k % 3]  # half through one mount, half spread
        return [(n, sha_file(os.path.join(root, n))) for n in order[:16]]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(100) as ex:
        results = await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(ex, reader, k) for k in range(100)))
    cold_s = time.perf_counter() - t0
    for res in results:
        for n, h in res:
            assert h == sums[n], n
    st = await lp.stats()
    lay = st["layers"][m.digest]
    assert st["fetch_errors"] == 0 and st["read_errors"] == 0
    assert st["fetches"] == lay["cached_chunks"] == lay["fetched_chunks"], st
    # every other waiter joined the one fetch (started by a miss, or by readahead for a sequential reader)
    assert st["chunk_misses"] + st["readahead_chunks"] == st["fetches"], st
    assert st["bytes_fetched"] == lay["cached_bytes"]
    assert lay["cached_chunks"] <= lay["chunks"]
    # everything again through every mount: no new fetches
    for root in mounts:
        got = await read_all(root, names, workers=8)
        assert got == sums
    st2 = await lp.stats()
    assert st2["fetches"] == lay["chunks"] == st2["layers"][m.digest]["cached_chunks"], st2
    print(f"\n100 readers x 16 files over 3 EROFS mounts, cold: {cold_s:.2f}s, fetches {st['fetches']} "
          f"(of {lay['chunks']} chunks), fetch p50 {st['fetch_ms']['p50']} ms p99 {st['fetch_ms']['p99']} ms")
    for d in mounts:
        env.umount(d)
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0
    assert mounts_under(lp.mount) == []


async def test_corrupt_chunk_gives_eio_and_audit_event(env):
    """(a) a chunk whose bytes in the store do not match its hash: the reader gets EIO, no wrong
    byte is served, an error audit event is published; fixing the store heals the read."""
    m, sums = await env.layer("corrupt", files=24, size=150_000, seed=2)
    bad = len(m.chunks) // 2
    good = await env.store.get(m.chunks[bad])
    await env.store.put(m.chunks[bad], bytes(b ^ 0x5A for b in good))  # same key, other bytes
    lp = await env.loader("n-corrupt").start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "corrupt")
    t0 = time.perf_counter()
    got = await read_all(root, sorted(sums))
    elapsed = time.perf_counter() - t0
    failed = {n: e for n, e in got.items() if isinstance(e, OSError)}
    assert failed, "no read hit the corrupted chunk"
    assert all(e.errno == errno.EIO for e in failed.values()), failed
    for n, h in got.items():
        if not isinstance(h, OSError):
            assert h == sums[n], f"{n} served wrong bytes"
    assert elapsed < 15, f"EIO took {elapsed:.1f}s"
    # the raw layer file too: the corrupted range is EIO, never the wrong bytes
    with open(path, "rb") as f:
        f.seek(bad * CHUNK)
        with pytest.raises(OSError) as ei:
            f.read(4096)
        assert ei.value.errno == errno.EIO
    st = await lp.stats()
    assert st["fetch_errors"] >= 1 and st["read_errors"] >= 1
    events = await audit_events(env, "n-corrupt")
    assert events, "no audit event"
    ev = events[0]
    assert (ev.kind, ev.sandbox, ev.op, ev.node) == ("error", "loader", "chunk_fetch", "n-corrupt")
    assert ev.detail["layer"] == m.digest and ev.detail["chunk"] == str(bad) and ev.detail["reason"] == "verify"
    assert "failed verification" in ev.detail["error"]
    # the chunk never entered the cache; with the store repaired the same files read right
    assert st["layers"][m.digest]["cached_chunks"] < st["layers"][m.digest]["chunks"]
    await env.store.put(m.chunks[bad], good)
    again = await read_all(root, sorted(failed))
    assert again == {n: sums[n] for n in failed}
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0


async def test_bad_input_and_missing_chunk(env):
    """(f) unknown layer, malformed requests, a malformed or inconsistent manifest, a chunk
    missing from the store: clear errors, EIO for the reader, and the loader keeps serving."""
    m, sums = await env.layer("missing", files=16, size=150_000, seed=3)
    lp = await env.loader("n-bad").start()
    unknown = "sha256-" + "0" * 64

    async def err(op: str, body) -> tuple[str, str]:
        r = await lp.request(op, body)
        assert r["ok"] is False, r
        return r["error"]["code"], r["error"]["message"]

    code, msg = await err("prepare", {"layers": [unknown]})
    assert code == "not_found" and unknown in msg
    assert (await err("prepare", b"{not json"))[0] == "invalid_request"
    assert (await err("prepare", {"layers": "sha256-x"}))[0] == "invalid_request"
    assert (await err("prepare", {"layers": []}))[0] == "invalid_request"
    assert (await err("prepare", {"layers": [m.digest], "imgae": "x"}))[0] == "invalid_request"
    code, msg = await err("prepare", {"layers": ["../../etc/passwd"]})
    assert code == "invalid_request" and "invalid layer digest" in msg
    assert (await err("prepare", {"image": "Bad Name!", "layers": [m.digest]}))[0] == "invalid_request"
    assert (await err("release", {"layers": ["nope"]}))[0] == "invalid_request"
    assert (await err("stats", {"verbose": 1}))[0] == "invalid_request"
    assert (await err("evict", {"layer": unknown}))[0] == "not_found"
    # a manifest that does not decode, and one whose chunk list does not fit its size
    broken = "sha256-" + "1" * 64
    await env.catalog.layers.put(broken, b'{"digest": 5}')
    code, msg = await err("prepare", {"layers": [broken]})
    assert code == "internal" and "malformed" in msg and broken in msg
    short = "sha256-" + "2" * 64
    await env.catalog.layers.put(short, msgspec.json.encode(LayerManifest(digest=short, size=3 * CHUNK, chunk_size=CHUNK,
                                                                          chunks=["a" * 64], created_at=time.time())))
    code, msg = await err("prepare", {"layers": [short]})
    assert code == "internal" and "inconsistent" in msg
    # a failed prepare counts nothing
    assert (await err("prepare", {"layers": [m.digest, unknown]}))[0] == "not_found"
    assert m.digest not in (await lp.stats())["layers"] or (await lp.stats())["layers"][m.digest]["refs"] == 0
    r = await lp.call("release", {"layers": [m.digest]})
    assert r["not_prepared"] == [m.digest]

    # a chunk missing from the store: EIO at once (not found is not retried) and an audit event
    gone = len(m.chunks) - 2
    await env.store.delete(m.chunks[gone])
    path = (await lp.call("prepare", {"image": "", "layers": [m.digest]}))["paths"][m.digest]
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        f.seek(gone * CHUNK)
        with pytest.raises(OSError) as ei:
            f.read(CHUNK)
    assert ei.value.errno == errno.EIO
    assert time.perf_counter() - t0 < 3
    root = env.mount(path, "missing")
    got = await read_all(root, sorted(sums))
    assert any(isinstance(v, OSError) and v.errno == errno.EIO for v in got.values())
    assert all(v == sums[n] for n, v in got.items() if not isinstance(v, OSError))
    events = await audit_events(env, "n-bad")
    assert events and events[0].detail["reason"] == "not_found"
    assert "not in the chunk store" in events[0].detail["error"]
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert (await lp.stats())["layers"][m.digest]["refs"] == 0
    assert lp.p.poll() is None
    assert await lp.stop() == 0


async def test_restart_keeps_the_cache(env):
    """(c) chunks fetched before a restart are served after it without fetching again."""
    m, sums = await env.layer("restart", files=24, size=400_000, seed=4)
    names = sorted(sums)[:8]
    # no readahead: every fetch after the restart would then be a demand miss, and there must be none
    lp = await env.loader("n-restart", args=("--readahead-chunks", "0")).start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "restart")
    t0 = time.perf_counter()
    assert await read_all(root, names) == {n: sums[n] for n in names}
    cold_s = time.perf_counter() - t0
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert (await lp.stats())["fetches"] > 0
    assert await lp.stop() == 0
    assert mounts_under(lp.mount) == []
    # what the cache held at the exit, not a snapshot before the stop: the kernel's readahead of
    # the EROFS mount may still reach the loader after the umount, and the chunk it asks for is
    # fetched and kept (test_a_chunk_on_its_way_at_stop_is_kept_for_the_restart)
    before = stopped_state(lp)
    assert before["fetches"] > 0

    await lp.start()
    st = await lp.stats()
    assert st["fetches"] == 0
    assert st["layers"][m.digest]["cached_chunks"] == before["cached_chunks"][m.digest]
    assert st["cache_bytes"] == before["cache_bytes"]
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "restart")
    t0 = time.perf_counter()
    assert await read_all(root, names) == {n: sums[n] for n in names}
    warm_s = time.perf_counter() - t0
    st = await lp.stats()
    # No chunk held before the restart is fetched again. The kernel's own readahead of the layer
    # file is not the same from one mount to the next (its async window depends on timing), so the
    # same files may touch a chunk next to the ones of the first pass (CI, stop 28: one 256 KiB
    # chunk); such a chunk is new to the cache, and every fetch must be one of those.
    grown = st["layers"][m.digest]["cached_chunks"] - before["cached_chunks"][m.digest]
    assert st["chunk_hits"] > 0 and st["fetches"] == grown, (grown, st)
    assert st["chunk_hits"] >= 10 * st["fetches"], st  # 57 hits and no fetch, most runs
    # the rest of the layer was never cached: reading it fetches (the cache is not just full)
    rest = sorted(set(sums) - set(names))
    assert await read_all(root, rest) == {n: sums[n] for n in rest}
    assert (await lp.stats())["fetches"] > 0
    print(f"\nrestart: {len(names)} files cold {cold_s * 1000:.0f} ms, after restart ({grown} new chunks) {warm_s * 1000:.0f} ms")
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0


def stopped_state(lp: LoaderProc) -> dict:
    """The last `loader stopped` record of a loader's log: its counters and cache at the exit."""
    recs = [json.loads(line) for line in lp.logs().splitlines() if line.startswith("{") and '"loader stopped"' in line]
    assert recs, lp.logs()[-3000:]
    return recs[-1]


async def test_a_chunk_on_its_way_at_stop_is_kept_for_the_restart(env):
    """The ordering behind test_restart_keeps_the_cache's flake, forced: a read's chunk is being
    fetched when the loader is told to stop. The loader finishes that fetch and writes the chunk
    before it exits (it used to cancel it), so after a restart the chunk is served from the cache.

    The chunk store is a directory whose file for that chunk is a FIFO: the fetch has begun once
    the loader opens it, and the chunk's bytes are written into it only after the loader, told to
    stop, has passed the point where it used to drop fetches (it says it waits for them) or has
    exited. No timing decides the outcome."""
    src = os.path.join(env.tmp, "src", "inflight")
    make_tree(src, files=4, size=400_000, seed=7)
    store = os.path.join(env.tmp, "dirstore")
    m, _ = await build_layer(src, DirBackend(store), chunk_size=CHUNK, source="test:inflight")
    await env.catalog.put_layer(m)
    target = 2
    assert m.chunks.count(m.chunks[target]) == 1  # no copy of it elsewhere in the layer
    fifo = os.path.join(store, m.chunks[target][:2], m.chunks[target])
    with open(fifo, "rb") as f:
        chunk = f.read()
    os.unlink(fifo)
    os.mkfifo(fifo)
    lp = await env.loader("n-inflight", args=("--chunk-backend", f"dir://{store}", "--readahead-chunks", "0",
                                              "--fetch-timeout-s", "120")).start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]

    def read_target() -> bytes | OSError:
        try:
            with open(path, "rb") as f:
                f.seek(target * CHUNK)
                return f.read(4096)
        except OSError as e:
            return e

    reader = asyncio.ensure_future(asyncio.to_thread(read_target))
    deadline = time.monotonic() + 30
    while True:  # a FIFO opens for writing (non-blocking) only once its reader, the fetch, opened it
        try:
            wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            assert e.errno == errno.ENXIO and time.monotonic() < deadline, f"the loader did not fetch the chunk: {lp.logs()[-3000:]}"
            await asyncio.sleep(0.02)
    try:
        os.set_blocking(wfd, True)
        lp.p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while "finishing chunk loads before exit" not in lp.logs() and lp.p.poll() is None:
            assert time.monotonic() < deadline, lp.logs()[-3000:]
            await asyncio.sleep(0.05)

        def feed() -> None:
            with contextlib.suppress(BrokenPipeError):  # the loader exited without reading it
                view = memoryview(chunk)
                while view:
                    view = view[os.write(wfd, view):]

        await asyncio.to_thread(feed)
    finally:
        os.close(wfd)
    assert await lp.stop() == 0
    await reader  # the chunk's bytes, or EIO once the mount was gone: either is fine here
    os.unlink(fifo)  # gone from the store: after the restart only the node cache can serve it

    await lp.start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    got = await asyncio.to_thread(read_target)
    assert got == chunk[:4096], f"the chunk on its way at the stop was not kept: {got!r}"
    st = await lp.stats()
    assert st["fetch_errors"] == 0 and st["read_errors"] == 0 and st["chunk_hits"] > 0, st
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0


async def test_eviction_never_evicts_a_layer_in_use(env):
    """(d) a 5 MiB cap with three ~3 MiB layers: layers in use stay even over the cap; unused ones
    go, least recently used first; an evicted layer is fetched again when prepared again."""
    layers = [await env.layer(f"evict{i}", files=20, size=150_000, seed=10 + i) for i in range(3)]
    (m1, s1), (m2, s2), (m3, s3) = layers
    lp = await env.loader("n-evict", args=("--cache-max-mb", "5")).start()

    async def use(m, sums, name):
        path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
        root = env.mount(path, name)
        assert await read_all(root, sorted(sums)) == sums
        return root

    def cached(st, m):
        return st["layers"].get(m.digest, {}).get("cached_bytes", 0)

    r1 = await use(m1, s1, "ev1")
    r2 = await use(m2, s2, "ev2")
    st = await lp.stats()
    assert st["cache_bytes"] > st["cache_max_bytes"]  # over the cap, but both are in use
    assert cached(st, m1) > 0 and cached(st, m2) > 0 and st["evictions"] == 0
    r = await lp.request("evict", {"layer": m1.digest})
    assert r["ok"] is False and r["error"]["code"] == "conflict"
    assert (await lp.call("evict", {}))["evicted"] == []

    env.umount(r1)
    await lp.call("release", {"layers": [m1.digest]})
    for _ in range(50):
        st = await lp.stats()
        if cached(st, m1) == 0:
            break
        await asyncio.sleep(0.05)
    assert cached(st, m1) == 0 and cached(st, m2) == m2.size, st
    assert not os.path.exists(os.path.join(lp.cache, "layers", m1.digest))
    assert m1.digest not in os.listdir(lp.mount)

    r3 = await use(m3, s3, "ev3")  # m2 and m3 in use: over the cap again, nothing evictable
    st = await lp.stats()
    assert cached(st, m2) == m2.size and cached(st, m3) == m3.size and st["evictions"] == 1
    env.umount(r2)
    await lp.call("release", {"layers": [m2.digest]})
    for _ in range(50):
        st = await lp.stats()
        if cached(st, m2) == 0:
            break
        await asyncio.sleep(0.05)
    assert cached(st, m2) == 0 and cached(st, m3) == m3.size and st["cache_bytes"] <= st["cache_max_bytes"]

    # an evicted layer comes back on demand, with the right bytes (dropping the kernel's page
    # cache of the FUSE file first: it outlives eviction, holding the same immutable bytes)
    fetched = st["fetches"]
    path = (await lp.call("prepare", {"layers": [m1.digest]}))["paths"][m1.digest]
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    await lp.call("release", {"layers": [m1.digest]})
    r1 = await use(m1, s1, "ev1")
    st = await lp.stats()
    assert st["fetches"] > fetched and cached(st, m3) == m3.size  # m3 is in use: it stays
    # the explicit evict op removes only what nobody uses
    env.umount(r3)
    await lp.call("release", {"layers": [m3.digest]})
    r = await lp.call("evict", {})
    assert m1.digest not in r["evicted"]
    assert (await lp.stats())["layers"][m1.digest]["cached_bytes"] > 0
    env.umount(r1)
    await lp.call("release", {"layers": [m1.digest]})
    r = await lp.call("evict", {"layer": m1.digest})
    assert r["evicted"] == [m1.digest] and r["cache_bytes"] == 0
    assert await lp.stop() == 0


async def test_prefetch_trace_recorded_then_replayed(env):
    """(e) the first start records the image's chunk order; a cold start on another node replays
    it: demand misses afterwards are at most 5% of the chunks the first cold start needed."""
    m, sums = await env.layer("prefetch", files=64, size=150_000, seed=5, image="ld-prefetch")
    names = sorted(sums)[::3]
    a = await env.loader("n-pa", args=("--trace-window-s", "1.5")).start()
    r = await a.call("prepare", {"image": "ld-prefetch", "layers": [m.digest]})
    assert r["recording"] is True and r["prefetch_chunks"] == 0
    root = env.mount(r["paths"][m.digest], "pa")
    t0 = time.perf_counter()
    assert await read_all(root, names) == {n: sums[n] for n in names}
    cold_s = time.perf_counter() - t0
    cold = await a.stats()
    trace = None
    for _ in range(60):
        trace = await env.catalog.trace("ld-prefetch")
        if trace is not None:
            break
        await asyncio.sleep(0.1)
    assert trace is not None and trace.node == "n-pa"
    assert {r.layer for r in trace.reads} == {m.digest}
    needed = len(trace.reads)  # the chunks the cold start read, in first-access order
    assert len({(r.layer, r.chunk) for r in trace.reads}) == needed
    assert cold["chunk_misses"] <= needed <= cold["layers"][m.digest]["cached_chunks"]
    env.umount(root)
    await a.call("release", {"layers": [m.digest]})
    assert await a.stop() == 0

    b = await env.loader("n-pb", args=("--trace-window-s", "1.5")).start()
    r = await b.call("prepare", {"image": "ld-prefetch", "layers": [m.digest]})
    assert r["recording"] is False and r["prefetch_chunks"] == len(trace.reads)
    root = env.mount(r["paths"][m.digest], "pb")
    t0 = time.perf_counter()
    assert await read_all(root, names) == {n: sums[n] for n in names}
    warm_s = time.perf_counter() - t0
    st = await b.stats()
    assert st["chunk_misses"] <= 0.05 * needed, (st, needed)
    assert st["fetches_prefetch"] + st["fetches_demand"] == st["fetches"]
    assert st["prefetched_chunks"] == len(trace.reads)
    print(f"\nprefetch: cold start read {needed} chunks ({cold['chunk_misses']} demand misses) in {cold_s * 1000:.0f} ms; "
          f"replayed: {st['chunk_misses']} demand misses, {st['chunk_joins']} joined prefetches, {warm_s * 1000:.0f} ms")
    env.umount(root)
    await b.call("release", {"layers": [m.digest]})
    assert await b.stop() == 0


async def test_stop_with_a_mount_in_use_detaches_and_leaves_nothing(env):
    """(g) a clean stop unmounts FUSE; a stop while an EROFS mount still uses the layer file
    detaches it lazily (and says so); once the EROFS mount goes, no FUSE or EROFS mount remains."""
    m, sums = await env.layer("stop", files=8, size=150_000, seed=6)
    lp = await env.loader("n-stop").start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "stop")
    assert await read_all(root, sorted(sums)) == sums
    assert any(line.startswith("fuse.corral") for line in mounts_under(lp.mount))
    assert await lp.stop() == 0
    assert "detaching it lazily" in lp.logs()
    assert not any(line.startswith("fuse") for line in mounts_under(env.tmp)), mounts_under(env.tmp)
    env.umount(root)  # the sandbox goes; nothing of it or the loader remains
    assert mounts_under(env.tmp) == []

    # the normal order: umount, release, stop
    await lp.start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "stop")
    assert await read_all(root, sorted(sums)) == sums
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0
    assert "detaching it lazily" not in lp.logs().split("loader ready")[-1]
    assert mounts_under(env.tmp) == []
    for other in env.loaders:
        assert other.p.poll() is not None


async def test_dedup_shared_layers_and_chunks(env):
    """Two images sharing a layer share its file and cache (one fetch per chunk, counted per
    prepare); a different layer holding identical chunks (the same tree built again: only the
    superblock differs) copies them from the node cache instead of fetching them."""
    m, sums = await env.layer("dedup", files=16, size=150_000, seed=7)
    m2, _ = await build_layer(os.path.join(env.tmp, "src", "dedup"), env.store, chunk_size=CHUNK)
    await env.catalog.put_layer(m2)
    assert m2.digest != m.digest
    shared = len(set(m.chunks) & set(m2.chunks))
    assert shared >= len(m.chunks) - 2
    for name in ("ld-dedup-1", "ld-dedup-2"):
        await env.catalog.put_image(ImageManifest(name=name, layers=[m.digest], created_at=time.time()))
    lp = await env.loader("n-dedup").start()
    p1 = (await lp.call("prepare", {"image": "ld-dedup-1", "layers": [m.digest]}))["paths"][m.digest]
    p2 = (await lp.call("prepare", {"image": "ld-dedup-2", "layers": [m.digest]}))["paths"][m.digest]
    assert p1 == p2
    r1, r2 = env.mount(p1, "dedup-1"), env.mount(p2, "dedup-2")
    assert await read_all(r1, sorted(sums)) == sums
    assert await read_all(r2, sorted(sums)) == sums
    st = await lp.stats()
    assert st["layers"][m.digest]["refs"] == 2
    assert st["fetches"] == st["layers"][m.digest]["cached_chunks"]
    before = st["fetches"]
    p3 = (await lp.call("prepare", {"layers": [m2.digest]}))["paths"][m2.digest]
    r3 = env.mount(p3, "dedup-3")
    assert await read_all(r3, sorted(sums)) == sums
    st = await lp.stats()
    new = st["fetches"] - before
    assert st["local_copies"] >= shared - 2 and new <= len(m2.chunks) - shared, st
    for r in (r1, r2, r3):
        env.umount(r)
    await lp.call("release", {"layers": [m.digest, m.digest, m2.digest]})
    assert all(x["refs"] == 0 for x in (await lp.stats())["layers"].values())
    assert await lp.stop() == 0


async def test_background_fill_after_quiet_period(env):
    """With --background-fill-after-s, layers in use are fetched completely once reads go quiet."""
    m, sums = await env.layer("fill", files=16, size=150_000, seed=8)
    lp = await env.loader("n-fill", args=("--background-fill-after-s", "0.5")).start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "fill")
    name = sorted(sums)[0]
    assert await read_all(root, [name]) == {name: sums[name]}
    for _ in range(100):
        st = await lp.stats()
        if st["layers"][m.digest]["cached_chunks"] == len(m.chunks):
            break
        await asyncio.sleep(0.1)
    assert st["layers"][m.digest]["cached_chunks"] == len(m.chunks), st
    assert st["fetches_fill"] > 0 and st["filled_chunks"] == st["fetches_fill"]
    assert await read_all(root, sorted(sums)) == sums
    assert (await lp.stats())["fetches"] == len(m.chunks)
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    assert await lp.stop() == 0


async def test_hung_chunk_store_gives_eio_not_a_hang(env):
    """A chunk whose fetch never answers (a FIFO in a dir:// store) times out, is retried, and
    then gives the reader EIO; the loader still stops promptly."""
    from corral_common.layers import DirBackend

    store = os.path.join(env.tmp, "dirstore")
    src = os.path.join(env.tmp, "src", "hung")
    sums = make_tree(src, 8, 150_000, seed=9)
    m, _ = await build_layer(src, DirBackend(store), chunk_size=CHUNK)
    await env.catalog.put_layer(m)
    stuck = len(m.chunks) - 1
    chunk_file = os.path.join(store, m.chunks[stuck][:2], m.chunks[stuck])
    os.unlink(chunk_file)
    os.mkfifo(chunk_file)  # opening it for reading blocks until a writer comes
    lp = await env.loader("n-hung", args=("--chunk-backend", f"dir://{store}", "--fetch-timeout-s", "0.5",
                                          "--fetch-retries", "1")).start()
    path = (await lp.call("prepare", {"layers": [m.digest]}))["paths"][m.digest]
    root = env.mount(path, "hung")
    t0 = time.perf_counter()
    got = await read_all(root, sorted(sums))
    elapsed = time.perf_counter() - t0
    assert any(isinstance(v, OSError) and v.errno == errno.EIO for v in got.values()), got
    assert all(v == sums[n] for n, v in got.items() if not isinstance(v, OSError))
    assert elapsed < 10, elapsed
    events = await audit_events(env, "n-hung")
    assert events and events[0].detail["reason"] == "timeout" and events[0].detail["chunk"] == str(stuck)
    env.umount(root)
    await lp.call("release", {"layers": [m.digest]})
    t0 = time.perf_counter()
    assert await lp.stop() == 0  # threads stuck in open() of the FIFO do not hold up the exit
    assert time.perf_counter() - t0 < 5


async def test_fetch_pool_single_flight_priority_and_verification():
    """The fetch pool in-process, with a slow fake store: one fetch per hash however many wait,
    demand overtakes queued prefetch, bad bytes are retried then refused, not-found is final."""
    from corral_common.contract.errors import NotFound
    from corral_common.layers import ChunkBackend
    from corral_image_cache.loader.fetcher import DEMAND, PREFETCH, ChunkError, FetchPool

    blobs = {hashlib.sha256(bytes([i]) * 1000).hexdigest(): bytes([i]) * 1000 for i in range(20)}
    hs = list(blobs)
    bad = hashlib.sha256(b"right").hexdigest()

    class Slow(ChunkBackend):
        def __init__(self):
            self.calls: list[str] = []

        async def get(self, h):
            self.calls.append(h)
            await asyncio.sleep(0.02)
            if h == bad:
                return b"wrong"
            if h not in blobs:
                raise NotFound(f"chunk {h} is not in the chunk store")
            return blobs[h]

        async def put(self, h, data): ...
        async def has(self, h): return h in blobs
        async def delete(self, h): ...

    store = Slow()
    pool = FetchPool(store, workers=2, timeout_s=1, retries=2, backoff_s=0.01)
    pool.start()
    try:
        got = await asyncio.gather(*(pool.get(hs[0], 1000, DEMAND) for _ in range(50)))
        assert all(g == blobs[hs[0]] for g in got) and store.calls == [hs[0]]
        store.calls.clear()
        pre = [asyncio.ensure_future(pool.get(h, 1000, PREFETCH)) for h in hs[1:11]]
        await asyncio.sleep(0.005)
        demand = await pool.get(hs[15], 1000, DEMAND)
        assert demand == blobs[hs[15]]
        # one worker is kept for demand: the demand fetch ran while at most 2 prefetches had started
        assert store.calls.index(hs[15]) <= 2, store.calls
        # a demand read joining a queued prefetch promotes it
        late = hs[10]
        await pool.promote(late, DEMAND)
        await asyncio.gather(*pre)
        assert store.calls.index(late) < len(store.calls) - 1
        with pytest.raises(ChunkError) as ei:
            await pool.get(bad, 5, DEMAND)
        assert ei.value.reason == "verify" and store.calls.count(bad) == 3  # 1 + 2 retries
        missing = "f" * 64
        with pytest.raises(ChunkError) as ei:
            await pool.get(missing, 10, DEMAND)
        assert ei.value.reason == "not_found" and store.calls.count(missing) == 1
    finally:
        await pool.stop()
