"""Forks of a container sandbox (SandboxSpec.fork_of): a new sandbox on the source's node and image
whose files start as a copy of what the source wrote, taken while the source is frozen; the two
diverge from there, the source keeps running, and the fork keeps the source's protections."""
from __future__ import annotations

import json
import os

import pytest

from corral_common.contract import labels, subjects
from corral_sdk import InvalidRequest, NotFound

from .test_tenancy import two_tenants  # noqa: F401  (fixture)


def sandboxes_dir(stack, node: str) -> str:
    return f"{stack.data_dir}/nodes/{node}/sandboxes"


async def test_a_fork_starts_with_the_sources_files_and_goes_its_own_way(stack, client):
    src = await client.create(image="busybox", cpu=0.25, memory_mb=64, labels={"run": "r1"})
    fork = None
    try:
        setup = ("mkdir -p /work/sub && echo one > /work/a && chmod 640 /work/a"
                 " && ln -s /work/a /work/link && ln /work/a /work/hard && rm /bin/vi && rm -rf /etc/init.d"
                 " && mkdir /etc/init.d && echo new > /etc/init.d/only && dd if=/dev/urandom of=/work/big bs=1M count=8 2>/dev/null"
                 " && md5sum /work/big > /work/big.md5"
                 " && (sleep 300 &)")
        r = await src.exec(setup)
        assert r.exit_code == 0, r
        fork = await src.fork(cpu=0.25, memory_mb=64)
        assert fork.id != src.id and fork.info.node == src.info.node and fork.info.image == src.info.image
        assert fork.info.labels.get(labels.FORK_OF) == src.id and fork.info.labels.get("run") == "r1", fork.info.labels
        check = ("cat /work/a; stat -c '%u:%g %a' /work/a; readlink /work/link; stat -c %h /work/hard;"
                 " md5sum -c /work/big.md5 >/dev/null && echo md5-ok; ls /bin/vi 2>&1 >/dev/null | grep -c 'No such';"
                 " ls /etc/init.d; ls /work/sub && echo sub-ok")
        r = await fork.exec(check)
        assert r.exit_code == 0, r
        lines = r.stdout.splitlines()
        assert lines[0] == "one" and lines[1].endswith(" 640") and lines[2:] == ["/work/a", "2", "md5-ok", "1", "only", "sub-ok"], r
        assert (await src.exec(check)).stdout == r.stdout  # owners and all, as in the source
        # files, not processes: the source's sleeper is not in the fork, and still runs in the source
        sleepers = "ps -o args | grep -c '^sleep 300'"
        assert (await fork.exec(sleepers)).stdout == "0\n"
        assert (await src.exec(sleepers)).stdout == "1\n"
        assert (await src.refresh()).state == "running"
        # from here each goes its own way
        await fork.exec("echo fork > /work/a; echo f > /work/only-fork")
        await src.exec("echo src > /work/a; echo s > /work/only-src")
        r = await src.exec("cat /work/a; ls /work/only-fork 2>/dev/null || echo none")
        assert r.stdout.splitlines() == ["src", "none"], r
        r = await fork.exec("cat /work/a; ls /work/only-src 2>/dev/null || echo none")
        assert r.stdout.splitlines() == ["fork", "none"], r
        # a fork of a fork
        fork2 = await fork.fork(cpu=0.25, memory_mb=64)
        try:
            assert (await fork2.exec("cat /work/a /work/only-fork")).stdout == "fork\nf\n"
            assert fork2.info.labels.get(labels.FORK_OF) == fork.id
        finally:
            await fork2.destroy()
    finally:
        if fork is not None:
            await fork.destroy()
        await src.destroy()


async def test_a_fork_runs_its_commands_as_the_source_does(stack, client):
    src = await client.create(image="busybox", cpu=0.3, memory_mb=96, env={"MODE": "src", "KEEP": "k"}, workdir="/work")
    try:
        fork = await src.fork(env={"MODE": "fork"})  # limits default to the source's
        try:
            assert (fork.info.cpu, fork.info.memory_mb) == (0.3, 96), fork.info
            assert (await fork.exec("echo $MODE $KEEP; pwd")).stdout == "fork k\n/work\n"
        finally:
            await fork.destroy()
    finally:
        await src.destroy()


async def test_a_fork_keeps_the_sources_protections(stack, client):
    src = await client.create(image="busybox", cpu=0.25, memory_mb=64, protected_paths=["/etc/passwd"],
                              canaries={"/root/.netrc": "machine x login y password canary\n"})
    try:
        assert "Operation not permitted" in (await src.exec("cat /etc/passwd")).stderr
        fork = await src.fork(cpu=0.25, memory_mb=64)  # asks for no protection of its own
        try:
            r = await fork.exec("cat /etc/passwd; cat /root/.netrc")
            assert "root:" not in r.stdout and "passwd': Operation not permitted" in r.stderr, r
            assert "password canary" in r.stdout, r
        finally:
            await fork.destroy()
    finally:
        await src.destroy()


async def test_forks_refused_clearly_and_leave_nothing(stack, client):
    src = await client.create(image="busybox", cpu=0.25, memory_mb=64)
    node = src.info.node
    try:
        before = set(os.listdir(sandboxes_dir(stack, node)))
        with pytest.raises(NotFound, match="to fork"):
            await client.create(fork_of="sb-000000000000", cpu=0.25, memory_mb=64)
        # more written than the fork's disk holds
        assert (await src.exec("dd if=/dev/urandom of=/big bs=1M count=6 2>/dev/null && echo ok")).stdout == "ok\n"
        with pytest.raises(InvalidRequest, match="do not fit the fork's disk_mb=4"):
            await src.fork(cpu=0.25, memory_mb=64, disk_mb=4)
        assert set(os.listdir(sandboxes_dir(stack, node))) == before
        assert (await src.exec("echo still-here")).stdout == "still-here\n"  # thawed after the failed copy
        # a container's memory cannot be snapshot (its files can)
        with pytest.raises(InvalidRequest, match="cannot snapshot memory"):
            await src.snapshot("not-made", memory=True)
        # a paused sandbox is not forked (resume it first)
        await src.pause()
        with pytest.raises(InvalidRequest, match="only a running sandbox can be forked"):
            await src.fork(cpu=0.25, memory_mb=64)
        await src.resume()
        # a one-shot run does not fork
        body = {"spec": {"fork_of": src.id}, "exec": {"cmd": "true"}}
        r = json.loads((await client.nc.request(subjects.SANDBOX_RUN, json.dumps(body).encode(), timeout=30)).data)
        assert r["error"]["code"] == "invalid_request" and "cannot fork" in r["error"]["message"], r
        assert set(os.listdir(sandboxes_dir(stack, node))) == before
    finally:
        await src.destroy()
    # a destroyed sandbox is not found
    with pytest.raises(NotFound, match="to fork"):
        await client.create(fork_of=src.id, cpu=0.25, memory_mb=64)


async def test_a_batch_of_forks_on_the_sources_node(stack, client):
    """N branches of one sandbox in one request (a batch with fork_of), idempotent like any batch."""
    src = await client.create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        await src.exec("echo branch-point > /root/state")
        rid = f"forks-{src.id}"
        forks = await client.create_batch(3, fork_of=src.id, cpu=0.1, memory_mb=32, request_id=rid)
        try:
            assert len({f.id for f in forks}) == 3 and all(f.info.node == src.info.node for f in forks)
            for f in forks:
                assert f.info.labels.get(labels.FORK_OF) == src.id
                assert (await f.exec("cat /root/state")).stdout == "branch-point\n"
            await forks[0].exec("echo mine > /root/state")
            assert (await forks[1].exec("cat /root/state")).stdout == "branch-point\n"
            again = await client.create_batch(3, fork_of=src.id, cpu=0.1, memory_mb=32, request_id=rid)
            assert [f.id for f in again] == [f.id for f in forks]  # asked again: the same forks, none more
        finally:
            for f in forks:
                await f.destroy()
    finally:
        await src.destroy()
    with pytest.raises(NotFound, match="to fork"):
        await client.create_batch(2, fork_of=src.id, cpu=0.1, memory_mb=32)


async def test_a_tenant_cannot_fork_anothers_sandbox(stack, client, two_tenants):  # noqa: F811
    a, b, clients, _ = two_tenants
    sb = await clients[a].create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        await sb.exec("echo secret > /root/mine")
        with pytest.raises(NotFound, match="to fork"):
            await clients[b].create(fork_of=sb.id, cpu=0.2, memory_mb=64)
        own = await clients[a].create(fork_of=sb.id, cpu=0.2, memory_mb=64)
        try:
            assert own.info.tenant == a and (await own.exec("cat /root/mine")).stdout == "secret\n"
        finally:
            await own.destroy()
    finally:
        await sb.destroy()
