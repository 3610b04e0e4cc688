"""KDA decode and speculative verify in one kernel: short conv, gates, gated delta rule, gated norm.

Compiled for sm_90a, sm_100a and sm_103a. Evidence (`evidence/<card>/`): `kda_decode_test.json`,
`kda_decode_bench.json`, `kda_decode_sanitizer.json`.

Math (K3_MATH.md §3.4 steps 3-8, §4; reference: `reference/kda.py::kda_attention`, decode
segments, in its documented precision variant). Per request r with q tokens (rows r·q + t),
per head of d = 128 channels, a = accepted[r], C = conv[conv_slot[r]] (time-major, raw bf16),
x_t = z[r·q + t, q|k|v channels]:

    seq       = [C[a-1], C[a], C[a+1], x_0 … x_{q-1}]
    y_t       = bf16(SiLU(Σ_j w_conv[:, j] · seq[t + j]))                 fp32 taps, one rounding
    q̂_t, k̂_t  = y_q / sqrt(Σ y_q² + 1e-6) · d^-½,   y_k / sqrt(Σ y_k² + 1e-6);   v_t = y_v
    β_t       = σ(β_raw);   α_t = exp(lb · σ(exp(A_log) · (g_raw + dt_bias)))   (bounded gate)
    S ← rec[rec_read_slot[r]]; per token: S ← S·diag(α_t); δ = β_t (v_t − S k̂_t);
              S ← S + δ k̂_tᵀ; o_t = bf16(S q̂_t); rec[rec_slots[r, t]] ← S (slot > 0 only)
    out_t     = bf16(o_t / RMS_1e-5(o_t) ⊙ γ_o ⊙ σ(g_out,t))
    conv[conv_slot[r], 0 : 2+q] ← [C[a], C[a+1], x_0 … x_{q-1}]

A request whose conv_slot, rec_read_slot or rec_slots[r, 0] is ≤ 0 is padding: its rows are
zeros and it touches no state. A slot index at or past its pool's size is treated like 0 (so
the kernel never leaves its pools whatever the slot tensors hold) and `accepted` is clamped to
1..max_q; the reference raises on both instead. Live requests must own distinct slots.

Envelope: heads per rank 1 <= h <= MAX_HEADS (heads are grid rows: K3's 6 / 12 / 96 at TP16 / TP8 /
TP1, the tiny eval model's 1), head_dim 128; R requests of
q = 1..8 tokens each, N = R·q = 1..64 rows; z `[N, ≥ 4P + 128 + h]` bf16 (the in_proj output
q | k | v | g_out | f_a | β_raw | pad, P = 128·h), g_raw `[N, P]` bf16 (f_b output), out
`[N, P]` bf16: rows contiguous, row stride a multiple of 8, 16-byte aligned; w_conv fp32
`[3P, 4]`, A_log fp32 `[h]`, dt_bias fp32 `[P]`, o_norm bf16 `[128]`; rec fp32
`[S, h, 128 (value), 128 (key)]` and conv bf16 `[S_c, 2 + max_q, 3P]`, each slot contiguous and
slots any multiple of 16 bytes apart (vLLM's pools are views into its cache pages; max_q ≥ q,
each pool spanning < 2^31 elements); conv_slot, rec_read_slot, accepted int32 `[R]`, rec_slots int32
`[R, q]`; lower bound lb in [-5, 0) (K3's gate; the unbounded softplus gate is not built).

Design (memory-bound: each value row of S is read once and written once per token):
- Rows of S are independent given the head's k̂, q̂, α, β; only the output norm needs all
  128 values of o. So a (request, head) is a cluster of `split` CTAs, CTA `rank` owning the
  128/split value rows from rank·128/split; a value row is 8 lanes, each holding 4 float4
  (vectors lane, lane + 8, lane + 16, lane + 24 of the row: every warp access is whole 128-byte
  lines). The tile is loaded into registers first, so its HBM latency overlaps the prologue,
  and is stored once per token whose slot is live.
- Per token the serial chain is short: o = S'·q̂ with S' = S·diag(α) + δ k̂ᵀ equals
  (S·diag(α))·q̂ + δ (k̂·q̂), so the three row dots (with k̂, with q̂, and k̂·q̂) need no δ and
  share one round of 3-step butterflies inside the row's 8 lanes (each lane's 16 products
  summed as a tree); only δ and o wait for it. Mathematically the reference's o; the sums are
  ordered differently (fp32 rounding).
- Prologue (per CTA, roles by warp): warps 0 and 1 run the conv over the head's q and k
  channels for all q tokens (a lane holds 4 channels and slides the window over the tokens),
  rounds, and L2-normalizes with a warp sum; warp 2 computes α and β; warp 3 the conv of the
  CTA's own v channels. Results go to shared memory; one barrier; then the token loop.
- The q tokens' Σ o² meet once, after the loop, in `rows.block_sums` (shared memory,
  then distributed shared memory across the cluster, fixed order). The cluster barrier inside it
  also orders every CTA's reads of the old conv taps before the conv state is rewritten; each
  CTA rewrites only its share of the head's channels (its 128/split channels of q, k and v).
- fp32 throughout except the rounding points above; exp, rsqrt as the DSL lowers them
  (`ex2.approx`, `rsqrt.approx`: a few fp32 ulps), σ with a correctly rounded reciprocal, so
  results match the reference to fp32 rounding, plus the rare bf16 rounding (conv output, o,
  out) that an fp32 difference tips the other way.
- Split (CTAs per (request, head), 2, 4 or 8; 128/split value rows and 8·128/split threads
  each): `choose_split`, an unmeasured heuristic (the fewest that still give two CTAs per SM).

PDL (as `attn_res`): launched as a dependent of the kernel before it, waiting before its first
load: the slots, z, g_raw and both states are all this step's or the previous step's.

The host `launch` checks the envelope before touching the GPU, compiles once per static
variant (heads, q, max_q, strides, split, arch), then only launches, on an explicit stream
(CUDA-graph capturable: slot and accepted tensors are read on the device).
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
from .rows import block_sums, current_stream, gmem_ptr, pow2_at_least

HEAD_DIM = 128
CONV_WIDTH = 4
MAX_ROWS = 64
MAX_Q = 8
MAX_HEADS = 128  # K3 has 96 (TP1); heads only index the grid, this bounds what the tests cover
TESTED_HEADS = (1, 6, 12, 96)  # the tiny eval model, K3 at TP16, TP8, TP1
SPLITS = (2, 4, 8)
L2_NORM_EPS = 1e-6
O_NORM_EPS = 1e-5
LANES_PER_ROW = 8  # lanes sharing one state row
ROW_VECS = HEAD_DIM // 4  # float4 vectors per state row
VECS_PER_LANE = ROW_VECS // LANES_PER_ROW
MAX_POOL_ELEMS = 2**31 - 1  # element offsets are 32-bit


class KdaEnvelopeError(ValueError):
    """The inputs fall outside what the KDA decode kernel supports."""


@dataclass(frozen=True)
class KdaDecodePlan:
    """Everything static about one compiled variant (strides in elements)."""

    heads: int
    q: int  # tokens per request in the step
    conv_positions: int  # 2 + max_q of the conv pool
    z_stride: int
    g_stride: int
    out_stride: int
    split: int  # CTAs per (request, head)
    rec_slot_stride: int  # elements from one slot to the next: h·128·128 in our pools, a page in vLLM's
    conv_slot_stride: int  # likewise, (2 + max_q)·3P in our pools

    @property
    def value_rows(self) -> int:
        return HEAD_DIM // self.split

    @property
    def threads(self) -> int:
        return self.value_rows * LANES_PER_ROW


# ---------------------------------------------------------------- index maps (device and host)
# Plain integer arithmetic, traced into the kernel and checked for coverage on the CPU.


def state_row(rank, tid, split: int):
    """Value row of S that thread `tid` of cluster CTA `rank` owns."""
    return rank * (HEAD_DIM // split) + tid // LANES_PER_ROW


def state_vector(tid, i: int):
    """Which float4 of its row (0..31) is the thread's i-th (i < VECS_PER_LANE)."""
    return tid % LANES_PER_ROW + LANES_PER_ROW * i


def owned_channel_vector(part, head, rank, c4, heads: int, split: int):
    """4-channel vector index (channel / 4) of the c4-th vector that CTA `rank` rewrites in the
    conv state: its 128/split channels of q (part 0), k (1) and v (2) of `head`."""
    return (part * heads * HEAD_DIM + head * HEAD_DIM + rank * (HEAD_DIM // split)) // 4 + c4


def output_vector(rank, tid, split: int):
    """(token, 8-channel vector inside the head) that thread `tid` (< q·value_rows/8) stores."""
    per_token = HEAD_DIM // split // 8
    return tid // per_token, rank * per_token + tid % per_token


def choose_split(requests: int, heads: int, sm_count: int) -> int:
    """The smallest split whose R·h·split CTAs give every SM two; the largest when none does
    (an unmeasured heuristic: the benchmark times every split)."""
    for split in SPLITS[:-1]:
        if requests * heads * split >= 2 * sm_count:
            return split
    return SPLITS[-1]


# ---------------------------------------------------------------- device code


def _vectors(ptr: cute.Pointer, shape: tuple, stride: tuple, vec: int) -> cute.Tensor:
    """A row-major view cut into `vec`-element vectors along the last dim:
    ((1, …, vec), (shape[:-1]…, shape[-1] / vec))."""
    t = cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))
    return cute.zipped_divide(t, (1,) * (len(shape) - 1) + (vec,))


@cute.jit
def _sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))


def _tree_sum(scratch: cute.Tensor, values: cute.TensorSSA) -> Float32:
    """Σ of a lane's 16 values by pairwise halving (4 dependent adds instead of 16). Plain Python:
    the halving loop unrolls while tracing."""
    scratch.store(values)
    width = 4 * VECS_PER_LANE
    while width > 1:
        width //= 2
        for i in range(width):
            scratch[i] = scratch[i] + scratch[i + width]
    return scratch[0]


def _row_sum(partial: Float32) -> Float32:
    """Σ over the LANES_PER_ROW lanes of a state row (a butterfly: every lane gets the total)."""
    return cute.arch.warp_reduction_sum(partial, threads_in_group=LANES_PER_ROW)


@cute.jit
def _short_conv(z_v: cute.Tensor, conv_v: cute.Tensor, w_v: cute.Tensor, ch4: Int32, row0: Int32,
                cslot: Int32, a: Int32, y: cute.Tensor, q: Constexpr):
    """y[e, t] = bf16(SiLU(conv)) of channels 4·ch4 + e (e < 4) for the q tokens, as fp32.

    The window slides over seq = [C[a-1], C[a], C[a+1], x_0 … x_{q-1}] (4-channel vectors);
    taps are summed in order 0..3 in fp32 as multiply-adds (the reference rounds each product
    first: a rare 1-ulp difference in y)."""
    seq = cute.make_rmem_tensor(cute.make_layout((4, q + CONV_WIDTH - 1)), BFloat16)
    for p in cutlass.range_constexpr(CONV_WIDTH - 1):
        cute.autovec_copy(conv_v[(0, 0, None), (cslot, a - 1 + p, ch4)], seq[None, p])
    for t in cutlass.range_constexpr(q):
        cute.autovec_copy(z_v[(0, None), (row0 + t, ch4)], seq[None, CONV_WIDTH - 1 + t])
    taps = cute.make_rmem_tensor(cute.make_layout((CONV_WIDTH, 4)), Float32)  # (tap, channel)
    for e in cutlass.range_constexpr(4):
        cute.autovec_copy(w_v[(0, None), (4 * ch4 + e, 0)], taps[None, e])
    for t in cutlass.range_constexpr(q):
        for e in cutlass.range_constexpr(4):
            acc = taps[0, e] * seq[e, t].to(Float32)
            for j in cutlass.range_constexpr(1, CONV_WIDTH):
                acc = acc + taps[j, e] * seq[e, t + j].to(Float32)
            y[e, t] = acc
    pre = y.load()
    y.store((pre * _sigmoid(pre)).to(BFloat16).to(Float32))


@cute.kernel
def _kda_decode_kernel(z_ptr: cute.Pointer, graw_ptr: cute.Pointer, convw_ptr: cute.Pointer,
                       alog_ptr: cute.Pointer, dt_ptr: cute.Pointer, onorm_ptr: cute.Pointer,
                       rec_ptr: cute.Pointer, conv_ptr: cute.Pointer, conv_slot_ptr: cute.Pointer,
                       read_slot_ptr: cute.Pointer, rec_slots_ptr: cute.Pointer, accepted_ptr: cute.Pointer,
                       out_ptr: cute.Pointer, requests: Int32, rec_pool: Int32, conv_pool: Int32,
                       lower_bound: Float32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    rank, head, req = cute.arch.block_idx()
    h, q, split = plan.heads, plan.q, plan.split
    vr = plan.value_rows
    warps = plan.threads // 32
    p = h * HEAD_DIM
    n = requests * q
    row0 = req * q
    warp = tid // 32
    lane = tid % 32

    z_v4 = _vectors(z_ptr, (n, plan.z_stride), (plan.z_stride, 1), 4)
    z_v8 = _vectors(z_ptr, (n, plan.z_stride), (plan.z_stride, 1), 8)
    z_s = cute.make_tensor(z_ptr, cute.make_layout((n, plan.z_stride), stride=(plan.z_stride, 1)))
    g_v4 = _vectors(graw_ptr, (n, p), (plan.g_stride, 1), 4)
    w_v = _vectors(convw_ptr, (3 * p, CONV_WIDTH), (CONV_WIDTH, 1), 4)
    dt_v = _vectors(dt_ptr, (1, p), (p, 1), 4)
    on_v = _vectors(onorm_ptr, (1, HEAD_DIM), (HEAD_DIM, 1), 8)
    rec_v = _vectors(rec_ptr, (rec_pool, h, HEAD_DIM, HEAD_DIM),
                     (plan.rec_slot_stride, HEAD_DIM * HEAD_DIM, HEAD_DIM, 1), 4)
    conv_v = _vectors(conv_ptr, (conv_pool, plan.conv_positions, 3 * p), (plan.conv_slot_stride, 3 * p, 1), 4)
    out_v = _vectors(out_ptr, (n, p), (plan.out_stride, 1), 8)
    per_req = cute.make_layout(requests)
    conv_slots = cute.make_tensor(conv_slot_ptr, per_req)
    read_slots = cute.make_tensor(read_slot_ptr, per_req)
    accepted = cute.make_tensor(accepted_ptr, per_req)
    rec_slots = cute.make_tensor(rec_slots_ptr, cute.make_layout((requests, q), stride=(q, 1)))

    smem = cutlass.memory.SmemAllocator()
    qk_s = smem.allocate_tensor(Float32, cute.make_layout((q, 2 * HEAD_DIM), stride=(2 * HEAD_DIM, 1)),
                                byte_alignment=16)  # q̂ | k̂ per token
    alpha_s = smem.allocate_tensor(Float32, cute.make_layout((q, HEAD_DIM), stride=(HEAD_DIM, 1)),
                                   byte_alignment=16)
    v_s = smem.allocate_tensor(Float32, cute.make_layout((q, vr), stride=(vr, 1)), byte_alignment=16)
    o_s = smem.allocate_tensor(Float32, cute.make_layout((q, vr), stride=(vr, 1)), byte_alignment=16)
    beta_s = smem.allocate_tensor(Float32, cute.make_layout(q), byte_alignment=16)
    red = smem.allocate_tensor(Float32, cute.make_layout((q, warps)), byte_alignment=16)
    fin = smem.allocate_tensor(Float32, cute.make_layout((q, split)), byte_alignment=16)
    qk_v = cute.zipped_divide(qk_s, (1, 4))
    alpha_v = cute.zipped_divide(alpha_s, (1, 4))
    v_v = cute.zipped_divide(v_s, (1, 4))
    o_v = cute.zipped_divide(o_s, (1, 8))

    cute.arch.griddepcontrol_wait()
    cslot = conv_slots[req]
    rslot = read_slots[req]
    first = rec_slots[req, 0]
    live = (cslot > 0) & (cslot < conv_pool) & (rslot > 0) & (rslot < rec_pool) & (first > 0) & (first < rec_pool)
    out_vecs = q * (vr // 8)
    if live:
        cute.arch.cluster_arrive_relaxed()
        a = cutlass.max(cutlass.min(accepted[req], plan.conv_positions - 2), 1)
        row = state_row(rank, tid, split)
        row_local = tid // LANES_PER_ROW
        s_r = cute.make_rmem_tensor(cute.make_layout((4, VECS_PER_LANE)), Float32)
        for i in cutlass.range_constexpr(VECS_PER_LANE):
            cute.autovec_copy(rec_v[(0, 0, 0, None), (rslot, head, row, state_vector(tid, i))], s_r[None, i])

        # ---- prologue: per-head vectors of every token into shared memory
        y = cute.make_rmem_tensor(cute.make_layout((4, q)), Float32)
        if warp < 2:  # warp 0: q channels, warp 1: k channels; lane = 4 channels
            _short_conv(z_v4, conv_v, w_v, (warp * p + head * HEAD_DIM) // 4 + lane, row0, cslot, a, y, q)
            scale = cutlass.select_(warp == 0, Float32(HEAD_DIM ** -0.5), Float32(1.0))
            for t in cutlass.range_constexpr(q):
                yt = y[None, t].load()
                ss = cute.arch.warp_reduction_sum((yt * yt).reduce(cute.ReductionOp.ADD, init_val=0.0,
                                                                   reduction_profile=0))
                inv = cute.math.rsqrt(ss + L2_NORM_EPS) * scale
                y[None, t].store(yt * inv)
                cute.autovec_copy(y[None, t], qk_v[(0, None), (t, warp * ROW_VECS + lane)])
        elif warp == 2:  # decay gate for 4 key channels per lane, β per token
            dt = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            cute.autovec_copy(dt_v[(0, None), (0, head * ROW_VECS + lane)], dt)
            a_gate = cute.math.exp(cute.make_tensor(alog_ptr, cute.make_layout(h))[head])
            graw = cute.make_rmem_tensor(cute.make_layout((4, q)), BFloat16)
            for t in cutlass.range_constexpr(q):
                cute.autovec_copy(g_v4[(0, None), (row0 + t, head * ROW_VECS + lane)], graw[None, t])
            for t in cutlass.range_constexpr(q):
                zg = graw[None, t].load().to(Float32) + dt.load()
                y[None, t].store(cute.math.exp(lower_bound * _sigmoid(a_gate * zg)))
                cute.autovec_copy(y[None, t], alpha_v[(0, None), (t, lane)])
            if lane < q:
                beta_s[lane] = _sigmoid(z_s[row0 + lane, 4 * p + HEAD_DIM + head].to(Float32))
        elif warp == 3:  # conv of this CTA's own v channels
            if lane < vr // 4:
                _short_conv(z_v4, conv_v, w_v, (2 * p + head * HEAD_DIM + rank * vr) // 4 + lane, row0, cslot, a,
                            y, q)
                for t in cutlass.range_constexpr(q):
                    cute.autovec_copy(y[None, t], v_v[(0, None), (t, lane)])
        cute.arch.sync_threads()

        # ---- the gated delta rule, token by token, on the register tile
        g = tid % LANES_PER_ROW
        sq = cute.make_rmem_tensor(cute.make_layout(pow2_at_least(q)), Float32)
        sq.fill(0.0)
        al = cute.make_rmem_tensor(cute.make_layout((4, VECS_PER_LANE)), Float32)
        kk = cute.make_rmem_tensor(cute.make_layout((4, VECS_PER_LANE)), Float32)
        qq = cute.make_rmem_tensor(cute.make_layout((4, VECS_PER_LANE)), Float32)
        prod = cute.make_rmem_tensor(cute.make_layout(4 * VECS_PER_LANE), Float32)
        for t in cutlass.range_constexpr(q):
            for i in cutlass.range_constexpr(VECS_PER_LANE):
                vec = state_vector(tid, i)
                cute.autovec_copy(alpha_v[(0, None), (t, vec)], al[None, i])
                cute.autovec_copy(qk_v[(0, None), (t, ROW_VECS + vec)], kk[None, i])
                cute.autovec_copy(qk_v[(0, None), (t, vec)], qq[None, i])
            k_t = kk.load()
            q_t = qq.load()
            s = s_r.load() * al.load()
            # o = S'·q̂ with S' = S + δ k̂ᵀ is S·q̂ + δ (k̂·q̂): the three dots need no δ, so they
            # share one butterfly round and only δ and o wait for it
            recalled = _row_sum(_tree_sum(prod, s * k_t))
            o_decayed = _row_sum(_tree_sum(prod, s * q_t))
            kq = _row_sum(_tree_sum(prod, k_t * q_t))
            delta = beta_s[t] * (v_s[t, row_local] - recalled)
            s_r.store(s + delta * k_t)
            o = o_decayed + delta * kq
            slot = rec_slots[req, t]
            if (slot > 0) & (slot < rec_pool):
                for i in cutlass.range_constexpr(VECS_PER_LANE):
                    cute.autovec_copy(s_r[None, i], rec_v[(0, 0, 0, None), (slot, head, row, state_vector(tid, i))])
            o_bf = o.to(BFloat16).to(Float32)  # the reference rounds o before the norm
            if g == 0:
                o_s[t, row_local] = o_bf
                sq[t] = o_bf * o_bf

        # ---- Σ o² of each token over the head (cluster), then the gated norm
        cute.arch.cluster_wait()
        block_sums(sq, red, fin, rank, q, warps, split)
        if tid < out_vecs:
            t, vec = output_vector(rank, tid, split)
            total = sq[0]
            for tt in cutlass.range_constexpr(1, q):
                total = cutlass.select_(t == tt, sq[tt], total)
            rrms = cute.math.rsqrt(total * (1.0 / HEAD_DIM) + O_NORM_EPS)
            o8 = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            cute.autovec_copy(o_v[(0, None), (t, vec - rank * (vr // 8))], o8)
            gate = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            cute.autovec_copy(z_v8[(0, None), (row0 + t, (3 * p + head * HEAD_DIM) // 8 + vec)], gate)
            wn = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            cute.autovec_copy(on_v[(0, None), (0, vec)], wn)
            res = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            res.store((o8.load() * rrms * wn.load().to(Float32) * _sigmoid(gate.load().to(Float32))).to(BFloat16))
            cute.autovec_copy(res, out_v[(0, None), (row0 + t, head * (HEAD_DIM // 8) + vec)])

        # ---- conv state: every CTA of the cluster has read its taps (cluster barrier above)
        if tid < 3 * (vr // 4):
            ch4 = owned_channel_vector(tid // (vr // 4), head, rank, tid % (vr // 4), h, split)
            kept = cute.make_rmem_tensor(cute.make_layout((4, 2)), BFloat16)
            for j in cutlass.range_constexpr(2):
                cute.autovec_copy(conv_v[(0, 0, None), (cslot, a + j, ch4)], kept[None, j])
            xs = cute.make_rmem_tensor(cute.make_layout((4, q)), BFloat16)
            for t in cutlass.range_constexpr(q):
                cute.autovec_copy(z_v4[(0, None), (row0 + t, ch4)], xs[None, t])
            for j in cutlass.range_constexpr(2):
                cute.autovec_copy(kept[None, j], conv_v[(0, 0, None), (cslot, j, ch4)])
            for t in cutlass.range_constexpr(q):
                cute.autovec_copy(xs[None, t], conv_v[(0, 0, None), (cslot, 2 + t, ch4)])
    else:
        if tid < out_vecs:
            t, vec = output_vector(rank, tid, split)
            zeros = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            zeros.fill(0.0)
            cute.autovec_copy(zeros, out_v[(0, None), (row0 + t, head * (HEAD_DIM // 8) + vec)])


@cute.jit
def _kda_decode_host(z_ptr: cute.Pointer, graw_ptr: cute.Pointer, convw_ptr: cute.Pointer, alog_ptr: cute.Pointer,
                     dt_ptr: cute.Pointer, onorm_ptr: cute.Pointer, rec_ptr: cute.Pointer, conv_ptr: cute.Pointer,
                     conv_slot_ptr: cute.Pointer, read_slot_ptr: cute.Pointer, rec_slots_ptr: cute.Pointer,
                     accepted_ptr: cute.Pointer, out_ptr: cute.Pointer, requests: Int32, rec_pool: Int32,
                     conv_pool: Int32, lower_bound: Float32, stream: cuda.CUstream, plan: Constexpr):
    _kda_decode_kernel(z_ptr, graw_ptr, convw_ptr, alog_ptr, dt_ptr, onorm_ptr, rec_ptr, conv_ptr, conv_slot_ptr,
                       read_slot_ptr, rec_slots_ptr, accepted_ptr, out_ptr, requests, rec_pool, conv_pool,
                       lower_bound, plan).launch(
        grid=(plan.split, plan.heads, requests), block=(plan.threads, 1, 1), cluster=(plan.split, 1, 1),
        stream=stream, use_pdl=True)


def compile_kda_decode(plan: KdaDecodePlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    bf, f32, i32 = gmem_ptr(BFloat16, 16), gmem_ptr(Float32, 16), gmem_ptr(Int32, 16, 4)
    return cute.compile(_kda_decode_host, bf, bf, f32, gmem_ptr(Float32, 16, 4), f32, bf, f32, bf, i32, i32, i32, i32,
                        bf, Int32(1), Int32(2), Int32(2), Float32(-5.0), cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


# ---------------------------------------------------------------- host side


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise KdaEnvelopeError(f"kda_decode: {msg}")


def _check(name: str, t: Any, shape: tuple, dtype: torch.dtype, align: int = 16, rows: bool = False) -> None:
    """t must be a `dtype` tensor of `shape` (None = any size), 16-byte aligned (or `align`), either
    contiguous or, with rows=True, with contiguous rows whose stride is a multiple of 8."""
    want = "[" + ", ".join("·" if s is None else str(s) for s in shape) + "]"
    _need(isinstance(t, torch.Tensor), f"{name} must be a torch tensor, got {type(t).__name__}")
    _need(t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape)),
          f"{name} must be {want}, got {list(t.shape)}")
    _need(t.dtype == dtype, f"{name} must be {str(dtype).removeprefix('torch.')}, got "
          f"{str(t.dtype).removeprefix('torch.')}; cast it first")
    if rows:
        _need(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0,
              f"{name} rows must be contiguous and 16-byte aligned with a row stride that is a multiple of 8 "
              f"(got strides {tuple(t.stride())}); call .contiguous()")
    else:
        _need(t.is_contiguous() and t.data_ptr() % align == 0,
              f"{name} must be contiguous and {align}-byte aligned; call .contiguous()")


def _check_pool(name: str, t: Any, slot_shape: tuple, dtype: torch.dtype) -> None:
    """A state pool [slots, *slot_shape]: each slot contiguous, slots any whole number of 16-byte
    vectors apart (our pools are contiguous; vLLM's are strided views into its cache pages)."""
    want = "[·, " + ", ".join("·" if s is None else str(s) for s in slot_shape) + "]"
    _need(isinstance(t, torch.Tensor), f"{name} must be a torch tensor, got {type(t).__name__}")
    _need(t.dim() == 1 + len(slot_shape) and all(s is None or s == n for s, n in zip(slot_shape, t.shape[1:])),
          f"{name} must be {want}, got {list(t.shape)}")
    _need(t.dtype == dtype, f"{name} must be {str(dtype).removeprefix('torch.')}, got "
          f"{str(t.dtype).removeprefix('torch.')}; cast it first")
    inner = t[0] if t.shape[0] else t.new_empty(t.shape[1:])
    _need(t.shape[0] > 0 and inner.is_contiguous() and t.stride(0) >= inner.numel(),
          f"{name} must hold each slot contiguously (strides {tuple(t.stride())} for shape {list(t.shape)}); "
          "slots may be further apart than a slot's size, never overlap")
    _need(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0,
          f"{name} slots must start on 16-byte boundaries (data_ptr {t.data_ptr()}, slot stride "
          f"{t.stride(0)} elements of {t.element_size()} bytes)")
    span = (t.shape[0] - 1) * t.stride(0) + inner.numel()
    _need(span <= MAX_POOL_ELEMS, f"the {name} pool spans {span} elements; the kernel indexes up to "
          f"{MAX_POOL_ELEMS} (32-bit offsets): use fewer slots per pool")


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_envelope(z: torch.Tensor, g_raw: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, o_norm: torch.Tensor, rec: torch.Tensor, conv: torch.Tensor,
                   conv_slot: torch.Tensor, rec_read_slot: torch.Tensor, rec_slots: torch.Tensor,
                   accepted: torch.Tensor, lower_bound: float | None, out: torch.Tensor | None) -> tuple[int, int]:
    """Raise KdaEnvelopeError naming what is outside the envelope (no GPU work); return (R, q)."""
    _check("rec_slots", rec_slots, (None, None), torch.int32, 4)
    requests, q = rec_slots.shape
    _need(1 <= q <= MAX_Q, f"q={q} tokens per request (rec_slots.shape[1]) is outside 1..{MAX_Q}")
    _need(1 <= requests * q <= MAX_ROWS,
          f"{requests} requests × {q} tokens = {requests * q} rows is outside 1..{MAX_ROWS}; split the step")
    for name, t in (("conv_slot", conv_slot), ("rec_read_slot", rec_read_slot), ("accepted", accepted)):
        _check(name, t, (requests,), torch.int32, 4)
    _check("A_log", A_log, (None,), torch.float32, 4)
    heads = A_log.shape[0]
    _need(1 <= heads <= MAX_HEADS, f"{heads} KDA heads per rank (A_log.shape[0]) is outside 1..{MAX_HEADS}")
    p, n = heads * HEAD_DIM, requests * q
    _check("z", z, (n, None), torch.bfloat16, rows=True)
    _need(z.shape[1] >= 4 * p + HEAD_DIM + heads,
          f"z has {z.shape[1]} columns; the in_proj output q|k|v|g_out|f_a|beta needs >= {4 * p + HEAD_DIM + heads}")
    _check("g_raw", g_raw, (n, p), torch.bfloat16, rows=True)
    _check("conv_weight", conv_weight, (3 * p, CONV_WIDTH), torch.float32)
    _check("dt_bias", dt_bias, (p,), torch.float32)
    _check("o_norm", o_norm, (HEAD_DIM,), torch.bfloat16)
    _check_pool("rec", rec, (heads, HEAD_DIM, HEAD_DIM), torch.float32)
    _check_pool("conv", conv, (None, 3 * p), torch.bfloat16)
    _need(2 + q <= conv.shape[1] <= 2 + MAX_Q,
          f"conv holds {conv.shape[1]} positions; a step of q={q} needs 2 + max_q with q <= max_q <= {MAX_Q}")
    _need(isinstance(lower_bound, (int, float)) and -5.0 <= lower_bound < 0.0,
          f"lower_bound={lower_bound!r}: the kernel computes K3's bounded gate lb·σ(A·(g+dt)) with lb in [-5, 0); "
          "the unbounded softplus gate runs on the reference path")
    named = {"z": z, "g_raw": g_raw, "conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias,
             "o_norm": o_norm, "rec": rec, "conv": conv, "conv_slot": conv_slot, "rec_read_slot": rec_read_slot,
             "rec_slots": rec_slots, "accepted": accepted}
    if out is not None:
        _check("out", out, (n, p), torch.bfloat16, rows=True)
        lo, hi = _span(out)
        for name in ("z", "g_raw", "rec", "conv"):
            a, b = _span(named[name])
            _need(hi <= a or b <= lo, f"out overlaps {name}; give the output its own buffer")
        named["out"] = out
    for name, t in named.items():
        _need(t.device.type == "cuda", f"{name} must be a CUDA tensor, got one on {t.device}")
    _need(len({t.device for t in named.values()}) == 1, f"{', '.join(named)} must all be on one device")
    return requests, q


_COMPILED: dict[tuple[KdaDecodePlan, str], Any] = {}


def launch(z: torch.Tensor, g_raw: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
           dt_bias: torch.Tensor, o_norm: torch.Tensor, rec: torch.Tensor, conv: torch.Tensor,
           conv_slot: torch.Tensor, rec_read_slot: torch.Tensor, rec_slots: torch.Tensor, accepted: torch.Tensor,
           lower_bound: float, out: torch.Tensor | None = None, *, stream: torch.cuda.Stream | None = None,
           split: int | None = None) -> torch.Tensor:
    """One KDA decode / verify step (module docstring): returns out `[R·q, P]` bf16 (allocated when
    None) and updates rec and conv in place, on `stream` (default: the current stream).

    Request r owns rows r·q … r·q + q − 1 of z, g_raw and out; q = rec_slots.shape[1]. The first
    call of a variant compiles (a second or two); later calls only launch. `split` overrides the
    CTAs per (request, head) (benchmarks sweep it).
    """
    requests, q = check_envelope(z, g_raw, conv_weight, A_log, dt_bias, o_norm, rec, conv, conv_slot,
                                 rec_read_slot, rec_slots, accepted, lower_bound, out)
    heads = A_log.shape[0]
    dev = z.device
    if out is None:
        out = torch.empty((requests * q, heads * HEAD_DIM), dtype=torch.bfloat16, device=dev)
    if split is None:
        split = choose_split(requests, heads, facts(dev).sm_count)
    _need(split in SPLITS, f"split={split} is not one of {SPLITS}")
    plan = KdaDecodePlan(heads, q, conv.shape[1], z.stride(0), g_raw.stride(0), out.stride(0), split, rec.stride(0),
                         conv.stride(0))
    key = (plan, facts(dev).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_kda_decode(plan, key[1])
    fn(gmem_ptr(BFloat16, z.data_ptr()), gmem_ptr(BFloat16, g_raw.data_ptr()),
       gmem_ptr(Float32, conv_weight.data_ptr()), gmem_ptr(Float32, A_log.data_ptr(), 4),
       gmem_ptr(Float32, dt_bias.data_ptr()), gmem_ptr(BFloat16, o_norm.data_ptr()),
       gmem_ptr(Float32, rec.data_ptr()), gmem_ptr(BFloat16, conv.data_ptr()),
       gmem_ptr(Int32, conv_slot.data_ptr(), 4), gmem_ptr(Int32, rec_read_slot.data_ptr(), 4),
       gmem_ptr(Int32, rec_slots.data_ptr(), 4), gmem_ptr(Int32, accepted.data_ptr(), 4),
       gmem_ptr(BFloat16, out.data_ptr()), requests, rec.shape[0], conv.shape[0], float(lower_bound),
       current_stream(dev, stream))
    return out
