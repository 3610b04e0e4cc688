"""MLA attention of the reference path, one TP rank (K3_MATH.md §3.5, rounding points §8).

Per token, with the rank's h = n_h/T heads and τ = 1/sqrt(d_n + d_r):

    [q_c | kv_c | k_pe | g] = u · W_aᵀ                    (one GEMM; latents replicated, g by head)
    q_c' = RMSNorm(q_c, γ_qa),  c = RMSNorm(kv_c, γ_kva)  (fp32, one rounding)
    [q_nope | q_pe]_h = (q_c' · W_qbᵀ)_h
    cache[p] ← [c | k_pe]                                 (before attention, every token)
    o_h = Σ_{t ≤ p} softmax_t(τ (q_nope_h · W_UK_h c_t + q_pe_h · k_pe_t)) · W_UV_h c_t
    a   = all_reduce( bf16(o ⊙ σ(g)) · W_oᵀ )

NoPE: nothing is rotated, positions only index the cache and the causal mask. A token at
position p of its request sees positions 0..p, which covers prefill, plain decode (q = 1)
and speculative verify (row j of q sees the context plus draft rows 0..j).

Two equal forms of the attention core, both exposed for tests:

- `attend_naive` (prefill): materializes k_t = [W_UK c_t ; k_pe_t] and v_t = W_UV c_t
  (bf16, as vLLM's prefill kv_b GEMM does) and runs standard softmax attention.
- `attend_absorbed` (decode): folds W_UK into the query (ql = q_nope · W_UK, bf16) and
  W_UV after the softmax, so scores and values are taken over the latent cache itself.
  The latent output ol is rounded to bf16 before W_UV, as the attention kernel writes it.

Scores, softmax and the p·v accumulation are fp32 in both forms (fp64 on CPU, where the
oracle must be batch-invariant: `ops.acc_dtype`).

Envelope: a bf16 paged cache [num_blocks, block_size, r_kv + d_r] (FP8 caches belong to
the kernels). Block id 0 is the null block: padding segments whose block table points
there may write it freely (it is scratch) and their output rows must not be used. Rows of
`u` outside every segment produce zero attention output.
"""

from __future__ import annotations

import math

import torch

from ..latency_specialized.config import K3TextConfig, ShardShapes
from .collective import Collective
from .ops import BF16, F32, acc_dtype, linear, rms_norm
from .params import MLAWeights
from .state import MLALayerState, Segment


def split_kv_b(kv_b: torch.Tensor, cfg: K3TextConfig, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [heads·(d_n + d_v), r_kv] -> W_UK [heads, d_n, r_kv], W_UV [heads, d_v, r_kv]."""
    d_n, d_v = cfg.qk_nope_head_dim, cfg.v_head_dim
    per_head = kv_b.view(heads, d_n + d_v, cfg.kv_lora_rank)
    return per_head[:, :d_n], per_head[:, d_n:]


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last axis of scores [h, n, L]; query j sits at position L − n + j."""
    _, n, length = scores.shape
    query_pos = torch.arange(length - n, length, device=scores.device).unsqueeze(1)
    future = torch.arange(length, device=scores.device).unsqueeze(0) > query_pos
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def _check_core(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
    heads, d_n, r_kv = w_uk.shape
    if q.dim() != 3 or q.shape[1] != heads or q.shape[2] <= d_n:
        raise ValueError(f"q must be [n, {heads}, {d_n} + d_r] to match W_UK {tuple(w_uk.shape)}, "
                         f"found {tuple(q.shape)}")
    d_r = q.shape[2] - d_n
    if kv.dim() != 2 or kv.shape[1] != r_kv + d_r:
        raise ValueError(f"kv must be [L, r_kv + d_r = {r_kv + d_r}], found {tuple(kv.shape)}")
    if kv.shape[0] < q.shape[0]:
        raise ValueError(f"kv holds {kv.shape[0]} positions but there are {q.shape[0]} queries; "
                         "the queries are the last positions of kv, so insert them first")
    if w_uv.shape[0] != heads or w_uv.shape[2] != r_kv:
        raise ValueError(f"W_UV must be [{heads}, d_v, {r_kv}], found {tuple(w_uv.shape)}")


def attend_latent(q_lat: torch.Tensor, kv: torch.Tensor, r_kv: int, tau: float) -> torch.Tensor:
    """The latent core that `kernels/mla_decode.py` computes: q_lat [n, h, r_kv + d_r] = [ql | q_pe]
    against the cache rows kv [L, r_kv + d_r] -> ol [n, h, r_kv] bf16 (the queries are the last
    n positions, causal among them; τ = 1/sqrt(d_n + d_r))."""
    acc = acc_dtype(kv)
    scores = tau * torch.einsum("nhc,lc->hnl", q_lat.to(acc), kv.to(acc))
    p = _causal_softmax(scores)
    return torch.einsum("hnl,lr->nhr", p, kv[:, :r_kv].to(acc)).to(BF16)


def attend_absorbed(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA core: q [n, h, d_n + d_r], kv [L, r_kv + d_r] -> o [n, h, d_v] bf16.

    The n queries are the last n positions of kv (already inserted); causal among them.
    """
    _check_core(q, kv, w_uk, w_uv)
    ol = attend_latent(absorb_query(q, w_uk), kv, w_uk.shape[2], 1.0 / math.sqrt(q.shape[-1]))
    return unabsorb(ol, w_uv)


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [n, h, d_n + d_r] -> q_lat [n, h, r_kv + d_r] = [bf16(q_nope · W_UK) | q_pe]: dotted with a
    whole cache row [c | k_pe] it gives both score terms at once."""
    acc = acc_dtype(q)
    ql = torch.einsum("nhd,hdr->nhr", q[..., :w_uk.shape[1]].to(acc), w_uk.to(acc)).to(BF16)
    return torch.cat([ql, q[..., w_uk.shape[1]:]], dim=-1)


def unabsorb(ol: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Latent attention output ol [n, h, r_kv] -> o [n, h, d_v] = bf16(ol · W_UVᵀ)."""
    return torch.einsum("nhr,hvr->nhv", ol.to(acc_dtype(ol)), w_uv.to(acc_dtype(ol))).to(BF16)


def attend_naive(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor,
                 w_uv: torch.Tensor) -> torch.Tensor:
    """Non-absorbed MLA core (same contract as `attend_absorbed`): per-head keys and values."""
    _check_core(q, kv, w_uk, w_uv)
    acc = acc_dtype(kv)
    heads, _, r_kv = w_uk.shape
    length = kv.shape[0]
    tau = 1.0 / math.sqrt(q.shape[-1])
    c, k_pe = kv[:, :r_kv].to(acc), kv[:, r_kv:]
    k_nope = torch.einsum("lr,hdr->lhd", c, w_uk.to(acc)).to(BF16)
    values = torch.einsum("lr,hvr->lhv", c, w_uv.to(acc)).to(BF16)
    keys = torch.cat([k_nope, k_pe.unsqueeze(1).expand(length, heads, k_pe.shape[-1])], dim=-1)
    scores = tau * torch.einsum("nhd,lhd->hnl", q.to(acc), keys.to(acc))
    p = _causal_softmax(scores)
    return torch.einsum("hnl,lhv->nhv", p, values.to(acc)).to(BF16)


def _cache_slots(seg: Segment, cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of the request's positions in the paged cache."""
    block_size = cache.shape[1]
    entry = positions // block_size
    if int(entry.max()) >= seg.block_table.numel():
        raise ValueError(
            f"request {seg.request}: position {int(positions.max())} needs block-table entry "
            f"{int(entry.max())} but the table has {seg.block_table.numel()} (block_size "
            f"{block_size}); give the request a longer block table")
    blocks = seg.block_table.to(torch.long)[entry]
    if int(blocks.max()) >= cache.shape[0] or int(blocks.min()) < 0:
        raise ValueError(f"request {seg.request}: block ids {blocks.unique().tolist()} outside the "
                         f"cache's {cache.shape[0]} blocks")
    return blocks, positions % block_size


def _check_inputs(cfg: K3TextConfig, shard: ShardShapes, w: MLAWeights, u: torch.Tensor,
                  segments: list[Segment], cache: torch.Tensor) -> None:
    if u.dim() != 2 or u.shape[1] != cfg.hidden_size:
        raise ValueError(f"u must be [N, hidden_size={cfg.hidden_size}], found {tuple(u.shape)}")
    if w.fused_a.shape != (shard.mla_fused_a_rows, cfg.hidden_size):
        raise ValueError(f"MLAWeights.fused_a is {tuple(w.fused_a.shape)} but TP{shard.tp} rank "
                         f"{shard.rank} needs {(shard.mla_fused_a_rows, cfg.hidden_size)}; "
                         "shard the weights for this rank")
    row_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if cache.dim() != 3 or cache.shape[2] != row_width or cache.dtype != BF16:
        raise ValueError(f"the MLA cache must be bf16 [num_blocks, block_size, {row_width}], found "
                         f"{cache.dtype} {tuple(cache.shape)}")
    for seg in segments:
        if seg.row0 < 0 or seg.n < 0 or seg.row0 + seg.n > u.shape[0] or seg.pos0 < 0:
            raise ValueError(f"request {seg.request}: rows [{seg.row0}, {seg.row0 + seg.n}) at "
                             f"position {seg.pos0} do not fit the step's {u.shape[0]} rows")


def mla_attention(w: MLAWeights, cfg: K3TextConfig, shard: ShardShapes, u: torch.Tensor,
                  segments: list[Segment], state: MLALayerState, coll: Collective,
                  *, naive_prefill: bool = True) -> torch.Tensor:
    """One MLA layer on u [N, H] bf16; writes the segments' latents into `state.cache`.

    Returns the all-reduced o_proj output [N, H] bf16. Prefill segments use the naive
    form (vLLM's prefill), decode (and verify) segments the absorbed one;
    `naive_prefill=False` runs prefill in the absorbed form too, so tests can separate
    state handling (exact) from the two forms' bf16 rounding differences.
    """
    _check_inputs(cfg, shard, w, u, segments, state.cache)
    n_rows, heads = u.shape[0], shard.mla_heads
    r_q, r_kv, d_r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d_n, d_v = cfg.qk_nope_head_dim, cfg.v_head_dim

    q_c, kv_c, k_pe, gate = linear(u, w.fused_a).split([r_q, r_kv, d_r, heads * d_v], dim=-1)
    q_c = rms_norm(q_c, w.q_a_norm, cfg.rms_norm_eps)
    latent = rms_norm(kv_c, w.kv_a_norm, cfg.rms_norm_eps)
    q = linear(q_c, w.q_b).view(n_rows, heads, d_n + d_r)
    w_uk, w_uv = split_kv_b(w.kv_b, cfg, heads)
    o = mla_core(q, torch.cat([latent, k_pe], dim=-1), segments, state.cache, w_uk, w_uv,
                 naive_prefill=naive_prefill)
    gated = (o.view(n_rows, heads * d_v).to(F32) * torch.sigmoid(gate.to(F32))).to(BF16)
    return coll.all_reduce(linear(gated, w.o_proj))


def mla_core(q: torch.Tensor, cache_rows: torch.Tensor, segments: list[Segment], cache: torch.Tensor,
             w_uk: torch.Tensor, w_uv: torch.Tensor, *, naive_prefill: bool = True) -> torch.Tensor:
    """The attention between the projections: writes cache_rows [N, r_kv + d_r] (the normed
    latent and k_pe of each new token) into the paged cache, then attends: q [N, h, d_n + d_r]
    -> o [N, h, d_v] bf16 (zero for rows outside every segment)."""
    n_rows, heads = q.shape[0], w_uk.shape[0]
    o = torch.zeros(n_rows, heads, w_uv.shape[1], dtype=BF16, device=q.device)
    for seg in segments:
        if seg.n == 0:
            continue
        rows = slice(seg.row0, seg.row0 + seg.n)
        new_pos = torch.arange(seg.pos0, seg.pos0 + seg.n, device=q.device)
        blocks, offsets = _cache_slots(seg, cache, new_pos)
        cache[blocks, offsets] = cache_rows[rows]
        blocks, offsets = _cache_slots(seg, cache, torch.arange(seg.pos0 + seg.n, device=q.device))
        kv = cache[blocks, offsets]
        attend = attend_naive if (seg.prefill and naive_prefill) else attend_absorbed
        o[rows] = attend(q[rows], kv, w_uk, w_uv)
    return o
