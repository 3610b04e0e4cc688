"""KDA's gated output norm for decode: per head, y = bf16(o / RMS_ε(o) ⊙ γ ⊙ σ(g)).

Math: `reference/kda.py::_gated_rms_norm` (K3_MATH.md §3.4 step 8): RMS over each head's 128
channels, ε = 1e-5 fixed (the class default, not the config ε), γ `[128]` shared by all heads,
σ(g) = 1 / (1 + e^-g); FP32 throughout, one rounding at the store.

Envelope: o and g `[M, h·128]` BF16 with 1 <= M <= 64 and 1 <= h <= 96 heads (K3 per rank: 96,
48, 24, 12, 6); γ `[128]` BF16 contiguous; out `[M, h·128]` BF16. Rows may be strided (g_out is a
column slice of KDA's fused input projection): last dim contiguous, row stride a multiple of 8
elements, 16-byte aligned. Compiles for sm_90a, sm_100a, sm_103a (nothing arch-specific). Fuses
the head reduction, the scale, the weight and the sigmoid gate into one read of o and g and one
write.

Design: a head is 16 lanes × one 16-byte vector each, so its sum of squares is a 4-step
butterfly inside a half-warp and needs no shared memory or barrier. A CTA takes 8 consecutive
heads of the flattened `[M·h]` head list; the lanes of a partial last CTA load zeros, join the
shuffles and store nothing.

The host `launch` checks the envelope before touching the GPU, compiles once per (h, row
strides, arch), then only launches, on an explicit stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32

from .rms_norm import (
    VEC,
    check_devices,
    check_row_count,
    check_rows,
    check_vector,
    current_stream,
    device_arch,
    gmem_ptr,
    need,
    row_vectors,
)

HEAD_DIM = 128
MAX_HEADS = 96
O_NORM_EPS = 1e-5
LANES_PER_HEAD = HEAD_DIM // VEC  # 16
HEADS_PER_CTA = 8


@dataclass(frozen=True)
class GatedNormPlan:
    heads: int
    o_stride: int
    g_stride: int
    y_stride: int


@cute.kernel
def _gated_rms_norm_kernel(o_ptr: cute.Pointer, g_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer,
                           m: Int32, eps: Float32, plan: Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    blk, _, _ = cute.arch.block_idx()
    width = plan.heads * HEAD_DIM
    lane = tid % LANES_PER_HEAD
    head_id = blk * HEADS_PER_CTA + tid // LANES_PER_HEAD  # in the flattened [M·h] list
    row = head_id // plan.heads
    col = (head_id % plan.heads) * LANES_PER_HEAD + lane  # vector index inside the row
    o = row_vectors(o_ptr, m, width, plan.o_stride)
    g = row_vectors(g_ptr, m, width, plan.g_stride)
    w = row_vectors(w_ptr, 1, HEAD_DIM, HEAD_DIM)
    y = row_vectors(y_ptr, m, width, plan.y_stride)

    orr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    grr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    wr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    orr.fill(0.0)
    grr.fill(0.0)
    valid = head_id < m * plan.heads
    if valid:
        cute.autovec_copy(o[(0, None), (row, col)], orr)
        cute.autovec_copy(g[(0, None), (row, col)], grr)
    cute.autovec_copy(w[(0, None), (0, lane)], wr)

    of = orr.load().to(Float32)
    ss = cute.arch.warp_reduction_sum((of * of).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0),
                                      threads_in_group=LANES_PER_HEAD)
    rrms = cute.math.rsqrt(ss * (1.0 / HEAD_DIM) + eps)
    gf = grr.load().to(Float32)
    gate = 1.0 / (1.0 + cute.math.exp(-gf))
    yr = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    yr.store((of * rrms * wr.load().to(Float32) * gate).to(BFloat16))
    if valid:
        cute.autovec_copy(yr, y[(0, None), (row, col)])


@cute.jit
def _gated_rms_norm_host(o_ptr: cute.Pointer, g_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer,
                         m: Int32, eps: Float32, stream: cuda.CUstream, plan: Constexpr):
    _gated_rms_norm_kernel(o_ptr, g_ptr, w_ptr, y_ptr, m, eps, plan).launch(
        grid=((m * plan.heads + HEADS_PER_CTA - 1) // HEADS_PER_CTA, 1, 1),
        block=(HEADS_PER_CTA * LANES_PER_HEAD, 1, 1), stream=stream)


def compile_gated_rms_norm(plan: GatedNormPlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_gated_rms_norm_host, p, p, p, p, Int32(1), Float32(O_NORM_EPS),
                        cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


def check_envelope(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work)."""
    k = "gated_rms_norm"
    need(isinstance(o, torch.Tensor) and o.dim() == 2, k,
         f"o must be a [M, h*{HEAD_DIM}] tensor, got {tuple(o.shape) if isinstance(o, torch.Tensor) else type(o)}")
    m, width = o.shape
    need(width % HEAD_DIM == 0 and 1 <= width // HEAD_DIM <= MAX_HEADS, k,
         f"o has {width} columns; it must hold 1..{MAX_HEADS} heads of {HEAD_DIM}")
    check_row_count(k, m)
    for name, t in (("o", o), ("gate", gate)) + ((("out", out),) if out is not None else ()):
        check_rows(k, name, t, m, width)
    check_vector(k, "weight", weight, HEAD_DIM)
    check_devices(k, {"o": o, "gate": gate, "weight": weight, "out": out})


_COMPILED: dict[tuple[GatedNormPlan, str], Any] = {}


def launch(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
           eps: float = O_NORM_EPS, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """out = bf16(o / RMS_eps(o) ⊙ weight ⊙ σ(gate)) per 128-channel head, on `stream`.

    The first call of an (h, strides) variant compiles (about a second); later calls only launch.
    """
    check_envelope(o, gate, weight, out)
    m, width = o.shape
    if out is None:
        out = torch.empty((m, width), dtype=torch.bfloat16, device=o.device)
    plan = GatedNormPlan(width // HEAD_DIM, o.stride(0), gate.stride(0), out.stride(0))
    key = (plan, device_arch(o.device))
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_gated_rms_norm(plan, key[1])
    fn(gmem_ptr(BFloat16, o.data_ptr()), gmem_ptr(BFloat16, gate.data_ptr()), gmem_ptr(BFloat16, weight.data_ptr()),
       gmem_ptr(BFloat16, out.data_ptr()), m, eps, current_stream(o.device, stream))
    return out
