"""What a watched connect or sendto names, read while its caller waits in the notified call: the
destination (the sockaddr in the caller's memory) and the protocol of the socket (a copy of the
caller's fd), so the monitor can tell a stream connect or a datagram sent (egress) from a
datagram socket's connect, which sends nothing."""
from __future__ import annotations

import ctypes
import os
import socket
import struct


def read_mem(pid: int, addr: int, size: int) -> bytes:
    """`size` bytes at `addr` in process `pid` (which is stopped in a notified syscall)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, addr)
    finally:
        os.close(fd)


AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64 (and every arch of the generic table)
_SOCK_PROTO = {socket.SOCK_STREAM: "tcp", socket.SOCK_DGRAM: "udp", socket.SOCK_RAW: "raw", socket.SOCK_SEQPACKET: "seqpacket"}
_libc = ctypes.CDLL(None, use_errno=True)


def _tgid(tid: int) -> int:
    with open(f"/proc/{tid}/status") as f:
        for line in f:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    return tid


def socket_proto(pid: int, fd: int) -> str:
    """tcp/udp/raw of the caller's socket `fd` (a copy taken with pidfd_getfd; the caller waits in
    its notified syscall), "" when it cannot be told. A datagram socket's connect sends nothing:
    resolvers and browsers use it to learn which source address a route would take."""
    try:  # the notified pid is a thread's id; pidfd_open wants its process (fds are the process's)
        pidfd = os.pidfd_open(_tgid(pid))
    except (OSError, ValueError):
        return ""
    try:
        copy = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            return ""
        with socket.socket(fileno=copy) as s:
            return _SOCK_PROTO.get(s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE), "")
    except OSError:
        return ""
    finally:
        os.close(pidfd)


def sockaddr(raw: bytes) -> tuple[int, str, int]:
    """(family, host, port) of a struct sockaddr; host "" for families other than IPv4/IPv6."""
    if len(raw) < 2:
        return 0, "", 0
    fam = struct.unpack_from("=H", raw)[0]
    if fam == AF_INET and len(raw) >= 8:
        return fam, socket.inet_ntop(socket.AF_INET, raw[4:8]), struct.unpack_from("!H", raw, 2)[0]
    if fam == AF_INET6 and len(raw) >= 24:
        return fam, socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack_from("!H", raw, 2)[0]
    return fam, "", 0


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def network_call(pid: int, name: str, args: tuple[int, ...]) -> tuple[str, str, bool, dict[str, str]] | None:
    addr, size = (args[1], args[2]) if name == "connect" else (args[4], args[5])
    size &= 0xFFFFFFFF
    if not addr or size < 2:
        return None
    fam, host, port = sockaddr(read_mem(pid, addr, min(size, 128)))
    if fam not in (AF_INET, AF_INET6) or not host or is_loopback(host):
        return None  # unix sockets and loopback: local, not egress
    target = f"[{host}]:{port}" if fam == AF_INET6 else f"{host}:{port}"
    fd = args[0] & 0xFFFFFFFF
    return "net", target, False, {"family": "inet6" if fam == AF_INET6 else "inet", "host": host, "port": str(port),
                                  "fd": str(fd), "proto": socket_proto(pid, fd)}
