"""Numerics shared by every reference layer: the rounding points of K3_MATH.md §0 and §8.

GEMMs take BF16 inputs, accumulate in FP32 and round once to BF16; elementwise epilogues
compute in FP32 and round once at the store. On CPU torch's bf16 matmul already
accumulates in fp32, but we upcast explicitly so the rounding point is visible and the
result is the same on every device.
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16
F32 = torch.float32


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = BF16) -> torch.Tensor:
    """y = x · wᵀ, accumulated in fp32 or better and rounded once to `out_dtype`.

    On CPU (the oracle) the products of bf16 inputs are summed in fp64: every row's result
    is then independent of how many rows share the GEMM, so batching, verify steps and
    rollback can be checked for exact equality. On CUDA it is the stock bf16 GEMM (cuBLAS,
    fp32 accumulation), the baseline the specialized kernels are timed against.
    """
    if x.is_cuda:
        y = torch.nn.functional.linear(x.to(BF16), w.to(BF16))
        return y if out_dtype == BF16 else (x.to(F32) @ w.to(F32).t()).to(out_dtype)
    return (x.to(torch.float64) @ w.to(torch.float64).t()).to(out_dtype)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the oracle: fp64 on CPU (batch-invariant, see `linear`), fp32 on CUDA."""
    return F32 if t.is_cuda else torch.float64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS_eps(x) ⊙ weight in fp32 (fp64 on CPU), one rounding to bf16 (the fused-kernel form)."""
    xf = x.to(acc_dtype(x))
    rrms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rrms * weight.to(xf.dtype)).to(BF16)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float | None,
                 linear_beta: float | None) -> torch.Tensor:
    """SiTU(g, u) = β·tanh(g/β)·σ(g) · λ·tanh(u/λ) in fp32, rounded once to bf16.

    With β unset the gate is plain SiLU (β → ∞); with λ unset the up branch is not clipped.
    """
    g, u = gate.to(F32), up.to(F32)
    gc = g if beta is None else beta * torch.tanh(g / beta)
    uc = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gc * torch.sigmoid(g) * uc).to(BF16)


def bf16_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(a + b) with the add in fp32 (AttnRes running sums)."""
    return (a.to(F32) + b.to(F32)).to(BF16)
