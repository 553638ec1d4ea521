"""Shared fixtures: a real embedded stack (nats-server, scheduler, node-agents as processes).

Images are cached across runs in $CORRAL_IMAGE_DIR (default /var/lib/corral/images) so the
debian image is debootstrapped once per machine; everything else lives in a fresh short data
dir (unix socket paths must stay under 108 bytes)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import nats
import pytest_asyncio

from corral_sdk import AsyncClient
from corral_sdk.stack import Stack, free_port

from .leaks import assert_clean

IMAGE_DIR = os.environ.get("CORRAL_IMAGE_DIR", "/var/lib/corral/images")


def make_stack(nodes: int = 1, **kw) -> Stack:
    """ephemeral: if pytest is killed (SIGKILL), the stack guard stops the stack and removes its data dir."""
    data = tempfile.mkdtemp(prefix="crl-", dir="/tmp")
    kw.setdefault("ephemeral", True)
    return Stack(data_dir=data, nodes=nodes, nats_port=free_port(), image_dir=IMAGE_DIR, **kw)


@contextlib.asynccontextmanager
async def running_stack(nodes: int = 1, **kw) -> AsyncIterator[Stack]:
    """A started stack of a test's (or fixture's) own; afterwards stopped, checked to have left
    nothing behind on any of its nodes (leaks.assert_clean), and its data dir removed, whether the
    test passed or not (Stack.stop sweeps the stack's mounts and cgroups first)."""
    s = make_stack(nodes=nodes, **kw)
    try:
        try:
            await s.start()
            yield s
        finally:
            await s.stop()
        for i in range(s.nodes):
            assert_clean(s.data_dir, f"node-{i + 1}")
    finally:  # also when the test (or the leak check) failed: a failed run leaves no data dir behind
        shutil.rmtree(s.data_dir, ignore_errors=True)


def ensure_builtin_images() -> None:
    """busybox and debian must exist before the image-cache starts (it imports what is built);
    debian is debootstrapped once per machine (~1 minute), a no-op afterwards."""
    for name in ("busybox", "debian"):
        subprocess.run([sys.executable, "-m", "corral_image_cache.builtin", "build", name, "--root", IMAGE_DIR],
                       check=True, stdout=subprocess.DEVNULL)


@pytest_asyncio.fixture(scope="session")
async def stack():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1) as s:
        yield s


@pytest_asyncio.fixture(scope="session")
async def client(stack):
    c = await AsyncClient.connect(stack.url)
    yield c
    await c.close()


@pytest_asyncio.fixture
async def nc(stack):
    """A plain nats-py connection, for speaking the contract without the SDK."""
    conn = await nats.connect(stack.url)
    yield conn
    await conn.close()


@pytest_asyncio.fixture
async def sandbox(client):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600)
    yield sb
    try:
        await sb.destroy()
    except Exception:
        pass
