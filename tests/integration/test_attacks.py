"""An attack corpus: what a hostile agent tries from inside a container sandbox, one test each.

Every attack prints ESCAPED if the thing it tries works and BLOCKED if it is refused, so each
test states exactly what success would look like for the attacker. After each one the host is
checked untouched (a marker file, the host's hostname and clock) and the node still serves (a
neighbour sandbox execs). Attacks written elsewhere with more machinery (harness forging,
tenants, denied-syscall floods, fork and memory bombs, output floods, seccomp, protected paths)
live beside their feature: test_isolation.py, test_tenancy.py, test_audit_sources.py,
test_reward_hacking.py, test_bus_auth.py."""
from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time

import pytest

# (name, shell run as the agent, resource limits it needs); `try X` prints BLOCKED when X fails
TRY = 'try() { if ( eval "$1" ) >/dev/null 2>&1; then echo "ESCAPED: $1"; else echo "BLOCKED: $1"; fi; }; '


def _host_ip() -> str:
    """An address of this machine outside the loopback (what a sandbox would reach the host by)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.2"
    finally:
        s.close()


ATTACKS: list[tuple[str, str]] = [
    # escapes: mounts, namespaces, devices, kernel interfaces
    ("mount_tmpfs", "try 'mount -t tmpfs x /mnt'"),
    ("mount_proc_again", "try 'mkdir -p /p && mount -t proc proc /p'"),
    ("bind_mount_root", "try 'mount --bind / /mnt'"),
    ("remount_proc_rw", "try 'mount -o remount,rw /proc/sys'"),
    ("unshare_mount_ns", "try 'unshare -m true'"),
    ("unshare_user_ns", "try 'unshare -U true'"),
    ("unshare_net_ns", "try 'unshare -n true'"),
    ("nsenter_init", "try 'nsenter -t 1 -m -u -n true'"),
    ("chroot", "try 'chroot / true'"),
    ("mknod_block_device", "try 'mknod /tmp/sda b 8 0'"),
    ("open_host_disk", "try 'cat /dev/sda /dev/vda /dev/nvme0n1 /dev/mem /dev/kmsg'"),
    ("core_pattern", "try 'echo \"|/tmp/x\" > /proc/sys/kernel/core_pattern'"),
    ("sysrq_trigger", "try 'echo h > /proc/sysrq-trigger'"),
    ("sysfs_write", "try 'echo 1 > /sys/kernel/mm/ksm/run'"),
    ("kcore", "try 'head -c 16 /proc/kcore | grep -q .'"),
    ("kallsyms_addresses", "try 'grep -v \"^0000000000000000\" /proc/kallsyms | grep -q .'"),
    ("kernel_log", "try 'dmesg'"),
    ("load_module", "try 'insmod /tmp/x.ko || modprobe dummy'"),
    ("set_clock", "date -s '2001-01-01 00:00:00' >/dev/null 2>&1; try 'date +%Y | grep -q 2001'"),
    ("set_hostname", "try 'hostname pwned'"),
    ("network_interfaces", "try 'ip link add d0 type dummy || ifconfig lo down'"),
    ("raw_socket", "try 'arping -c1 -w1 -I lo 127.0.0.1'"),
    ("init_root_link", "try 'ls /proc/1/root/ && cat /proc/1/environ'"),
    ("init_control_socket", "try 'readlink /proc/1/fd/3'"),
    ("corral_init_binary", "try 'echo x >> /.corral/init'"),
    ("corral_io_dir", "try 'touch /.corral/io/x || ls /.corral/io'"),
    ("setuid_escalation", "cp /bin/busybox /tmp/bb && chmod u+s /tmp/bb; "
                          "try '/tmp/bb grep -q \"^CapEff:.*[1-9a-f]\" /proc/self/status'"),
    # reaching out: the host, the bus, other sandboxes
    ("reach_host", "try 'nc -w 2 {host_ip} 22 </dev/null || nc -w 2 {host_ip} {nats_port} </dev/null'"),
    ("reach_bus_on_loopback", "try 'nc -w 2 127.0.0.1 {nats_port} </dev/null'"),
    ("drop_host_caches", "try 'echo 3 > /proc/sys/vm/drop_caches'"),
    ("other_cgroups", "try 'ls /sys/fs/cgroup/pids/ | grep -q sb-'"),
    ("host_processes", "try 'ls /proc | grep -E \"^[0-9]+$\" | awk \"\\$1 > 1000\" | grep -q .'"),
    # signalling: init, everything
    ("kill_init", "kill -9 1; kill -SEGV 1; sleep 0.2; try 'test ! -d /proc/1'"),
    ("kill_everything", "kill -9 -1; sleep 0.2; try 'test ! -d /proc/1'"),
    # exhaustion within the sandbox's own bounds
    ("fill_disk", "try 'dd if=/dev/zero of=/fill bs=1M count=64'"),
    ("fill_dev_shm", "try 'dd if=/dev/zero of=/dev/shm/fill bs=1M count=128'"),
    ("fill_dev", "try 'dd if=/dev/zero of=/dev/fill bs=1M count=128'"),
    ("many_processes", "try 'for i in $(seq 1 200); do sleep 30 & done; wait'"),
    ("raise_rlimits", "try 'ulimit -n 1048576' ; try 'ulimit -c unlimited'"),
    ("init_memory", "try 'exec 5</proc/1/mem'"),
]


@pytest.fixture(scope="module")
async def host_marker():
    path = f"/tmp/corral-attack-marker-{secrets.token_hex(6)}"
    with open(path, "wb") as f:
        f.write(secrets.token_bytes(64))
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    yield path, digest
    os.unlink(path)


@pytest.fixture(scope="module")
async def neighbour(client):
    sb = await client.create(image="busybox", cpu=0.2, memory_mb=64, ttl_s=1800)
    yield sb
    await sb.destroy()


@pytest.mark.parametrize("name,script", ATTACKS, ids=[a[0] for a in ATTACKS])
async def test_attack_is_blocked_and_the_host_untouched(stack, client, neighbour, host_marker, name, script):
    hostname, t0 = socket.gethostname(), time.time()
    sb = await client.create(image="busybox", cpu=0.5, memory_mb=128, disk_mb=16, pids_max=64, ttl_s=600)
    try:
        cmd = TRY + script.format(host_ip=_host_ip(), nats_port=stack.nats_port)
        r = await sb.exec(cmd, timeout_s=60)
        lines = r.stdout.splitlines()
        assert any(ln.startswith("BLOCKED") for ln in lines), (name, r)
        assert not any(ln.startswith("ESCAPED") for ln in lines), (name, r)
        # the attacked sandbox still answers (or, having killed everything, is still there to destroy)
        await sb.exec("true", timeout_s=30)
    finally:
        await sb.destroy()
    path, digest = host_marker
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest
    assert socket.gethostname() == hostname
    assert abs(time.time() - t0) < 600  # the host clock was not moved (a run takes seconds)
    assert (await neighbour.exec("echo alive")).stdout == "alive\n"
