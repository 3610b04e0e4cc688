"""KDA (Kimi Delta Attention) layer of the reference path, prefill and decode (K3_MATH.md §3.4, §4).

Per rank (h = shard.kda_heads heads of d = head_dim channels, P_r = h·d, A = exp(A_log)):

    z       = u·W_inᵀ                      rows [q | k | v | g_out | f_a | β_raw | zero pad]   bf16
    g_raw   = f_a·W_fbᵀ                    bf16 [N, P_r]
    log α   = lb·σ(A·(g_raw + dt_bias))    (bounded gate, lb = cfg.gate_lower_bound ∈ [-5, 0))
            = −A·softplus(g_raw + dt_bias) (lb None; softplus(x) = x above 20)
    y       = SiLU(Σ_j w_conv[:, j]·window[j])   causal depthwise conv of width 4 over x = [q|k|v]
    q̂, k̂   = y_q/sqrt(Σy_q² + 1e-6)·d^-½, y_k/sqrt(Σy_k² + 1e-6);   β = σ(β_raw)
    S_t     = S_{t-1}·diag(α_t)·(I − β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q̂_t
    out     = all_reduce( (o/RMS_1e-5(o) ⊙ γ_o ⊙ σ(g_out)) · W_oᵀ )

The recurrent state is fp32 and value-major: S[v, c] = state.rec[slot, head, v, c].

Precision: the stock Triton variant (K3_MATH.md §8 item 4). GEMM outputs (z, g_raw, the
o_proj partial) are bf16; the conv accumulates in fp32 and its SiLU output y is rounded
to bf16 before the recurrence; the core output o is rounded to bf16 before the gated
norm; gate, β, q̂/k̂ and the recurrence are fp32, the gated RMSNorm rounds once to bf16.
Other upstream variants (the CuTe decode kernel keeps y and o in fp32) differ from this
within bf16 tolerance only.

On CPU (the oracle) the pointwise math (gate, β, SiLU, L2 norms, gated norm) is evaluated
in fp64 and rounded once to the dtype above. torch's fp32 CPU kernels give a different
last bit in their vectorized body and their scalar tail, so a row's β or gate would depend
on how many rows share the step; evaluated in fp64 (sums of squares of bf16 values are
even exact there) every row is computed alike, and batching, verify steps and rollback
reproduce bit for bit, like ops.linear's fp64 GEMM. On CUDA the same math runs in fp32.

Segments follow reference/state.py (a = seg.accepted, C = the old conv rows):
- decode (q = seg.n tokens, verify when q > 1): start from rec[rec_read_slot], token 0's
  taps are C[a-1 : a+2], the state after token t goes to rec[rec_slots[t]] (skipped for a
  slot ≤ 0), then conv[0 : 2+q] = [C[a], C[a+1], x_0 … x_{q-1}] (raw bf16 inputs);
- prefill (any n): start from rec[rec_read_slot] and taps C[a-1 : a+2] (zero for a fresh
  request, the previous chunk's last inputs otherwise, so chunked prefill composes), write
  only the final state to rec[rec_slots[0]] and the last three raw inputs to conv[0:3].
A segment whose conv_slot, rec_read_slot or first rec slot is ≤ 0 is padding: its rows
output zeros and it touches no state. Rows outside every segment also output zeros.

Decode runs the plain token recurrence; prefill runs a chunked form of the same rule
(derived in `gated_delta_rule_chunked`), exact up to fp32 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..latency_specialized.config import K3TextConfig, ShardShapes
from .collective import Collective
from .ops import BF16, F32, linear
from .params import KDAWeights
from .state import KDALayerState, Segment

F64 = torch.float64
L2_NORM_EPS = 1e-6  # added to the sum of squares of q and k, not to a mean
O_NORM_EPS = 1e-5  # the gated output norm's own ε (class default), not cfg.rms_norm_eps
SOFTPLUS_THRESHOLD = 20.0
CONV_WIDTH = 4
PREFILL_CHUNK = 16


# ---------------------------------------------------------------------- elementwise parts


def _pointwise_dtype(t: torch.Tensor) -> torch.dtype:
    return F32 if t.is_cuda else F64


def decay_log_alpha(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float | None) -> torch.Tensor:
    """Per-channel log decay, fp32 [N, h, d], from g_raw [N, h, d], A_log [h], dt_bias [h·d]."""
    _, h, d = g_raw.shape
    dt = _pointwise_dtype(g_raw)
    zg = g_raw.to(dt) + dt_bias.to(dt).view(h, d)
    a = torch.exp(A_log.to(dt)).view(h, 1)
    if lower_bound is None:
        return (-a * F.softplus(zg, beta=1.0, threshold=SOFTPLUS_THRESHOLD)).to(F32)
    return (lower_bound * torch.sigmoid(a * zg)).to(F32)


def short_conv(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv) of the n rows of x, bf16 out.

    window [3, C] bf16: the raw inputs before x[0], oldest first; x [n, C] bf16 raw inputs;
    weight [C, 4] fp32, tap 3 multiplies the current token. The taps are added in order
    0..3 in fp32 so the sum is defined independently of any conv kernel.
    """
    seq = torch.cat([window, x]).to(F32)
    n = x.shape[0]
    acc = weight[:, 0] * seq[0:n]
    for j in range(1, CONV_WIDTH):
        acc = acc + weight[:, j] * seq[j:j + n]
    return F.silu(acc.to(_pointwise_dtype(acc))).to(BF16)


def _l2_normalize(y: torch.Tensor) -> torch.Tensor:
    """y/sqrt(Σy² + 1e-6) over the last dim, fp32 out."""
    yy = y.to(_pointwise_dtype(y))
    return (yy / torch.sqrt((yy * yy).sum(-1, keepdim=True) + L2_NORM_EPS)).to(F32)


def _gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """o/RMS_1e-5(o) ⊙ weight ⊙ σ(gate) per head, one rounding to bf16. o, gate [N, h, d]."""
    dt = _pointwise_dtype(o)
    of = o.to(dt)
    rrms = torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + O_NORM_EPS)
    return (of * rrms * weight.to(dt) * torch.sigmoid(gate.to(dt))).to(BF16)


# ---------------------------------------------------------------------- gated delta rule


def _check_core(q, k, v, log_alpha, beta, state) -> None:
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"gated delta rule: q and v must be [T, h, d], found {tuple(q.shape)} and "
                         f"{tuple(v.shape)}")
    t, h, dk = q.shape
    dv = v.shape[-1]
    want = {"q": (q, (t, h, dk)), "k": (k, (t, h, dk)), "v": (v, (t, h, dv)),
            "log_alpha": (log_alpha, (t, h, dk)), "beta": (beta, (t, h)), "state": (state, (h, dv, dk))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"gated delta rule: {name} has shape {tuple(x.shape)}, expected {shape} "
                             "(q, k, log_alpha [T, h, d_k]; v [T, h, d_v]; beta [T, h]; "
                             "state value-major [h, d_v, d_k])")
        if x.dtype != F32:
            raise ValueError(f"gated delta rule: {name} is {x.dtype}; pass fp32 tensors (.float())")


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               log_alpha: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token rule. q̂, k̂ [T, h, d_k] (already normalized, q̂ scaled), v [T, h, d_v],
    log_alpha [T, h, d_k], beta [T, h], state [h, d_v, d_k]; returns (o [T, h, d_v], new state).

    Per token: S ← S·diag(α); δ = β(v − S·k̂); S ← S + δ·k̂ᵀ; o = S·q̂ (the updated S).
    """
    _check_core(q, k, v, log_alpha, beta, state)
    s = state.clone()
    o = q.new_empty(v.shape)
    alpha = torch.exp(log_alpha)
    for t in range(q.shape[0]):
        s = s * alpha[t][:, None, :]
        recalled = torch.einsum("hvc,hc->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - recalled)
        s = s + delta[:, :, None] * k[t][:, None, :]
        o[t] = torch.einsum("hvc,hc->hv", s, q[t])
    return o, s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             log_alpha: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                             chunk: int = PREFILL_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule, parallel within chunks of `chunk` tokens (same arguments and result).

    Inside a chunk starting from state S₀, let G_t = Σ_{s≤t} log α_s (per key channel,
    cumulated from the chunk start) and Γ_t = diag(exp G_t). Writing the update as
    S_t = S_{t-1}·diag(α_t) + δ_t k̂_tᵀ with δ_t = β_t (v_t − S_{t-1}·diag(α_t)·k̂_t) and unrolling,

        S_{t-1}·diag(α_t)·k̂_t = S₀·(Γ_t k̂_t) + Σ_{s<t} A_ts δ_s,   A_ts = Σ_c k̂_t[c] k̂_s[c] e^{G_t[c] − G_s[c]}

    so the δ of the chunk solve one unit lower-triangular system (the UT transform)

        (I + diag(β)·A) Δ = diag(β)·(V − (Γk̂) S₀ᵀ)                rows of Δ are δ_tᵀ

    and then  o_t = S₀·(Γ_t q̂_t) + Σ_{s≤t} B_ts δ_s  with B_ts = Σ_c q̂_t[c] k̂_s[c] e^{G_t[c] − G_s[c]},
    S_end = S₀·Γ_end + Σ_s δ_s (k̂_s ⊙ e^{G_end − G_s})ᵀ.

    Numerical care: every decay factor used is exp of a non-positive number (G_t ≤ 0 and
    G_t − G_s ≤ 0 for s ≤ t; the pairs s > t are masked to −∞ before the exp), so nothing
    overflows whatever the chunk length or gate (bounded or softplus); a factor that
    underflows stands for a true value below 1e-38. No e^{−G} (which would reach e^{+5·chunk}
    with lb = −5) is ever formed. The triangular solve has |β·A_ts| ≤ 1 (unit keys); 16-token
    chunks keep the pairwise [h, C, C, d] decay tensor small.
    """
    _check_core(q, k, v, log_alpha, beta, state)
    if chunk < 1:
        raise ValueError(f"gated_delta_rule_chunked: chunk must be a positive token count, found {chunk}")
    s = state.clone()
    o = q.new_empty(v.shape)
    for c0 in range(0, q.shape[0], chunk):
        # per chunk, head-major: [h, C, ·]
        qc, kc, vc = (x[c0:c0 + chunk].transpose(0, 1) for x in (q, k, v))
        g = log_alpha[c0:c0 + chunk].transpose(0, 1).cumsum(1)
        bc = beta[c0:c0 + chunk].transpose(0, 1)
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        pair = (g[:, :, None, :] - g[:, None, :, :]).masked_fill(~causal[None, :, :, None], -math.inf)
        decay = torch.exp(pair)  # [h, t, s, c] = e^{G_t − G_s} on s ≤ t, else 0
        a = (kc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1).tril(-1)
        b = (qc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1)
        gamma = torch.exp(g)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        lower = eye + bc[:, :, None] * a
        rhs = bc[:, :, None] * (vc - (kc * gamma) @ s.transpose(1, 2))
        delta = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        o[c0:c0 + n] = ((qc * gamma) @ s.transpose(1, 2) + b @ delta).transpose(0, 1)
        k_to_end = kc * torch.exp(g[:, -1:, :] - g)
        s = s * gamma[:, -1][:, None, :] + delta.transpose(1, 2) @ k_to_end
    return o, s


# ---------------------------------------------------------------------- the layer


def _check_layer(w: KDAWeights, cfg: K3TextConfig, shard: ShardShapes, u: torch.Tensor,
                 segments: list[Segment], state: KDALayerState) -> None:
    h, d, p = shard.kda_heads, cfg.kda_head_dim, shard.kda_proj
    hidden = cfg.hidden_size
    if u.dim() != 2 or u.shape[1] != hidden:
        raise ValueError(f"kda_attention: u has shape {tuple(u.shape)}, expected [N, {hidden}] "
                         "(rows of all segments × hidden_size)")
    if u.dtype != BF16:
        raise ValueError(f"kda_attention: u is {u.dtype}; the layer input is bf16 (u.to(torch.bfloat16))")
    if shard.kda_fa != d or p != h * d:
        raise ValueError(f"kda_attention: shard {shard} does not match cfg {cfg.name} "
                         f"(head_dim {d}); build it with cfg.shard(tp, rank)")
    want = {"in_proj": (shard.kda_in_rows, hidden), "f_b": (p, d), "conv": (3 * p, CONV_WIDTH),
            "A_log": (h,), "dt_bias": (p,), "o_norm": (d,), "o_proj": (hidden, p)}
    for name, shape in want.items():
        t = getattr(w, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_attention: weight {name} has shape {tuple(t.shape)}, expected "
                             f"{shape} for TP{shard.tp} rank {shard.rank}; load it with this rank's shard")
        if t.device != u.device:
            raise ValueError(f"kda_attention: weight {name} is on {t.device} but u is on {u.device}; "
                             "move the weights with KDAWeights.to(device)")
    for name in ("conv", "A_log", "dt_bias"):
        if getattr(w, name).dtype != F32:
            raise ValueError(f"kda_attention: weight {name} is {getattr(w, name).dtype}; it is an fp32 parameter")
    if state.rec.dim() != 4 or tuple(state.rec.shape[1:]) != (h, d, d) or state.rec.dtype != F32:
        raise ValueError(f"kda_attention: state.rec is {state.rec.dtype} {tuple(state.rec.shape)}, "
                         f"expected fp32 [slots, {h}, {d}, {d}]")
    if state.conv.dim() != 3 or state.conv.shape[2] != 3 * p or state.conv.shape[1] < 3 \
            or state.conv.dtype != BF16:
        raise ValueError(f"kda_attention: state.conv is {state.conv.dtype} {tuple(state.conv.shape)}, "
                         f"expected bf16 [slots, 2 + max_q, {3 * p}]")
    for st in (state.rec, state.conv):
        if st.device != u.device:
            raise ValueError(f"kda_attention: the state is on {st.device} but u is on {u.device}; "
                             "build DecodeState on the layer's device")
    max_q = state.conv.shape[1] - 2
    for seg in segments:
        who = f"kda_attention: segment of request {seg.request}"
        if seg.n < 1 or seg.row0 < 0 or seg.row0 + seg.n > u.shape[0]:
            raise ValueError(f"{who}: rows {seg.row0}..{seg.row0 + seg.n - 1} are not a non-empty "
                             f"range inside u's {u.shape[0]} rows")
        if not seg.rec_slots:
            raise ValueError(f"{who}: rec_slots is empty; give one slot per decode token, or the "
                             "final slot of a prefill (0 marks padding)")
        if _is_padding(seg):
            continue
        if not 1 <= seg.accepted <= max_q:
            raise ValueError(f"{who}: accepted = {seg.accepted} outside 1..{max_q} "
                             "(the conv state holds 2 + max_q positions)")
        if seg.prefill and len(seg.rec_slots) != 1:
            raise ValueError(f"{who}: a prefill segment writes one final state; rec_slots must have "
                             f"one slot, found {len(seg.rec_slots)}")
        if not seg.prefill:
            if seg.n > max_q:
                raise ValueError(f"{who}: {seg.n} decode tokens exceed max_q = {max_q} of the state "
                                 "pool; run more tokens as prefill or raise max_q")
            if len(seg.rec_slots) != seg.n:
                raise ValueError(f"{who}: a decode segment needs one rec slot per token "
                                 f"({seg.n}), found {len(seg.rec_slots)}")
        slots = [seg.rec_read_slot, *seg.rec_slots]
        if max(slots) >= state.rec.shape[0] or seg.conv_slot >= state.conv.shape[0]:
            raise ValueError(f"{who}: slot indices rec {slots} / conv {seg.conv_slot} outside the "
                             f"pools ({state.rec.shape[0]} rec, {state.conv.shape[0]} conv slots)")


def _is_padding(seg: Segment) -> bool:
    return seg.conv_slot <= 0 or seg.rec_read_slot <= 0 or seg.rec_slots[0] <= 0


def kda_attention(w: KDAWeights, cfg: K3TextConfig, shard: ShardShapes, u: torch.Tensor,
                  segments: list[Segment], state: KDALayerState, coll: Collective,
                  *, chunked_prefill: bool = True) -> torch.Tensor:
    """u: [N, H] bf16 (rows of all segments, segment s owns rows seg.row0 : seg.row0+seg.n).
    Returns the attention output [N, H] bf16 AFTER coll.all_reduce of the o_proj partial.

    `chunked_prefill=False` runs prefill with the decode recurrence, so tests can check the
    prefill-to-decode state hand-off for exact equality."""
    _check_layer(w, cfg, shard, u, segments, state)
    p, d = shard.kda_proj, cfg.kda_head_dim
    z = linear(u, w.in_proj)
    g_raw = linear(z[:, 4 * p:4 * p + d], w.f_b)
    y_norm = kda_core(z, g_raw, w, cfg, shard, segments, state, chunked_prefill=chunked_prefill)
    return coll.all_reduce(linear(y_norm, w.o_proj))


def kda_core(z: torch.Tensor, g_raw: torch.Tensor, w: KDAWeights, cfg: K3TextConfig, shard: ShardShapes,
             segments: list[Segment], state: KDALayerState, *, chunked_prefill: bool = True) -> torch.Tensor:
    """The layer between its projections: z = in_proj output [N, ≥ 4·P_r + d + h_r], g_raw = f_b
    output [N, P_r] -> gated-normed core output [N, P_r] bf16 (o_proj's input); commits the
    segments to `state`. This is the unit `kernels/kda_decode.py` replaces."""
    h, d, p = shard.kda_heads, cfg.kda_head_dim, shard.kda_proj
    rows = z.shape[0]
    scale = d ** -0.5

    x = z[:, :3 * p]
    g_out = z[:, 3 * p:4 * p].reshape(rows, h, d)
    beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h].to(_pointwise_dtype(z))).to(F32)
    log_alpha = decay_log_alpha(g_raw.view(rows, h, d), w.A_log, w.dt_bias, cfg.gate_lower_bound)

    core = torch.zeros(rows, h, d, dtype=BF16, device=z.device)
    for seg in segments:
        if _is_padding(seg):
            continue
        r = slice(seg.row0, seg.row0 + seg.n)
        a = seg.accepted
        window = state.conv[seg.conv_slot, a - 1:a + 2].clone()
        y = short_conv(window, x[r], w.conv).to(F32).view(seg.n, 3, h, d)
        qh = _l2_normalize(y[:, 0]) * scale
        kh = _l2_normalize(y[:, 1])
        v = y[:, 2]
        s = state.rec[seg.rec_read_slot].clone()
        if seg.prefill:
            core_rule = gated_delta_rule_chunked if chunked_prefill else gated_delta_rule_recurrent
            o, s = core_rule(qh, kh, v, log_alpha[r], beta[r], s)
            state.rec[seg.rec_slots[0]].copy_(s)
            state.conv[seg.conv_slot, 0:3] = torch.cat([window, x[r]])[-3:]
        else:
            la, bt = log_alpha[r], beta[r]
            o = torch.empty(seg.n, h, d, dtype=F32, device=z.device)
            for t in range(seg.n):
                tok = slice(t, t + 1)
                o[tok], s = gated_delta_rule_recurrent(qh[tok], kh[tok], v[tok], la[tok], bt[tok], s)
                if seg.rec_slots[t] > 0:
                    state.rec[seg.rec_slots[t]].copy_(s)
            state.conv[seg.conv_slot, 0:2 + seg.n] = torch.cat([window[1:], x[r]])
        core[r] = o.to(BF16)

    return _gated_rms_norm(core, g_out, w.o_norm).reshape(rows, p)
