"""What ptxas gave a compiled kernel: its registers per thread and its stack frame, from the cubin.

A CTA of T threads at R registers each fits floor(65 536 / (R·T)) times on an SM (R rounded up to
8, the allocation unit), so registers decide the residency a tiling was chosen for; a stack frame
means ptxas spilled or put an array in local memory. Both are attributes of the ELF's `.nv.info`
sections (EIATTR_REGCOUNT and EIATTR_FRAME_SIZE, one entry per kernel), so a CPU compile with
`--keep-cubin` (its `artifacts.CUBIN`) can check them without a GPU. Our programs hold one kernel
each; for a cubin of several the figures are their maxima.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

REGISTERS_PER_SM = 65536  # sm_90 and sm_100: 64 K 32-bit registers per SM
_REGISTER_UNIT = 8
_EIFMT_SVAL = 0x04  # an attribute with a sized payload; the other formats are 4-byte entries
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F


@dataclass(frozen=True)
class KernelResources:
    registers: int  # per thread
    frame_bytes: int  # per thread, in local memory

    def ctas_per_sm(self, threads: int) -> int:
        """CTAs of `threads` threads that the registers let one SM hold."""
        per_thread = -(-self.registers // _REGISTER_UNIT) * _REGISTER_UNIT
        return REGISTERS_PER_SM // (per_thread * threads)


def _sections(cubin: bytes) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every section of a little-endian ELF64 file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin (compile with --keep-cubin and pass artifacts.CUBIN)")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]

    def name(at: int) -> str:
        return cubin[names + at:cubin.index(b"\0", names + at)].decode()
    return [(name(h[0]), h[4], h[5]) for h in headers]


def kernel_resources(cubin: bytes) -> KernelResources:
    """The registers per thread and the stack frame ptxas gave the kernel(s) of `cubin`."""
    found = {_EIATTR_REGCOUNT: 0, _EIATTR_FRAME_SIZE: 0}
    seen_registers = False
    for name, offset, size in _sections(cubin):
        if name != ".nv.info" and not name.startswith(".nv.info."):
            continue
        at = offset
        while at < offset + size:
            fmt, attr, payload = struct.unpack_from("<BBH", cubin, at)
            if fmt != _EIFMT_SVAL:
                at += 4
                continue
            if attr in found and payload >= 8:  # (symbol index, value)
                found[attr] = max(found[attr], struct.unpack_from("<I", cubin, at + 8)[0])
                seen_registers |= attr == _EIATTR_REGCOUNT
            at += 4 + payload
    if not seen_registers:
        raise ValueError("the cubin has no register count (EIATTR_REGCOUNT): not a ptxas output?")
    return KernelResources(found[_EIATTR_REGCOUNT], found[_EIATTR_FRAME_SIZE])
