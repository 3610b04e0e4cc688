"""MoE router epilogue for decode rows: sigmoid, correction bias, top-k, renormalize, scale.

Compiled for sm_90a, sm_100a and sm_103a. Evidence (`evidence/<card>/`, one folder a
card): `moe_test.json`, `moe_bench.json`.

Math (`reference/moe.py::route`, K3_MATH.md §3.6), per row of the fp32 router logits ℓ:

    s = σ(ℓ) (fp32);  s' = s + bias                  (the selection keys; bias moves only the choice)
    Top = the k best s': s' descending, ties to the lower expert index, NaN keys below every
          other key (−∞ included), NaN among themselves by index
    w_j = s_Top_j / (Σ_j s_Top_j + 1e-20) · routed_scaling_factor   (renormalize; else s · factor)

Σ_j runs in selection order, sequentially from 0 (fp32). The router GEMM itself stays on
kernels/skinny_gemm.py (fp32 output); this kernel reads its logits. σ is 1/(1 + e^−ℓ) with the
hardware exp2, so a key can differ from torch.sigmoid's by an ulp or two; only keys that close
together can be ordered differently from the reference.

Envelope: logits [M, E] and bias [E] fp32, contiguous, 4-byte aligned, one CUDA device;
1 <= M <= 64, E % 32 == 0, 32 <= E <= 1024, 1 <= k <= min(32, E); sigmoid scoring with a single
expert group (K3: 896 experts, top-16, one group). Outputs: weights [M, k] fp32 and ids [M, k]
int32 in selection order (what kernels/moe_experts.py takes).

Design: one warp (one CTA) per row; lane l owns experts l + 32·i (i < E/32, a compile-time
count). Every register index is a compile-time constant, so nothing goes to local memory.
- Prologue: a PDL dependent of the router GEMM (as `attn_res`): the bias (a constant of the
  graph) is loaded before `griddepcontrol.wait`, the logits after it; all 2·E/32 loads are
  issued before σ per key. (The previous design interleaved them, and each σ's IEEE division
  has a slow-path branch that the loads were not hoisted across: 28 load latencies in a row at
  K3's shape.)
- Keys become int32 codes whose signed order is the order above: a live key's fp32 bits
  (sign, magnitude) map to ±magnitude (monotone; −0 and +0 meet at 0; −∞ is −0x7F800000),
  a NaN key to INT_MIN + 1, a taken key to INT_MIN. On equal codes the lower expert index
  wins, at every step. σ goes to shared memory for the weights.
- The k rounds are one runtime loop (not unrolled; the previous design's fully unrolled,
  branchy rounds were ~11k SASS instructions run once). A round: each lane's best slot by a
  pairwise tree over its slots in index order (branch-free max + select; on equal codes the
  left, lower slot stays); the warp's best code by `redux.sync.max`; the lowest expert
  index among the lanes holding it by `redux.sync.min` over lane + 32·slot; the lane whose
  candidate won strikes that slot (a compare-select against each compile-time slot, so one
  slot of one lane). Lane t keeps round t's expert. k <= E, so a taken key never wins.
- Epilogue: lane t (t < k) reads its σ from shared memory; every lane sums the k σ in
  selection order (k index shuffles, sequential fp32 from 0, as the previous design);
  lane t writes weight and id slot t.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Constexpr, Float32, Int32, const_expr
from cutlass._mlir.dialects import arith
from .device import facts
from .rows import gmem_ptr

MAX_ROWS = 64
MAX_EXPERTS = 1024
MAX_TOP_K = 32
RENORM_EPS = 1e-20
# key codes (signed int32 order): live keys are ±magnitude >= -0x7F800000 (−∞); then NaN, then taken
_NAN_CODE = -(2 ** 31) + 1
_TAKEN_CODE = -(2 ** 31)
_MAG_MASK = 0x7FFFFFFF
_INF_MAG = 0x7F800000
_NO_CAND = 2 ** 31 - 1


class MoERouterEnvelopeError(ValueError):
    """The inputs fall outside what the router kernel supports."""


def _sel(cond, a, b, dtype):
    """Branch-free select (one SEL / selp), typed."""
    return dtype(cutlass.select_(cond, dtype(a), dtype(b)))


@cute.jit
def _key_code(key: Float32) -> Int32:
    """The int32 code of a selection key (module docstring): signed order = the router's order."""
    bits = Int32(arith.bitcast(Int32.mlir_type, key.ir_value()))
    mag = bits & Int32(_MAG_MASK)
    code = _sel(bits < 0, Int32(0) - mag, mag, Int32)
    return _sel(mag > Int32(_INF_MAG), Int32(_NAN_CODE), code, Int32)


def _lane_best(code: Any, n: int) -> tuple[Int32, Int32]:
    """(best code, its slot) over code[0..n): a pairwise tree over slots in order (traced as plain
    Python: compile-time indices only); on equal codes the left, lower slot (lower expert) stays."""
    level = [(code[i], Int32(i)) for i in range(n)]
    while len(level) > 1:
        nxt = []
        for p in range(0, len(level) - 1, 2):
            (c_a, j_a), (c_b, j_b) = level[p], level[p + 1]
            take_b = c_b > c_a
            nxt.append((_sel(take_b, c_b, c_a, Int32), _sel(take_b, j_b, j_a, Int32)))
        if len(level) % 2 == 1:
            nxt.append(level[-1])
        level = nxt
    return level[0]


@cute.kernel
def _router_kernel(logits_ptr: cute.Pointer, bias_ptr: cute.Pointer, w_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                   m: Int32, n_experts: Constexpr, top_k: Constexpr, renormalize: Constexpr, scale: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    lane, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    per_lane = n_experts // 32
    logits = cute.make_tensor(logits_ptr, cute.make_layout((m, n_experts), stride=(n_experts, 1)))
    bias = cute.make_tensor(bias_ptr, cute.make_layout(n_experts))
    w_out = cute.make_tensor(w_ptr, cute.make_layout((m, top_k), stride=(top_k, 1)))
    ids_out = cute.make_tensor(ids_ptr, cute.make_layout((m, top_k), stride=(top_k, 1)))
    smem = cutlass.memory.SmemAllocator()
    score_s = smem.allocate_tensor(Float32, cute.make_layout(n_experts), byte_alignment=16)

    # every load first, so the 2·E/32 loads are in flight together (σ's division has a slow-path
    # branch per key, which loads would not be hoisted across)
    lg = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
    bs = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
    for i in cutlass.range_constexpr(per_lane):
        bs[i] = bias[lane + 32 * i]
    cute.arch.griddepcontrol_wait()  # the bias is a constant of the graph; the logits are the router GEMM's
    for i in cutlass.range_constexpr(per_lane):
        lg[i] = logits[row, lane + 32 * i]
    code = cute.make_rmem_tensor(cute.make_layout(per_lane), Int32)
    for i in cutlass.range_constexpr(per_lane):
        s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-lg[i]))
        score_s[lane + 32 * i] = s
        code[i] = _key_code(s + bs[i])

    my_id = Int32(0)
    for t in cutlass.range(top_k, unroll=1):
        best, slot = _lane_best(code, per_lane)
        # the warp's best code, then the lowest expert index holding it
        top = cute.arch.warp_redux_sync(best, "max")
        cand = _sel(best == top, lane + 32 * slot, Int32(_NO_CAND), Int32)
        win = cute.arch.warp_redux_sync(cand, "min")
        my_id = _sel(lane == t, win, my_id, Int32)
        # the winning lane strikes its slot (cand is unique to this lane, so one slot in one lane)
        hit = _sel(cand == win, slot, Int32(-1), Int32)
        for i in cutlass.range_constexpr(per_lane):
            code[i] = _sel(hit == i, Int32(_TAKEN_CODE), code[i], Int32)

    cute.arch.sync_warp()  # score_s written by other lanes
    s_mine = score_s[my_id]  # lanes >= k read expert 0's σ and write nothing
    total = Float32(0.0)
    for t in cutlass.range_constexpr(top_k):  # selection order, as every lane sums it
        total += cute.arch.shuffle_sync(s_mine, t)
    if lane < top_k:
        ids_out[row, lane] = my_id
        if const_expr(renormalize):
            w_out[row, lane] = s_mine / (total + Float32(RENORM_EPS)) * Float32(scale)
        else:
            w_out[row, lane] = s_mine * Float32(scale)


@cute.jit
def _router_host(logits_ptr: cute.Pointer, bias_ptr: cute.Pointer, w_ptr: cute.Pointer, ids_ptr: cute.Pointer,
                 m: Int32, stream: cuda.CUstream, n_experts: Constexpr, top_k: Constexpr,
                 renormalize: Constexpr, scale: Constexpr):
    _router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, m, n_experts, top_k, renormalize, scale).launch(
        grid=(m, 1, 1), block=(32, 1, 1), stream=stream, use_pdl=True)



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


_COMPILED: dict[tuple, Any] = {}


def launch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool = True,
           routed_scaling_factor: float = 1.0, scoring: str = "sigmoid", expert_groups: int = 1,
           weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
           stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [M, k], ids int32 [M, k]) of the router (module docstring), on `stream`.
    `scoring` is the model's moe_router_activation_func and `expert_groups` the groups its
    selection really uses (`reference/moe.py::selection_groups`: 1 where grouping is off or keeps
    every group): the kernel refuses any but K3's sigmoid over one group rather than route such a
    model wrongly."""
    if scoring != "sigmoid" or expert_groups != 1:
        raise MoERouterEnvelopeError(
            f"moe_router: scoring={scoring!r} (moe_router_activation_func) over {expert_groups} expert group(s) "
            "(num_expert_group, topk_group, use_grouped_topk): the kernel implements sigmoid scores over a "
            "single group (K3's); such a model routes on the standard path")
    check_envelope(logits, bias, top_k)
    m, n_experts = logits.shape
    for name, t, dtype in (("weights_out", weights_out, torch.float32), ("ids_out", ids_out, torch.int32)):
        if t is not None and (t.shape != (m, top_k) or t.dtype != dtype or not t.is_contiguous()
                              or t.device != logits.device):
            raise MoERouterEnvelopeError(f"moe_router: {name} must be a contiguous [{m}, {top_k}] {dtype} "
                                         f"tensor on {logits.device}")
    device = logits.device
    arch = facts(device).arch
    key = (n_experts, top_k, renormalize, float(routed_scaling_factor), arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_router(n_experts, top_k, renormalize, routed_scaling_factor, arch)
    weights_out = torch.empty(m, top_k, dtype=torch.float32, device=device) if weights_out is None else weights_out
    ids_out = torch.empty(m, top_k, dtype=torch.int32, device=device) if ids_out is None else ids_out
    stream = torch.cuda.current_stream(device) if stream is None else stream
    fn(gmem_ptr(Float32, logits.data_ptr(), 4), gmem_ptr(Float32, bias.data_ptr(), 4),
       gmem_ptr(Float32, weights_out.data_ptr(), 4),
       gmem_ptr(Int32, ids_out.data_ptr(), 4), m, cuda.CUstream(stream.cuda_stream))
    return weights_out, ids_out
