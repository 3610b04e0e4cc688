"""MLA latent cache write fused with the kv_a RMSNorm: cache[slot_i] = [bf16(kv_c_i / RMS_ε ⊙ γ) ‖ k_pe_i].

Math (K3_MATH.md §3.3 and §3.5; the oracle is `reference/ops.py::rms_norm` followed by the
cache write `cache[blocks, offsets] = cache_rows` of `reference/mla.py::mla_core`): for every
decode row i with slot s_i = block_id · block_size + offset (flattened on the host),

    c_i = bf16(kv_c_i / sqrt(mean(kv_c_i²) + ε) ⊙ γ)      FP32 throughout, one rounding
    cache.view(-1, 576)[s_i, 0:512]   = c_i
    cache.view(-1, 576)[s_i, 512:576] = k_pe_i            (an exact copy)

and, when `latent_out` is given, latent_out_i = c_i. A row whose slot is negative (padding) or
not below num_blocks · block_size writes no cache row (its latent_out row is still written).

Envelope: kv_c `[M, 512]` and k_pe `[M, 64]` BF16 with 1 <= M <= 64, each a row view of the
fused_a output (last dim contiguous, row stride a multiple of 8 elements, 16-byte aligned);
γ `[512]` BF16 contiguous; slot `[M]` int64 contiguous; cache `[num_blocks, block_size, 576]`
BF16 contiguous and 16-byte aligned (64-bit row offsets: any cache size); latent_out `[M, 512]`
BF16 with rows as above, or None. ε is a run-time argument, so is the cache's row count. The
non-skipped slots of one launch must be distinct (two rows writing one cache row race; the host
does not read the slots, which would synchronize). Compiles for sm_90a, sm_100a, sm_103a
(nothing arch-specific). Fuses the kv_a norm, the latent and k_pe cache stores and the
optional latent output into one read of the GEMM row and one write of the cache row.

Design: one CTA of 64 threads (two warps) per row. Thread t holds 16-byte vector t of kv_c and
of γ in registers; threads 0..7 also carry one vector of k_pe. The sum of squares goes through
`rows.block_sums` (butterfly, then the two warps through shared memory), every thread then
scales its vector and stores it to the cache row (and latent_out) with one 16-byte store each.
The slot is read once per thread (an L1 broadcast); the cache row address is formed in 64 bits.

PDL (as `attn_res`): launched as a dependent of the kernel before it, γ (a constant of the graph)
loaded before `griddepcontrol.wait`; kv_c, k_pe and the slots read, and everything written, after it.

The host `launch` checks the envelope before touching the GPU, compiles once per (row strides,
latent_out given, arch), then only launches, on an explicit stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, const_expr

from .device import facts
from .rows import (
    VEC,
    check_devices,
    check_row_count,
    check_rows,
    check_vector,
    current_stream,
    gmem_ptr,
    need,
    row_rrms,
    row_vectors,
)

LATENT = 512  # r_kv: the normed latent
ROPE = 64  # d_r: k_pe
ROW = LATENT + ROPE  # one cache row
THREADS = LATENT // VEC  # 64: one 16-byte vector of the latent per thread
PE_VECS = ROPE // VEC  # 8 threads carry k_pe


@dataclass(frozen=True)
class CacheWritePlan:
    """Everything static about one compiled variant."""

    kv_stride: int
    pe_stride: int
    out_stride: int  # 0 without latent_out
    has_out: bool


@cute.kernel
def _mla_cache_write_kernel(kv_ptr: cute.Pointer, pe_ptr: cute.Pointer, w_ptr: cute.Pointer, slot_ptr: cute.Pointer,
                            cache_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32, cache_rows: Int64,
                            eps: Float32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    kv = row_vectors(kv_ptr, m, LATENT, plan.kv_stride)
    pe = row_vectors(pe_ptr, m, ROPE, plan.pe_stride)
    w = row_vectors(w_ptr, 1, LATENT, LATENT)
    slots = cute.make_tensor(slot_ptr, cute.make_layout(m))

    xr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    wr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    pr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    cute.autovec_copy(w[(0, None), (0, tid)], wr)
    cute.arch.griddepcontrol_wait()  # γ is a constant of the graph; kv_c, k_pe and the slots are this step's
    cute.autovec_copy(kv[(0, None), (row, tid)], xr)
    if tid < PE_VECS:
        cute.autovec_copy(pe[(0, None), (row, tid)], pr)
    slot = slots[row]

    xf = xr.load().to(Float32)
    rrms = row_rrms(xf, LATENT, eps, THREADS // 32)

    yr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    yr.store((xf * rrms * wr.load().to(Float32)).to(BFloat16))
    if const_expr(plan.has_out):
        out = row_vectors(out_ptr, m, LATENT, plan.out_stride)
        cute.autovec_copy(yr, out[(0, None), (row, tid)])
    if (slot >= 0) & (slot < cache_rows):
        # the cache row in 64-bit byte addressing: slot · 1152 may exceed 2^31
        dst = cute.make_tensor(
            cute.make_ptr(BFloat16, cache_ptr.toint() + Int64(slot) * (2 * ROW), cute.AddressSpace.gmem,
                          assumed_align=16),
            cute.make_layout((VEC, ROW // VEC), stride=(1, VEC)))
        cute.autovec_copy(yr, dst[None, tid])
        if tid < PE_VECS:
            cute.autovec_copy(pr, dst[None, THREADS + tid])


@cute.jit
def _mla_cache_write_host(kv_ptr: cute.Pointer, pe_ptr: cute.Pointer, w_ptr: cute.Pointer, slot_ptr: cute.Pointer,
                          cache_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32, cache_rows: Int64,
                          eps: Float32, stream: cuda.CUstream, plan: Constexpr):
    _mla_cache_write_kernel(kv_ptr, pe_ptr, w_ptr, slot_ptr, cache_ptr, out_ptr, m, cache_rows, eps, plan).launch(
        grid=(m, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


def compile_mla_cache_write(plan: CacheWritePlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_mla_cache_write_host, p, p, p, gmem_ptr(Int64, 16, 8), p, p, Int32(1), Int64(1),
                        Float32(1e-5), cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


# ---------------------------------------------------------------- host side


def check_envelope(kv_c: torch.Tensor, k_pe: torch.Tensor, gamma: torch.Tensor, cache: torch.Tensor,
                   slot: torch.Tensor, latent_out: torch.Tensor | None) -> None:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work)."""
    k = "mla_cache_write"
    need(isinstance(kv_c, torch.Tensor) and kv_c.dim() == 2, k, f"kv_c must be a [M, {LATENT}] tensor, got "
         f"{tuple(kv_c.shape) if isinstance(kv_c, torch.Tensor) else type(kv_c)}")
    m = kv_c.shape[0]
    check_row_count(k, m)
    check_rows(k, "kv_c", kv_c, m, LATENT)
    check_rows(k, "k_pe", k_pe, m, ROPE)
    check_vector(k, "gamma", gamma, LATENT)
    need(isinstance(slot, torch.Tensor) and slot.dim() == 1 and slot.shape[0] == m, k,
         f"slot must be a [{m}] tensor (one flat cache row per kv_c row), got "
         f"{tuple(slot.shape) if isinstance(slot, torch.Tensor) else type(slot)}")
    need(slot.dtype == torch.int64, k,
         f"slot must be int64 (block_id * block_size + offset, negative = skip), got {slot.dtype}; use .long()")
    need(slot.is_contiguous(), k, "slot must be contiguous; call .contiguous()")
    need(isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.shape[2] == ROW, k,
         f"cache must be the paged [num_blocks, block_size, {ROW}] latent cache, got "
         f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache)}")
    need(cache.dtype == torch.bfloat16, k, f"cache must be bfloat16 (the 'auto' KV-cache dtype), got {cache.dtype}")
    need(cache.is_contiguous() and cache.data_ptr() % 16 == 0, k,
         f"cache must be contiguous and 16-byte aligned (got strides {tuple(cache.stride())})")
    if latent_out is not None:
        check_rows(k, "latent_out", latent_out, m, LATENT)
    check_devices(k, {"kv_c": kv_c, "k_pe": k_pe, "gamma": gamma, "slot": slot, "cache": cache,
                      "latent_out": latent_out})


_COMPILED: dict[tuple[CacheWritePlan, str], Any] = {}


def launch(kv_c: torch.Tensor, k_pe: torch.Tensor, gamma: torch.Tensor, eps: float, cache: torch.Tensor,
           slot: torch.Tensor, latent_out: torch.Tensor | None = None, *,
           stream: torch.cuda.Stream | None = None) -> torch.Tensor | None:
    """cache.view(-1, 576)[slot[i]] = [bf16(kv_c[i] / RMS_eps ⊙ gamma) ‖ k_pe[i]] for every row whose
    slot lies in [0, num_blocks · block_size), and latent_out[i] = the normed latent when given; on
    `stream` (default: the current stream). Returns latent_out.

    The first call of a (strides, latent_out given) variant compiles; later calls only launch.
    """
    check_envelope(kv_c, k_pe, gamma, cache, slot, latent_out)
    m = kv_c.shape[0]
    plan = CacheWritePlan(kv_c.stride(0), k_pe.stride(0), 0 if latent_out is None else latent_out.stride(0),
                          latent_out is not None)
    key = (plan, facts(kv_c.device).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_mla_cache_write(plan, key[1])
    out_addr = kv_c.data_ptr() if latent_out is None else latent_out.data_ptr()  # unused without latent_out
    fn(gmem_ptr(BFloat16, kv_c.data_ptr()), gmem_ptr(BFloat16, k_pe.data_ptr()), gmem_ptr(BFloat16, gamma.data_ptr()),
       gmem_ptr(Int64, slot.data_ptr(), 8), gmem_ptr(BFloat16, cache.data_ptr()), gmem_ptr(BFloat16, out_addr),
       m, cache.shape[0] * cache.shape[1], eps, current_stream(kv_c.device, stream))
    return latent_out
