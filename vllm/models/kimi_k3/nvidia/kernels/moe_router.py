"""MoE router epilogue for decode rows: sigmoid, correction bias, top-k, renormalize, scale.

STATUS: compiled (sm_90a, sm_100a, sm_103a), not yet run on a GPU.

Math (`reference/moe.py::route`, K3_MATH.md §3.6), per row of the fp32 router logits ℓ:

    s = σ(ℓ) (fp32);  s' = s + bias                  (the selection keys; bias moves only the choice)
    Top = the k best s': s' descending, ties to the lower expert index, NaN keys below every
          other key (−∞ included), NaN among themselves by index
    w_j = s_Top_j / (Σ_j s_Top_j + 1e-20) · routed_scaling_factor   (renormalize; else s · factor)

The router GEMM itself stays on kernels/skinny_gemm.py (fp32 output); this kernel reads its
logits. σ is 1/(1 + e^−ℓ) with the hardware exp2, so a key can differ from torch.sigmoid's by an
ulp or two; only keys that close together can be ordered differently from the reference.

Envelope: logits [M, E] and bias [E] fp32, contiguous, 4-byte aligned, one CUDA device;
1 <= M <= 64, E % 32 == 0, 32 <= E <= 1024, 1 <= k <= min(32, E); sigmoid scoring with a single
expert group (K3: 896 experts, top-16, one group). Outputs: weights [M, k] fp32 and ids [M, k]
int32 in selection order (what kernels/moe_experts.py takes).

Design: one warp per row; lane l keeps experts l + 32·i (i < E/32) in registers. Each of the k
rounds takes every lane's best remaining key, then a butterfly over the warp under the strict
total order above (so every lane agrees on the winner), and the winner's lane strikes it out.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Constexpr, Float32, Int32, const_expr
from .rms_norm import device_arch, gmem_ptr

MAX_ROWS = 64
MAX_EXPERTS = 1024
MAX_TOP_K = 32
RENORM_EPS = 1e-20
# key classes: a live key beats a NaN key beats a key already taken
_LIVE, _NAN, _TAKEN = 2, 1, 0


class MoERouterEnvelopeError(ValueError):
    """The inputs fall outside what the router kernel supports."""


@cute.jit
def _beats(cls_a: Int32, key_a: Float32, idx_a: Int32, cls_b: Int32, key_b: Float32, idx_b: Int32) -> Int32:
    """1 if candidate a ranks before b: class first, then the key (live keys only), then index."""
    res = Int32(0)
    if cls_a > cls_b:
        res = Int32(1)
    if cls_a == cls_b:
        if cls_a == _LIVE:
            if key_a > key_b:
                res = Int32(1)
            if key_a == key_b:
                if idx_a < idx_b:
                    res = Int32(1)
        else:
            if idx_a < idx_b:
                res = Int32(1)
    return res


@cute.kernel
def _router_kernel(logits_ptr: cute.Pointer, bias_ptr: cute.Pointer, w_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                   m: Int32, n_experts: Constexpr, top_k: Constexpr, renormalize: Constexpr, scale: Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    per_lane = n_experts // 32
    logits = cute.make_tensor(logits_ptr, cute.make_layout((m, n_experts), stride=(n_experts, 1)))
    bias = cute.make_tensor(bias_ptr, cute.make_layout(n_experts))
    w_out = cute.make_tensor(w_ptr, cute.make_layout((m, top_k), stride=(top_k, 1)))
    ids_out = cute.make_tensor(ids_ptr, cute.make_layout((m, top_k), stride=(top_k, 1)))

    score = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
    key = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
    cls = cute.make_rmem_tensor(cute.make_layout(per_lane), Int32)
    for i in cutlass.range_constexpr(per_lane):
        e = lane + 32 * i
        s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-logits[row, e]))
        score[i] = s
        key[i] = s + bias[e]
        cls[i] = Int32(_LIVE)
        if cute.math.isnan(key[i]):
            cls[i] = Int32(_NAN)

    sel_idx = cute.make_rmem_tensor(cute.make_layout(top_k), Int32)
    sel_score = cute.make_rmem_tensor(cute.make_layout(top_k), Float32)
    for t in cutlass.range_constexpr(top_k):
        # this lane's best remaining expert (indices rise with i: ties keep the earlier)
        b_cls = cls[0]
        b_key = key[0]
        b_idx = lane
        b_s = score[0]
        for i in cutlass.range_constexpr(1, per_lane):
            if _beats(cls[i], key[i], lane + 32 * i, b_cls, b_key, b_idx) == 1:
                b_cls = cls[i]
                b_key = key[i]
                b_idx = lane + 32 * i
                b_s = score[i]
        for step in cutlass.range_constexpr(5):
            o_cls = cute.arch.shuffle_sync_bfly(b_cls, offset=16 >> step)
            o_key = cute.arch.shuffle_sync_bfly(b_key, offset=16 >> step)
            o_idx = cute.arch.shuffle_sync_bfly(b_idx, offset=16 >> step)
            o_s = cute.arch.shuffle_sync_bfly(b_s, offset=16 >> step)
            if _beats(o_cls, o_key, o_idx, b_cls, b_key, b_idx) == 1:
                b_cls = o_cls
                b_key = o_key
                b_idx = o_idx
                b_s = o_s
        sel_idx[t] = b_idx
        sel_score[t] = b_s
        if b_idx % 32 == lane:
            for i in cutlass.range_constexpr(per_lane):
                if b_idx // 32 == i:
                    cls[i] = Int32(_TAKEN)

    if lane == 0:
        total = Float32(0.0)
        for t in cutlass.range_constexpr(top_k):
            total += sel_score[t]
        for t in cutlass.range_constexpr(top_k):
            ids_out[row, t] = sel_idx[t]
            if const_expr(renormalize):
                w_out[row, t] = sel_score[t] / (total + Float32(RENORM_EPS)) * Float32(scale)
            else:
                w_out[row, t] = sel_score[t] * Float32(scale)


@cute.jit
def _router_host(logits_ptr: cute.Pointer, bias_ptr: cute.Pointer, w_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                 m: Int32, stream: cuda.CUstream, n_experts: Constexpr, top_k: Constexpr,
                 renormalize: Constexpr, scale: Constexpr):
    _router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, m, n_experts, top_k, renormalize, scale).launch(
        grid=(m, 1, 1), block=(32, 1, 1), stream=stream)



def compile_router(n_experts: int, top_k: int, renormalize: bool, scale: float, arch: str,
                   ptx_dir: str | None = None) -> Any:
    """Compile for one static shape and arch; needs no GPU (PTX kept with ptx_dir)."""
    return cute.compile(
        _router_host, gmem_ptr(Float32, 16, 4), gmem_ptr(Float32, 16, 4), gmem_ptr(Float32, 16, 4),
        gmem_ptr(Int32, 16, 4),
        Int32(1), cute.runtime.make_fake_stream(), n_experts, top_k, renormalize, float(scale),
        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir={ptx_dir}" if ptx_dir else ""),
    )


def check_envelope(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    """Raise MoERouterEnvelopeError naming what is outside the envelope (no GPU work)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise MoERouterEnvelopeError(f"moe_router: {msg}")

    need(isinstance(logits, torch.Tensor) and isinstance(bias, torch.Tensor), "logits and bias must be torch tensors")
    need(logits.dim() == 2, f"logits must be [M, E], got {tuple(logits.shape)}")
    m, n_experts = logits.shape
    need(logits.dtype == torch.float32 and bias.dtype == torch.float32,
         f"logits and bias must be float32, got {logits.dtype}, {bias.dtype}")
    need(bias.shape == (n_experts,), f"bias must be [{n_experts}], got {tuple(bias.shape)}")
    need(1 <= m <= MAX_ROWS, f"M={m} rows is outside 1..{MAX_ROWS}; split the batch")
    need(n_experts % 32 == 0 and 32 <= n_experts <= MAX_EXPERTS,
         f"E={n_experts} experts must be a multiple of 32 in 32..{MAX_EXPERTS}")
    need(1 <= top_k <= min(MAX_TOP_K, n_experts), f"top_k={top_k} is outside 1..{min(MAX_TOP_K, n_experts)}")
    need(logits.is_contiguous() and bias.is_contiguous(), "logits and bias must be contiguous")
    need(logits.device.type == "cuda" and bias.device == logits.device, "logits and bias must be CUDA tensors on one device")


_ARCH: dict[torch.device, str] = {}
_COMPILED: dict[tuple, Any] = {}


def launch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool = True,
           routed_scaling_factor: float = 1.0, weights_out: torch.Tensor | None = None,
           ids_out: torch.Tensor | None = None,
           stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, k], ids int32 [M, k]) of the router (module docstring), on `stream`."""
    check_envelope(logits, bias, top_k)
    m, n_experts = logits.shape
    for name, t, dtype in (("weights_out", weights_out, torch.float32), ("ids_out", ids_out, torch.int32)):
        if t is not None and (t.shape != (m, top_k) or t.dtype != dtype or not t.is_contiguous()
                              or t.device != logits.device):
            raise MoERouterEnvelopeError(f"moe_router: {name} must be a contiguous [{m}, {top_k}] {dtype} "
                                         f"tensor on {logits.device}")
    device = logits.device if logits.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device not in _ARCH:
        _ARCH[device] = device_arch(device)
    key = (n_experts, top_k, renormalize, float(routed_scaling_factor), _ARCH[device])
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_router(n_experts, top_k, renormalize, routed_scaling_factor, _ARCH[device])
    weights_out = torch.empty(m, top_k, dtype=torch.float32, device=device) if weights_out is None else weights_out
    ids_out = torch.empty(m, top_k, dtype=torch.int32, device=device) if ids_out is None else ids_out
    stream = torch.cuda.current_stream(device) if stream is None else stream
    fn(gmem_ptr(Float32, logits.data_ptr(), 4), gmem_ptr(Float32, bias.data_ptr(), 4),
       gmem_ptr(Float32, weights_out.data_ptr(), 4),
       gmem_ptr(Int32, ids_out.data_ptr(), 4), m, cuda.CUstream(stream.cuda_stream))
    return weights_out, ids_out
