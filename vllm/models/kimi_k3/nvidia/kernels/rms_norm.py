"""Weighted RMSNorm for decode rows: y = bf16(x / RMS_ε(x) ⊙ γ), RMS_ε(x) = sqrt(mean(x²) + ε).

Math: `reference/ops.py::rms_norm` (FP32 throughout, one rounding at the store; K3_MATH.md §3.3
and §8 item 9). Used for MLA's q_a norm (D = 1536) and the latent MoE `routed_expert_norm`
(3584), and for the tiny eval model's; the kv_a norm runs inside `mla_cache_write` and the final
norm inside `attn_res`, on `rows.py`'s `row_rrms` / `block_sums`.

Envelope: x `[M, D]` BF16 with 1 <= M <= 64 and D % 8 = 0, 8 <= D <= MAX_WIDTH; γ `[D]` BF16 contiguous; out
`[M, D]` BF16. The rows of x and out may be strided (a column slice of a wider GEMM output, as
q_c and kv_c are of MLA's fused_a output): last dim contiguous, row stride a multiple of 8
elements, 16-byte aligned. ε is a run-time argument. Compiles for sm_90a, sm_100a, sm_103a
(nothing arch-specific here; `block_sums` uses clusters only when asked, sm_90+). Fuses the
reduction, the scale and the weight into one read and one write of the row.

Design: one CTA per row. Each thread owns `vecs` 16-byte vectors of the row (strided by the CTA
width, so a warp's accesses are contiguous), keeps them in registers between the reduction and
the store, and the row is read exactly once. The CTA is whole warps; where they hold more
vectors than the row has (D not a multiple of 256, e.g. D = 32: one warp, 4 vectors), the
spare threads load nothing, add zeros and store nothing. The reduction is `rows.py`'s
`block_sums`, shared with the other norm kernels (AttnRes): a butterfly that halves the list of
sums at every step (one shuffle per pair of values instead of five per value), warps through
shared memory, CTAs of a cluster through distributed shared memory; every sum has a fixed order,
so all CTAs of a row get bit-identical totals.

PDL (as `attn_res`): launched as a dependent of the kernel before it, γ (a constant of the graph)
loaded before `griddepcontrol.wait`, x read and y written after it.

The host `launch` checks the envelope before touching the GPU, compiles once per (D, row
strides, arch), then only launches, on an explicit stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, const_expr

from .device import facts
from .rows import (
    MAX_WIDTH,
    VEC,
    check_devices,
    check_row_count,
    check_rows,
    check_vector,
    copy_if,
    current_stream,
    gmem_ptr,
    need,
    row_rrms,
    row_split,
    row_vectors,
)

NORM_WIDTHS = (7168, 3584, 1536, 512)  # K3's norms (tests and benchmarks sweep these)


# ---------------------------------------------------------------- the kernel


@dataclass(frozen=True)
class RmsNormPlan:
    """Everything static about one compiled variant."""

    d: int
    x_stride: int
    y_stride: int
    vecs: int  # 16-byte vectors per thread
    threads: int  # whole warps; threads · vecs >= D / 8, the spare vectors predicated off

    @staticmethod
    def for_width(d: int, x_stride: int, y_stride: int) -> RmsNormPlan:
        return RmsNormPlan(d, x_stride, y_stride, *row_split(d))

    @property
    def exact(self) -> bool:
        return self.vecs * self.threads * VEC == self.d


@cute.kernel
def _rms_norm_kernel(x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, m: Int32,
                     eps: Float32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    vecs, threads = plan.vecs, plan.threads
    x = row_vectors(x_ptr, m, plan.d, plan.x_stride)
    w = row_vectors(w_ptr, 1, plan.d, plan.d)
    y = row_vectors(y_ptr, m, plan.d, plan.y_stride)
    nv = plan.d // VEC
    xr = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    wr = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    if const_expr(not plan.exact):
        xr.fill(0.0)  # spare vectors add nothing to the sum
        wr.fill(0.0)
    for v in cutlass.range_constexpr(vecs):
        copy_if(w[(0, None), (0, tid + v * threads)], wr[None, v], tid + v * threads < nv, plan.exact)
    cute.arch.griddepcontrol_wait()  # γ is a constant of the graph; x is the previous kernel's output
    for v in cutlass.range_constexpr(vecs):
        copy_if(x[(0, None), (row, tid + v * threads)], xr[None, v], tid + v * threads < nv, plan.exact)

    xf = xr.load().to(Float32)
    rrms = row_rrms(xf, plan.d, eps, threads // 32)

    yr = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    yr.store((xf * rrms * wr.load().to(Float32)).to(BFloat16))
    for v in cutlass.range_constexpr(vecs):
        copy_if(yr[None, v], y[(0, None), (row, tid + v * threads)], tid + v * threads < nv, plan.exact)


@cute.jit
def _rms_norm_host(x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, m: Int32,
                   eps: Float32, stream: cuda.CUstream, plan: Constexpr):
    _rms_norm_kernel(x_ptr, w_ptr, y_ptr, m, eps, plan).launch(
        grid=(m, 1, 1), block=(plan.threads, 1, 1), stream=stream, use_pdl=True)


def compile_rms_norm(plan: RmsNormPlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_rms_norm_host, p, p, p, Int32(1), Float32(1e-5), cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


# ---------------------------------------------------------------- host side


def check_envelope(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work)."""
    need(isinstance(x, torch.Tensor) and x.dim() == 2, "rms_norm",
         f"x must be a [M, D] tensor, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    m, d = x.shape
    need(d % VEC == 0 and VEC <= d <= MAX_WIDTH, "rms_norm",
         f"D={d} must be a multiple of {VEC} in {VEC}..{MAX_WIDTH} (16-byte vectors, the row in registers)")
    check_row_count("rms_norm", m)
    check_rows("rms_norm", "x", x, m, d)
    check_vector("rms_norm", "weight", weight, d)
    if out is not None:
        check_rows("rms_norm", "out", out, m, d)
    check_devices("rms_norm", {"x": x, "weight": weight, "out": out})


_COMPILED: dict[tuple[RmsNormPlan, str], Any] = {}


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, *,
           stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """out = bf16(x / RMS_eps(x) ⊙ weight) on `stream` (default: the current stream).

    The first call of a (D, strides) variant compiles (about a second); later calls only launch.
    """
    check_envelope(x, weight, out)
    m, d = x.shape
    if out is None:
        out = torch.empty((m, d), dtype=torch.bfloat16, device=x.device)
    plan = RmsNormPlan.for_width(d, x.stride(0), out.stride(0))
    key = (plan, facts(x.device).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_rms_norm(plan, key[1])
    fn(gmem_ptr(BFloat16, x.data_ptr()), gmem_ptr(BFloat16, weight.data_ptr()), gmem_ptr(BFloat16, out.data_ptr()),
       m, eps, current_stream(x.device, stream))
    return out
