"""A classic-BPF interpreter for seccomp programs, so tests can say what a filter answers a
syscall (struct seccomp_data in, SECCOMP_RET_* out) without running one: two programs that
differ in layout (runc's compilation is not byte-for-byte stable: its Go maps) are compared by
what they answer over every syscall number of each architecture and the argument values the
policy's rules test."""
from __future__ import annotations

import operator
import random
import struct
from typing import Any, Callable, Iterator

AUDIT_ARCH = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_X86": 0x40000003, "SCMP_ARCH_X32": 0xC000003E,
              "SCMP_ARCH_AARCH64": 0xC00000B7, "SCMP_ARCH_ARM": 0x40000028}
X32_BIT = 0x40000000
M32, M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000

_ALU: dict[int, Callable[[int, int], int]] = {
    0x00: operator.add, 0x10: operator.sub, 0x20: operator.mul, 0x30: lambda a, b: a // b if b else 0,
    0x40: operator.or_, 0x50: operator.and_, 0x60: lambda a, b: a << b, 0x70: lambda a, b: a >> b,
    0x80: lambda a, _: -a, 0x90: lambda a, b: a % b if b else 0, 0xA0: operator.xor,
}


def decode(prog: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]


def run(prog: bytes | list[tuple[int, int, int, int]], data: bytes) -> int:
    """What `prog` (struct sock_filter[], or decode() of one) returns for `data` (struct seccomp_data)."""
    insns = decode(prog) if isinstance(prog, bytes) else prog
    a = x = pc = 0
    mem = [0] * 16
    for _ in range(len(insns) + 1):  # classic BPF only jumps forward: at most one pass
        code, jt, jf, k = insns[pc]
        pc += 1
        cls, src = code & 0x07, (x if code & 0x08 else k)
        if cls in (0x00, 0x01):  # LD, LDX
            mode = code & 0xE0
            v = (struct.unpack_from("<I", data, k)[0] if mode == 0x20 else k if mode == 0x00
                 else mem[k] if mode == 0x60 else len(data) if mode == 0x80 else None)
            if v is None:
                raise ValueError(f"unsupported load {code:#x} at {pc - 1}")
            if cls == 0x00:
                a = v
            else:
                x = v
        elif cls == 0x02:
            mem[k] = a
        elif cls == 0x03:
            mem[k] = x
        elif cls == 0x04:
            a = _ALU[code & 0xF0](a, src) & M32
        elif cls == 0x05:
            op = code & 0xF0
            if op == 0x00:
                pc += k
            else:
                cond = {0x10: a == src, 0x20: a > src, 0x30: a >= src, 0x40: bool(a & src)}[op]
                pc += jt if cond else jf
        elif cls == 0x06:
            return a if code & 0x18 == 0x10 else k
        else:  # MISC: TAX / TXA
            if code & 0xF8 == 0x00:
                x = a
            else:
                a = x
    raise ValueError("the program did not return")


def data(nr: int, arch: int, args: tuple[int, ...] = ()) -> bytes:
    a = (list(args) + [0] * 6)[:6]
    return struct.pack("<iIQ6Q", nr if nr < 2**31 else nr - 2**32, arch, 0, *(v & M64 for v in a))


def syscall_number(name: str, arch: str) -> int | None:
    """libseccomp's number for `name` on `arch` (an SCMP_ARCH_* name), None if it has none there."""
    import ctypes

    lib = ctypes.CDLL("libseccomp.so.2")
    token = {"SCMP_ARCH_X32": 0x4000003E}.get(arch, AUDIT_ARCH[arch])
    nr = lib.seccomp_syscall_resolve_name_arch(ctypes.c_uint32(token), name.encode())
    return None if nr < 0 else nr


def probes(profile: dict[str, Any], max_nr: int = 512, seed: int = 7) -> Iterator[bytes]:
    """seccomp_data for every syscall number below `max_nr` (and a few beyond) of each of the
    profile's architectures, with zero and with random arguments; and for each syscall a rule
    tests the arguments of, the values it compares (and their neighbours) in that argument."""
    values: dict[str, set[tuple[int, int]]] = {}
    for rule in profile["syscalls"]:
        for c in rule.get("args", []):
            for v in (c["value"], c.get("valueTwo", 0), c["value"] | c.get("valueTwo", 0)):
                for w in (v, v + 1, v - 1, v | (1 << 32), ~v):
                    for name in rule["names"]:
                        values.setdefault(name, set()).add((c["index"], w & M64))
    rnd = random.Random(seed)
    randoms = [tuple(rnd.getrandbits(64) for _ in range(6)) for _ in range(3)]
    for arch_name in profile["architectures"]:
        arch = AUDIT_ARCH[arch_name]
        bit = X32_BIT if arch_name == "SCMP_ARCH_X32" else 0
        for nr in [*range(max_nr), 1000, 0xFFFF]:
            yield data(nr | bit, arch)
            for r in randoms:
                yield data(nr | bit, arch, r)
        yield data(M32, arch)
        for name, vals in values.items():
            nr = syscall_number(name, arch_name)
            if nr is None:
                continue
            for i, v in sorted(vals):
                yield data(nr, arch, tuple(v if j == i else 0 for j in range(6)))
    yield data(0, 0x12345678)  # an architecture the profile does not list


def same_answers(a: bytes, b: bytes, profile: dict[str, Any]) -> list[str]:
    """Where programs `a` and `b` answer differently over `probes(profile)`: [] if nowhere."""
    out = []
    da, db = decode(a), decode(b)
    for d in probes(profile):
        ra, rb = run(da, d), run(db, d)
        if ra != rb:
            nr, arch = struct.unpack_from("<iI", d)
            out.append(f"nr {nr} arch {arch:#x} args {struct.unpack_from('<6Q', d, 16)}: {ra:#x} != {rb:#x}")
    return out
