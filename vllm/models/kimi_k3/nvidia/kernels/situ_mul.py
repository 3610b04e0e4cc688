"""SiTU-and-mul of a merged gate/up GEMM output: h = bf16(β·tanh(g/β)·σ(g) · λ·tanh(u/λ)).

Math: `reference/ops.py::situ_and_mul` (K3_MATH.md §3.6) on x = [g | u], the `[M, 2I]` output of
a merged gate/up projection (the dense MLP of layer 0 and the shared experts): fp32 math on the
bf16 inputs, rounded once to bf16; β unset is plain SiLU, λ unset leaves u unclipped. The fp32
formula is the one `kernels/moe_experts.py` applies in its gate/up epilogue (`situ`), so the
routed and the shared experts round alike.

Envelope: gate_up `[M, 2I]` and out `[M, I]` bf16 with contiguous, 16-byte aligned rows;
1 <= M <= 64, I % 8 == 0 (K3 per rank: the shared experts' and dense MLP's widths at TP1/8/16).
Compiles for sm_90a, sm_100a, sm_103a (nothing arch-specific).

Design: it replaces a dozen PyTorch elementwise launches of the decode step by one. A thread
takes 8 outputs: one 16-byte vector of g and the matching one of u; CTAs of 128 threads tile
each row, rows on the grid's y, a bounds check on the last tile.

PDL (as `attn_res`): launched as a dependent of the kernel before it, waiting first (it has no weights):
the launch and the CTAs' placement overlap the GEMM before it.

The host `launch` checks the envelope before touching the GPU, compiles once per (I, row
strides, β, λ, arch), then only launches, on an explicit stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32

from .device import facts
from .moe_experts import situ
from .rows import VEC, check_devices, check_row_count, check_rows, current_stream, gmem_ptr, need, \
    row_vectors

THREADS = 128


@dataclass(frozen=True)
class SituPlan:
    width: int  # I
    in_stride: int
    out_stride: int
    beta: float | None
    linear_beta: float | None

    @property
    def tiles(self) -> int:
        return -(-self.width // VEC // THREADS)


@cute.kernel
def _situ_mul_kernel(x_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    tile, row, _ = cute.arch.block_idx()
    x = row_vectors(x_ptr, m, 2 * plan.width, plan.in_stride)
    out = row_vectors(out_ptr, m, plan.width, plan.out_stride)
    v = tile * THREADS + tid
    cute.arch.griddepcontrol_wait()
    if v < plan.width // VEC:
        g = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        u = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        h = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        cute.autovec_copy(x[(0, None), (row, v)], g)
        cute.autovec_copy(x[(0, None), (row, v + plan.width // VEC)], u)
        for j in cutlass.range_constexpr(VEC):
            h[j] = situ(g[j].to(Float32), u[j].to(Float32), plan.beta, plan.linear_beta).to(BFloat16)
        cute.autovec_copy(h, out[(0, None), (row, v)])


@cute.jit
def _situ_mul_host(x_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32, stream: cuda.CUstream, plan: Constexpr):
    _situ_mul_kernel(x_ptr, out_ptr, m, plan).launch(grid=(plan.tiles, m, 1), block=(THREADS, 1, 1), stream=stream,
                                                      use_pdl=True)


def compile_situ_mul(plan: SituPlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept there."""
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_situ_mul_host, p, p, Int32(1), cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


def check_envelope(gate_up: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work)."""
    k = "situ_mul"
    need(isinstance(gate_up, torch.Tensor) and gate_up.dim() == 2, k, "gate_up must be a 2-D [M, 2I] tensor")
    width = gate_up.shape[1] // 2
    need(gate_up.shape[1] % (2 * VEC) == 0, k,
         f"gate_up has {gate_up.shape[1]} columns; it must be [g | u] with I = columns / 2 a multiple of {VEC}")
    check_row_count(k, gate_up.shape[0])
    check_rows(k, "gate_up", gate_up, None, 2 * width)
    if out is not None:
        check_rows(k, "out", out, gate_up.shape[0], width)
    check_devices(k, {"gate_up": gate_up, "out": out})


_COMPILED: dict[tuple[SituPlan, str], Any] = {}


def launch(gate_up: torch.Tensor, beta: float | None, linear_beta: float | None, out: torch.Tensor | None = None,
           *, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """out = SiTU(g, u) for gate_up = [g | u]; on `stream` (default: the current stream)."""
    check_envelope(gate_up, out)
    m, width = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((m, width), dtype=torch.bfloat16, device=gate_up.device)
    plan = SituPlan(width, gate_up.stride(0), out.stride(0), beta, linear_beta)
    key = (plan, facts(gate_up.device).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_situ_mul(plan, key[1])
    fn(gmem_ptr(BFloat16, gate_up.data_ptr()), gmem_ptr(BFloat16, out.data_ptr()), m,
       current_stream(gate_up.device, stream))
    return out
