"""MLA layer of the reference path against oracles written here from K3_MATH.md §3.5.

Oracles: a float64 per-head MHA with materialized keys k_t = [W_UK c_t ; k_pe_t] and
values v_t = W_UV c_t (formula (6) read as plain attention), and a float64 whole-layer
forward. Paging, request isolation, incremental decode and TP are checked against the
layer itself run in a different but equivalent way (whole prefill, separate calls, TP1).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank, ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.mla import attend_absorbed, attend_naive, mla_attention, split_kv_b
from vllm.models.kimi_k3.nvidia.tests._util import rand_norm, rand_w, rel_err
from vllm.models.kimi_k3.nvidia.reference.params import MLAWeights
from vllm.models.kimi_k3.nvidia.reference.state import MLALayerState, Segment

BF16, F64 = torch.bfloat16, torch.float64
CFG = preset("mini")
R_Q, R_KV, D_R = CFG.q_lora_rank, CFG.kv_lora_rank, CFG.qk_rope_head_dim
D_N, D_V, HEADS = CFG.qk_nope_head_dim, CFG.v_head_dim, CFG.num_attention_heads
ROW = R_KV + D_R
BLOCK = 4



def full_mla_weights(seed: int) -> MLAWeights:
    g = torch.Generator().manual_seed(seed)
    h = CFG.hidden_size
    return MLAWeights(
        fused_a=rand_w(g, R_Q + R_KV + D_R + HEADS * D_V, h),
        q_a_norm=rand_norm(g, R_Q), kv_a_norm=rand_norm(g, R_KV),
        q_b=rand_w(g, HEADS * (D_N + D_R), R_Q), kv_b=rand_w(g, HEADS * (D_N + D_V), R_KV),
        o_proj=rand_w(g, h, HEADS * D_V),
    )


def shard_mla(full: MLAWeights, tp: int, rank: int) -> MLAWeights:
    """Stock layout: latent rows replicated, g / q_b / kv_b rows and o_proj columns by head."""
    nh = HEADS // tp
    latent_rows = R_Q + R_KV + D_R
    g_rows = full.fused_a[latent_rows + rank * nh * D_V:latent_rows + (rank + 1) * nh * D_V]
    qb, kvb = D_N + D_R, D_N + D_V
    return MLAWeights(
        fused_a=torch.cat([full.fused_a[:latent_rows], g_rows]),
        q_a_norm=full.q_a_norm, kv_a_norm=full.kv_a_norm,
        q_b=full.q_b[rank * nh * qb:(rank + 1) * nh * qb],
        kv_b=full.kv_b[rank * nh * kvb:(rank + 1) * nh * kvb],
        o_proj=full.o_proj[:, rank * nh * D_V:(rank + 1) * nh * D_V],
    )


def segment(request: int, row0: int, n: int, pos0: int, blocks: list[int], prefill: bool) -> Segment:
    return Segment(request=request, row0=row0, n=n, prefill=prefill, pos0=pos0, rec_slots=[],
                   rec_read_slot=0, conv_slot=0, accepted=1,
                   block_table=torch.tensor(blocks, dtype=torch.int32))


def sentinel_state(seed: int, num_blocks: int = 16) -> MLALayerState:
    g = torch.Generator().manual_seed(seed)
    return MLALayerState(cache=torch.randn(num_blocks, BLOCK, ROW, generator=g).to(BF16))


def rand_u(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(BF16)


def brute_mha(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """float64 per-head causal MHA; the n queries are the last n of the L cached positions."""
    n, heads, _ = q.shape
    length = kv.shape[0]
    c, k_pe = kv[:, :R_KV].to(F64), kv[:, R_KV:].to(F64)
    out = torch.empty(n, heads, w_uv.shape[1], dtype=F64)
    for h in range(heads):
        keys = torch.cat([c @ w_uk[h].to(F64).T, k_pe], dim=1)
        values = c @ w_uv[h].to(F64).T
        for j in range(n):
            visible = length - n + j + 1
            p = torch.softmax(keys[:visible] @ q[j, h].to(F64) / math.sqrt(q.shape[-1]), dim=0)
            out[j, h] = p @ values[:visible]
    return out


def brute_layer(w: MLAWeights, u: torch.Tensor) -> torch.Tensor:
    """float64 MLA layer for one request prefilled from position 0 (TP1)."""
    eps = CFG.rms_norm_eps
    a = u.to(F64) @ w.fused_a.to(F64).T
    q_c, kv_c, k_pe, g = a.split([R_Q, R_KV, D_R, HEADS * D_V], dim=1)
    q_c = q_c / torch.sqrt(q_c.pow(2).mean(1, keepdim=True) + eps) * w.q_a_norm.to(F64)
    c = kv_c / torch.sqrt(kv_c.pow(2).mean(1, keepdim=True) + eps) * w.kv_a_norm.to(F64)
    q = (q_c @ w.q_b.to(F64).T).view(-1, HEADS, D_N + D_R)
    kv_b = w.kv_b.to(F64).view(HEADS, D_N + D_V, R_KV)
    o = brute_mha(q, torch.cat([c, k_pe], dim=1), kv_b[:, :D_N], kv_b[:, D_N:])
    return (o.reshape(u.shape[0], -1) * torch.sigmoid(g)) @ w.o_proj.to(F64).T


# The two forms round different intermediates to bf16 (absorbed: ql and the latent output;
# naive: the materialized k_nope and v), each ~2^-9 relative; through the softmax and the
# sums that stays well below 1e-2 relative (measured 2e-3 .. 4.5e-3, whole layer included).
CORE_TOL = 1e-2


@pytest.mark.parametrize("length, n", [(1, 1), (5, 1), (5, 4), (2 * BLOCK + 3, 4), (40, 1), (40, 4)])
def test_absorbed_naive_and_brute_force_agree(length, n):
    g = torch.Generator().manual_seed(100 * length + n)
    q = (2 * torch.randn(n, HEADS, D_N + D_R, generator=g)).to(BF16)  # peaky softmax
    kv = torch.randn(length, ROW, generator=g).to(BF16)
    w_uk, w_uv = rand_w(g, HEADS, D_N, R_KV), rand_w(g, HEADS, D_V, R_KV)
    ref = brute_mha(q, kv, w_uk, w_uv)
    absorbed, naive = attend_absorbed(q, kv, w_uk, w_uv), attend_naive(q, kv, w_uk, w_uv)
    assert absorbed.dtype == naive.dtype == BF16 and absorbed.shape == (n, HEADS, D_V)
    assert rel_err(absorbed, ref) < CORE_TOL
    assert rel_err(naive, ref) < CORE_TOL
    assert rel_err(absorbed, naive) < CORE_TOL


def test_verify_rows_are_causal_among_themselves():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(4, HEADS, D_N + D_R, generator=g).to(BF16)
    kv = torch.randn(9, ROW, generator=g).to(BF16)
    w_uk, w_uv = rand_w(g, HEADS, D_N, R_KV), rand_w(g, HEADS, D_V, R_KV)
    out = attend_absorbed(q, kv, w_uk, w_uv)
    for j in range(4):  # row j of the draft equals a single query at position 5 + j
        single = attend_absorbed(q[j:j + 1], kv[:6 + j], w_uk, w_uv)
        assert rel_err(out[j], single[0]) < 1e-6


def test_layer_matches_float64_oracle_in_both_forms():
    w = full_mla_weights(1)
    u = rand_u(2, 11)
    ref = brute_layer(w, u)
    prefill = mla_attention(w, CFG, CFG.shard(1, 0), u, [segment(0, 0, 11, 0, [1, 2, 3], True)],
                            sentinel_state(3), SingleRank())
    # the same tokens as one verify-style decode segment exercise the absorbed form
    decode = mla_attention(w, CFG, CFG.shard(1, 0), u, [segment(0, 0, 11, 0, [1, 2, 3], False)],
                           sentinel_state(3), SingleRank())
    assert prefill.dtype == BF16 and prefill.shape == u.shape
    assert rel_err(prefill, ref) < CORE_TOL
    assert rel_err(decode, ref) < CORE_TOL


def test_cache_rows_land_in_the_block_table_blocks():
    w = full_mla_weights(4)
    u = rand_u(5, 10)
    state = sentinel_state(6)
    before = state.cache.clone()
    table = [5, 2, 7, 9]
    mla_attention(w, CFG, CFG.shard(1, 0), u, [segment(0, 0, 10, 0, table, True)], state, SingleRank())
    kv_c = (u.to(F64) @ w.fused_a[R_Q:R_Q + R_KV].to(F64).T).to(BF16).to(F64)
    c = kv_c / torch.sqrt(kv_c.pow(2).mean(1, keepdim=True) + CFG.rms_norm_eps) * w.kv_a_norm.to(F64)
    k_pe = u.to(F64) @ w.fused_a[R_Q + R_KV:R_Q + R_KV + D_R].to(F64).T
    expected = torch.cat([c, k_pe], dim=1).to(BF16)
    written = torch.zeros(state.cache.shape[:2], dtype=torch.bool)
    for p in range(10):
        block, off = table[p // BLOCK], p % BLOCK
        torch.testing.assert_close(state.cache[block, off], expected[p])
        written[block, off] = True
    assert torch.equal(state.cache[~written], before[~written])  # nothing else touched


def test_two_requests_in_one_call_equal_separate_calls():
    w = full_mla_weights(8)
    shard = CFG.shard(1, 0)
    table_a, table_b, table_c = [1, 2, 3, 4, 5], [6, 7, 8], [9, 10]
    state = sentinel_state(9)
    # build contexts of 17 (A) and 6 (B) tokens
    mla_attention(w, CFG, shard, rand_u(10, 17), [segment(0, 0, 17, 0, table_a, True)], state, SingleRank())
    mla_attention(w, CFG, shard, rand_u(11, 6), [segment(1, 0, 6, 0, table_b, True)], state, SingleRank())
    u = rand_u(12, 1 + 4 + 5)
    mixed = [segment(0, 0, 1, 17, table_a, False),  # plain decode
             segment(1, 1, 4, 6, table_b, False),  # verify of 4 tokens
             segment(2, 5, 5, 0, table_c, True)]  # a fresh prefill
    together_state = MLALayerState(cache=state.cache.clone())
    together = mla_attention(w, CFG, shard, u, mixed, together_state, SingleRank())
    apart_state = MLALayerState(cache=state.cache.clone())
    for seg in mixed:
        rows = slice(seg.row0, seg.row0 + seg.n)
        alone = segment(seg.request, 0, seg.n, seg.pos0, seg.block_table.tolist(), seg.prefill)
        out = mla_attention(w, CFG, shard, u[rows], [alone], apart_state, SingleRank())
        torch.testing.assert_close(together[rows], out, rtol=0, atol=0)
    torch.testing.assert_close(together_state.cache, apart_state.cache, rtol=0, atol=0)


def test_prefill_then_decode_and_verify_equals_one_prefill():
    w = full_mla_weights(13)
    shard = CFG.shard(1, 0)
    table = [3, 1, 4, 6]
    u = rand_u(14, 13)
    whole_state = sentinel_state(15)
    whole = mla_attention(w, CFG, shard, u, [segment(0, 0, 13, 0, table, True)], whole_state, SingleRank())
    state = sentinel_state(15)
    steps = [(0, 5, True), (5, 1, False), (6, 1, False), (7, 1, False), (8, 4, False), (12, 1, False)]
    for pos0, n, prefill in steps:
        rows = slice(pos0, pos0 + n)
        out = mla_attention(w, CFG, shard, u[rows], [segment(0, 0, n, pos0, table, prefill)], state,
                            SingleRank())
        assert rel_err(out, whole[rows]) < CORE_TOL, (pos0, n)
    torch.testing.assert_close(state.cache, whole_state.cache, rtol=0, atol=0)


def test_tp4_equals_tp1():
    full = full_mla_weights(16)
    u = rand_u(17, 9)
    segs = [segment(0, 0, 6, 0, [1, 2], True), segment(1, 6, 3, 0, [3], False)]
    tp1_state = sentinel_state(18)
    ref = mla_attention(full, CFG, CFG.shard(1, 0), u, segs, tp1_state, SingleRank())
    states = [sentinel_state(18) for _ in range(4)]  # the latent cache is replicated per rank

    def rank_fn(coll):
        r = coll.rank
        return mla_attention(shard_mla(full, 4, r), CFG, CFG.shard(4, r), u, segs, states[r], coll)

    outs = ThreadGroup.run(4, rank_fn)
    assert all(torch.equal(o, outs[0]) for o in outs)
    # per-rank bf16 o_proj partials summed in fp32 vs one rounding at TP1
    assert rel_err(outs[0], ref) < 1e-2
    for st in states:
        torch.testing.assert_close(st.cache, tp1_state.cache)


def test_split_kv_b_takes_nope_rows_then_value_rows_per_head():
    kv_b = torch.arange(HEADS * (D_N + D_V) * R_KV, dtype=torch.float32).view(-1, R_KV)
    w_uk, w_uv = split_kv_b(kv_b, CFG, HEADS)
    h = HEADS - 1
    assert torch.equal(w_uk[h], kv_b[h * (D_N + D_V):h * (D_N + D_V) + D_N])
    assert torch.equal(w_uv[h], kv_b[h * (D_N + D_V) + D_N:(h + 1) * (D_N + D_V)])


def test_bad_inputs_are_rejected_with_the_fix():
    w = full_mla_weights(19)
    with pytest.raises(ValueError, match="hidden_size"):
        mla_attention(w, CFG, CFG.shard(1, 0), rand_u(20, 3)[:, :-1], [], sentinel_state(21), SingleRank())
    with pytest.raises(ValueError, match="longer block table"):
        mla_attention(w, CFG, CFG.shard(1, 0), rand_u(20, 6), [segment(0, 0, 6, 0, [1], True)],
                      sentinel_state(21), SingleRank())
    with pytest.raises(ValueError, match="shard the weights"):
        mla_attention(w, CFG, CFG.shard(4, 0), rand_u(20, 2), [segment(0, 0, 2, 0, [1], True)],
                      sentinel_state(21), SingleRank())
