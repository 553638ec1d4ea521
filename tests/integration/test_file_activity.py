"""General file activity of sandboxes (audit/files.py): fanotify notification events on the
sandbox's root filesystem, reported as AuditEvent(kind="file", op=...) with path and pid."""
from __future__ import annotations

import asyncio

import pytest

from corral_common.contract import subjects

from .test_audit_sources import Watch


def _ops(w: Watch) -> set[tuple[str, str]]:
    return {(e.op, e.path) for e in w.of("file")}


async def test_file_activity_of_a_container_sandbox_is_audited_with_path_and_pid(client, nc):
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600, job="audit-files", workdir="/work")
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            await sb.files.write("/work/by_agent.txt", b"from the agent\n")
            r = await sb.exec("echo hi > notes.txt && mv notes.txt renamed.txt && cat /etc/passwd >/dev/null && "
                              "mkdir d && rmdir d && cp /bin/busybox ./true && ./true && rm renamed.txt && rm /etc/group && echo done")
            assert r.stdout == "done\n", (r.stdout, r.stderr)
            want = {("create", "/work/notes.txt"), ("write", "/work/notes.txt"), ("rename", "/work/renamed.txt"),
                    ("open", "/etc/passwd"), ("mkdir", "/work/d"), ("rmdir", "/work/d"), ("create", "/work/true"),
                    ("exec", "/work/true"), ("unlink", "/work/renamed.txt"), ("unlink", "/etc/group")}
            await w.until(lambda: want <= _ops(w), what="file activity events")
            ren = next(e for e in w.of("file") if e.op == "rename")
            assert ren.detail["from"] == "/work/notes.txt"
            for e in w.of("file"):
                if e.op in ("create", "rename", "unlink", "mkdir", "rmdir", "open", "exec"):
                    assert e.pid > 1 and e.job == "audit-files" and e.node == sb.info.node, e
            # comm is read when the event is handled: a short-lived process may be gone by then
            cat = next(e for e in w.of("file") if e.op == "open" and e.path == "/etc/passwd")
            assert cat.comm in ("cat", "")
            # the agent's own writes (files.write, canaries) are audited by the request, not as file activity
            assert not any(e.path == "/work/by_agent.txt" for e in w.of("file"))
            assert not any(e.op == "dropped" for e in w.of("file"))
    finally:
        await sb.destroy()


def _metric(url: str, name: str) -> float:
    import re
    import urllib.request

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))


async def test_repeated_records_are_skipped_undecoded_and_new_files_still_reported(client, nc, stack):
    """Records that repeat a coalesced one byte for byte (other processes opening the same file)
    are skipped before decoding (counted); the first of them and any new file are still reported."""
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, ttl_s=600, job="audit-files-raw", workdir="/work")
    url = stack.proc(sb.info.node).metrics_url
    try:
        async with Watch(nc, sb.info.node, sb.id) as w:
            r = await sb.exec("echo a > /work/r.txt && echo ok")
            assert r.stdout == "ok\n", r
            await w.until(lambda: ("create", "/work/r.txt") in _ops(w), what="r.txt created")
            before = _metric(url, "corral_file_activity_raw_repeats_total")
            # a subshell each: ten processes (records of one process are merged by the kernel)
            r = await sb.exec("for i in 1 2 3 4 5 6 7 8 9 10; do (cat /work/r.txt >/dev/null); done; echo ok")
            assert r.stdout == "ok\n", r
            await w.until(lambda: ("open", "/work/r.txt") in _ops(w), what="the first open of r.txt")
            r = await sb.exec("cat /etc/passwd /work/r.txt > /work/new.txt && echo ok")
            assert r.stdout == "ok\n", r
            await w.until(lambda: {("open", "/etc/passwd"), ("create", "/work/new.txt"), ("write", "/work/new.txt")} <= _ops(w),
                          what="the later, new file events")
            skipped = _metric(url, "corral_file_activity_raw_repeats_total") - before
            assert skipped >= 5, skipped  # nine more processes opened r.txt
            assert sum(1 for e in w.of("file") if e.op == "open" and e.path == "/work/r.txt") == 1
    finally:
        await sb.destroy()


REPO_SETUP = r"""set -e
git config --global user.email agent@example.com; git config --global user.name agent; git config --global init.defaultBranch main
cd /repo
git init -q . && git add -A && git commit -qm initial
git checkout -qb upstream-fix && sed -i 's/a - b/a + b/' calc.py && git commit -qam 'fix add' && git checkout -q main
"""


async def test_file_events_catch_what_command_text_cannot(client, nc):
    """Test tampering through an obfuscated command, and `git log <local branch>`: only the
    file events show them. Ordinary work on HEAD's branch stays quiet."""
    sb = await client.create(image="debian", cpu=0.5, memory_mb=256, ttl_s=600, job="audit-files")
    try:
        # the task's files come from the environment (files API: not the agent's doing)
        await sb.files.write("/repo/calc.py", b"def add(a, b):\n    return a - b\n")
        await sb.files.write("/repo/tests/test_calc.py", b"from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
        r = await sb.exec(REPO_SETUP, timeout_s=60)
        assert r.exit_code == 0, r
        async with Watch(nc, sb.info.node, sb.id) as w:
            # benign: status, log and diff of HEAD, listing branches, running the tests (pycache)
            r = await sb.exec("cd /repo && git status && git log --oneline && git diff && git branch -a && "
                              "python3 -c 'import sys; sys.path[:0] = [\"\", \"tests\"]; import test_calc' && echo ok", timeout_s=30)
            assert r.stdout.strip().endswith("ok"), (r.stdout, r.stderr)
            await w.until(lambda: any(e.detail.get("git_ref") == "refs/heads/upstream-fix" for e in w.of("file")),
                          what="git branch -a reading the other branch's ref")
            assert not w.alerts, [(a.rule, a.message) for a in w.alerts]
            # `git log upstream-fix`: the text names no remote, sha or flag; the ref read gives it away
            await sb.exec("cd /repo && git log -p upstream-fix | head -20")
            await w.until(lambda: "git_history_mining" in {a.rule for a in w.alerts}, what="git_history_mining alert")
            a = next(a for a in w.alerts if a.rule == "git_history_mining")
            assert a.evidence[0].kind == "file" and "upstream-fix" in a.message and "HEAD is main" in a.message
            # deleting the test through a command whose text hides it
            await sb.exec("cd /repo && sh -c \"$(echo cm0gdGVzdHMvdGVzdF9jYWxjLnB5 | base64 -d)\" && ls tests")
            await w.until(lambda: "test_tampering" in {a.rule for a in w.alerts}, what="test_tampering alert")
            t = next(a for a in w.alerts if a.rule == "test_tampering")
            assert t.evidence[0].kind == "file" and t.evidence[0].op == "unlink" and t.evidence[0].path == "/repo/tests/test_calc.py"
    finally:
        await sb.destroy()


async def test_a_busy_sandbox_cannot_flood_the_bus():
    """Past its burst, a sandbox's file events are rate-limited; the drops are counted and
    reported as `dropped` audit events. (A node with a small budget: 200 events, then 50/s.)"""
    import nats

    from corral_sdk import AsyncClient

    from ..conftest import make_stack
    from ..leaks import assert_clean

    stack = make_stack(nodes=1, monitor=False, node_args=["--file-events-rate", "50", "--file-events-burst", "200"])
    await stack.start()
    try:
        c = await AsyncClient.connect(stack.url)
        conn = await nats.connect(stack.url)
        sb = await c.create(image="busybox", cpu=0.5, memory_mb=128)
        async with Watch(conn, sb.info.node, sb.id) as w:
            r = await sb.exec("mkdir /tmp/many && cd /tmp/many && i=0; while [ $i -lt 2000 ]; do : > f$i; i=$((i+1)); done; echo ok",
                              timeout_s=120)
            assert r.stdout == "ok\n", r
            await w.until(lambda: sum(int(e.detail.get("dropped", "0")) for e in w.of("file") if e.op == "dropped") > 0,
                          what="a dropped-events report")
            creates = [e for e in w.of("file") if e.op == "create" and e.path.startswith("/tmp/many/")]
            assert creates and len(creates) < 2000, len(creates)  # the first ones came through, not all
            d = next(e for e in w.of("file") if e.op == "dropped")
            assert d.detail["reason"] in ("rate_limit", "queue_overflow") and d.sandbox == sb.id
        await sb.destroy()
        await conn.close()
        await c.close()
    finally:
        await stack.stop()
    assert_clean(stack.data_dir, "node-1")
    import shutil

    shutil.rmtree(stack.data_dir, ignore_errors=True)


@pytest.mark.parametrize("substrate", ["function", "container"])
async def test_a_one_shot_run_has_file_activity_too(client, nc, substrate):
    """`sandbox.run` is a sandbox for the length of one command (one-shot graders and tools are
    where a cheat would hide): its file activity is audited under the run's id, job and labels."""
    import secrets

    import msgspec
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from corral_common.contract.audit import AuditBatch

    job = f"one-shot-{secrets.token_hex(4)}"
    events = []

    async def on_audit(msg) -> None:
        events.extend(e for e in msgspec.json.decode(msg.data, type=AuditBatch).events if e.job == job)

    sub = await nc.jetstream().subscribe(subjects.audit("*", "*"), cb=on_audit, ordered_consumer=True,
                                         config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW))
    try:
        r = await client.run("echo hi > /tmp/one-shot.txt && cat /etc/passwd >/dev/null && rm /etc/group && echo done",
                             substrate=substrate, job=job, labels={"t": "one-shot"})
        assert r.stdout == "done\n", (r.stdout, r.stderr)
        want = {("create", "/tmp/one-shot.txt"), ("open", "/etc/passwd"), ("unlink", "/etc/group")}
        for _ in range(300):
            if want <= {(e.op, e.path) for e in events if e.kind == "file"}:
                break
            await asyncio.sleep(0.05)
        files = [e for e in events if e.kind == "file"]
        assert want <= {(e.op, e.path) for e in files}, [(e.op, e.path) for e in files]
        runs = {e.sandbox for e in events if e.kind == "exec"}
        assert len(runs) == 1, events
        assert all(e.sandbox in runs and e.labels == {"t": "one-shot"} and e.pid > 1 for e in files if e.op != "dropped"), files
    finally:
        await sub.unsubscribe()
