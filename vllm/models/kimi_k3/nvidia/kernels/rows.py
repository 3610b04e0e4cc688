"""What the row kernels share: the row-vector views (`row_vectors`, `row_split`), the predicated
16-byte copy (`copy_if`), the CTA/cluster reduction (`block_sums`, `row_rrms`), and on the host the
envelope checks (`need` and `check_*`, raising `NormEnvelopeError`) and the pointer and stream
helpers (`gmem_ptr`, `current_stream`). Not a kernel: it lives apart from any one kernel's file so
that a change to that kernel does not stale the evidence records of every kernel importing these.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Constexpr, Float32, Int32, const_expr
from cutlass.cute.runtime import make_ptr

MAX_ROWS = 64
MAX_WIDTH = 8 * 1024  # 4 vectors per thread at 256 threads: the row stays in registers
VEC = 8  # bf16 elements per 16-byte access


class NormEnvelopeError(ValueError):
    """The inputs fall outside what the norm kernels support."""


# ---------------------------------------------------------------- device helpers (shared)


def row_vectors(ptr: cute.Pointer, rows: Int32, cols: int, row_stride: int) -> cute.Tensor:
    """A `[rows, cols]` row-major view cut into 16-byte vectors: ((1, 8), (rows, cols / 8))."""
    return cute.zipped_divide(cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(row_stride, 1))),
                              (1, VEC))


def row_split(d: int) -> tuple[int, int]:
    """(16-byte vectors per thread, threads) for one CTA over a row of d bf16: the fewest vectors per
    thread that keep it at <= 256 threads, in whole warps. K3's widths divide exactly; otherwise
    threads · vecs · 8 > d and the spare vectors are predicated off."""
    nv = d // VEC
    vecs = -(-nv // 256)
    return vecs, 32 * -(-nv // (32 * vecs))


@cute.jit
def copy_if(src: cute.Tensor, dst: cute.Tensor, ok: cutlass.Boolean, exact: Constexpr):
    """One 16-byte vector copy; with spare lanes (a row split that is not exact) only where `ok`."""
    if const_expr(exact):
        cute.autovec_copy(src, dst)
    else:
        if ok:
            cute.autovec_copy(src, dst)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _butterfly_steps(p: int) -> list[tuple[int, int]]:
    """(lane offset, values kept) of the five shuffle steps over 32 lanes for a list of p values;
    kept = 0 marks a plain step on the one value left."""
    log2p = p.bit_length() - 1
    return [(16 >> i, p >> (i + 1) if i < log2p else 0) for i in range(5)]


@cute.jit
def block_sums(vals: cute.Tensor, red: cute.Tensor, fin: cute.Tensor, rank: Int32,
               n: Constexpr, warps: Constexpr, split: Constexpr):
    """Sum each of vals[0..n) over all threads of the CTA and, with split > 1, over the `split`
    CTAs of the cluster; afterwards every thread holds the totals in vals[0..n).

    vals: per-thread FP32 registers of size pow2_at_least(n) (<= 32), padding zero.
    red: shared FP32 `(n, warps)`; fin: shared FP32 `(n, split)`, a fresh one per call (peers
    write into it while this CTA may still read the previous call's). With split > 1 the caller
    has already waited on the cluster barrier once (every CTA of the cluster has started).
    """
    tid, _, _ = cute.arch.thread_idx()
    lane = tid % 32
    warp = tid // 32
    # Butterfly with halving: at offset o a lane keeps the lower or upper half of its list (by
    # bit o of the lane) and receives the partner's copy of that half, so each step costs one
    # shuffle per kept value. After log2(p) steps lane l holds value l >> (5 - log2 p).
    p = pow2_at_least(n)
    steps = _butterfly_steps(p)
    for st in cutlass.range_constexpr(5):
        offset, kept = steps[st]
        if const_expr(kept > 0):
            upper = (lane & offset) != 0
            for i in cutlass.range_constexpr(kept):
                lo = vals[i]
                hi = vals[i + kept]
                send = Float32(cutlass.select_(upper, lo, hi))
                keep = Float32(cutlass.select_(upper, hi, lo))
                vals[i] = keep + cute.arch.shuffle_sync_bfly(send, offset=offset)
        else:
            vals[0] = vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=offset)
    shift = 5 - (p.bit_length() - 1)
    if lane < (n << shift):
        if (lane & ((1 << shift) - 1)) == 0:
            red[lane >> shift, warp] = vals[0]
    cute.arch.sync_threads()
    if tid < n:
        total = red[tid, 0]
        for w in cutlass.range_constexpr(1, warps):
            total += red[tid, w]
        if const_expr(split == 1):
            fin[tid, 0] = total
        else:
            # push this CTA's partial into slot `rank` of every CTA's fin (its own included)
            for r in cutlass.range_constexpr(split):
                remote = cute.arch.map_dsmem_ptr(fin.iterator + tid + n * rank, r)
                cute.arch.inline_ptx("st.shared::cluster.f32 [{$r0}], {$r1};", read_only_args=[remote.toint(), total])
    if const_expr(split == 1):
        cute.arch.sync_threads()
    else:
        # release the pushes, acquire the peers'; no CTA touches remote memory after this
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    for i in cutlass.range_constexpr(n):
        total = fin[i, 0]
        for r in cutlass.range_constexpr(1, split):
            total += fin[i, r]
        vals[i] = total


@cute.jit
def row_rrms(xf: cute.TensorSSA, d: Constexpr, eps: Float32, warps: Constexpr) -> Float32:
    """1 / RMS_eps of one row whose fp32 values are spread over the CTA's threads (xf: this
    thread's; spare lanes hold zeros). Allocates its reduction scratch in shared memory."""
    smem = cutlass.memory.SmemAllocator()
    red = smem.allocate_tensor(Float32, cute.make_layout((1, warps)), byte_alignment=16)
    fin = smem.allocate_tensor(Float32, cute.make_layout((1, 1)), byte_alignment=16)
    sums = cute.make_rmem_tensor(cute.make_layout(1), Float32)
    sums[0] = (xf * xf).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
    block_sums(sums, red, fin, Int32(0), 1, warps, 1)
    return cute.math.rsqrt(sums[0] * (1.0 / d) + eps)


# ---------------------------------------------------------------- host side


def gmem_ptr(dtype: Any, address: int, align: int = 16) -> cute.Pointer:
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def need(cond: bool, kernel: str, msg: str) -> None:
    if not cond:
        raise NormEnvelopeError(f"{kernel}: {msg}")


def check_rows(kernel: str, name: str, t: torch.Tensor, rows: int | None, cols: int) -> None:
    """t must be a bf16 `[rows, cols]` tensor with contiguous 16-byte-aligned rows (device: see
    check_devices, which runs last so that envelope errors show on CPU tensors too)."""
    need(isinstance(t, torch.Tensor), kernel, f"{name} must be a torch tensor")
    need(t.dim() == 2 and (rows is None or t.shape[0] == rows) and t.shape[1] == cols, kernel,
         f"{name} must be [{'M' if rows is None else rows}, {cols}], got {tuple(t.shape)}")
    need(t.dtype == torch.bfloat16, kernel, f"{name} must be bfloat16, got {t.dtype}; cast it first")
    need(t.stride(1) == 1 and t.stride(0) % VEC == 0 and t.data_ptr() % 16 == 0, kernel,
         f"{name} rows must be contiguous, 16-byte aligned, with a row stride that is a multiple of 8 "
         f"(got strides {tuple(t.stride())}); call .contiguous()")


def check_vector(kernel: str, name: str, t: torch.Tensor, n: int) -> None:
    need(isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == n, kernel,
         f"{name} must be a [{n}] tensor, got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    need(t.dtype == torch.bfloat16, kernel, f"{name} must be bfloat16, got {t.dtype}; cast it first")
    need(t.is_contiguous() and t.data_ptr() % 16 == 0, kernel, f"{name} must be contiguous and 16-byte aligned")


def check_row_count(kernel: str, m: int) -> None:
    need(1 <= m <= MAX_ROWS, kernel, f"M={m} rows is outside 1..{MAX_ROWS}; split the batch into chunks of <= {MAX_ROWS}")


def check_devices(kernel: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Every given tensor is a CUDA tensor, all on one device."""
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        need(t.device.type == "cuda", kernel, f"{name} must be a CUDA tensor, got one on {t.device}")
    need(len({t.device for t in given.values()}) == 1, kernel, f"{', '.join(given)} must all be on one device")


def current_stream(device: torch.device, stream: torch.cuda.Stream | None) -> cuda.CUstream:
    s = torch.cuda.current_stream(device) if stream is None else stream
    return cuda.CUstream(s.cuda_stream)
