"""Checks of the reference KDA layer (reference/kda.py) against independent oracles.

Core rule: the chunked form against the token recurrence, both against a dense
closed-form oracle in float64, and against flash-linear-attention's naive KDA when it
is installed. Layer: an oracle built from torch's own conv1d / rms_norm; prefill vs
decode; verify vs single steps and exact rollback; batching; TP4 vs TP1; null slots.

Where the same token recurrence runs on the same rows (verify vs single steps, rollback,
batching, null rows) results must be bit-identical: on CPU the layer's GEMMs and pointwise
math are evaluated in fp64, so no row depends on how many rows share the step. Where two
algorithms meet (chunked prefill vs recurrent decode, TP4 vs TP1) the bound is stated.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank, ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.kda import (
    decay_log_alpha,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    kda_attention,
)
from vllm.models.kimi_k3.nvidia.reference.params import KDAWeights
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState, Segment

CFG = preset("mini")
LAYER = 0  # layer 0 is KDA in the mini preset


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def core_inputs(gen, t, h, d, lo, hi):
    q = unit(torch.randn(t, h, d, generator=gen)) * d ** -0.5
    k = unit(torch.randn(t, h, d, generator=gen))
    v = torch.randn(t, h, d, generator=gen)
    log_alpha = lo + (hi - lo) * torch.rand(t, h, d, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    state = torch.randn(h, d, d, generator=gen)
    return q, k, v, log_alpha, beta, state


def closed_form(q, k, v, log_alpha, beta, state):
    """S_t = S_{t-1}·diag(α_t)·(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ with dense float64 matrices."""
    q, k, v, alpha, beta = (x.double() for x in (q, k, v, log_alpha.exp(), beta))
    s = state.double().clone()
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    o = torch.empty_like(v)
    for t in range(q.shape[0]):
        for hd in range(q.shape[1]):
            kt, b = k[t, hd][:, None], beta[t, hd]
            s[hd] = s[hd] @ torch.diag(alpha[t, hd]) @ (eye - b * kt @ kt.T) + b * v[t, hd][:, None] @ kt.T
            o[t, hd] = s[hd] @ q[t, hd]
    return o, s


# ---------------------------------------------------------------------- weights and state


def make_weights(cfg, gen) -> KDAWeights:
    """TP1 weights at realistic scale (std 1/sqrt(fan_in)); the pad rows of in_proj stay zero."""
    sh = cfg.shard(1, 0)
    hidden, h, d, p = cfg.hidden_size, sh.kda_heads, cfg.kda_head_dim, sh.kda_proj
    in_proj = torch.zeros(sh.kda_in_rows, hidden)
    used = 4 * p + d + h
    in_proj[:used] = torch.randn(used, hidden, generator=gen) * hidden ** -0.5
    return KDAWeights(
        in_proj=in_proj.to(torch.bfloat16),
        f_b=(torch.randn(p, d, generator=gen) * d ** -0.5).to(torch.bfloat16),
        conv=torch.randn(3 * p, 4, generator=gen) * 0.5,
        A_log=torch.log(1 + 15 * torch.rand(h, generator=gen)),
        dt_bias=torch.randn(p, generator=gen) * 0.5,
        o_norm=(1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16),
        o_proj=(torch.randn(hidden, p, generator=gen) * p ** -0.5).to(torch.bfloat16),
    )


def shard_weights(w: KDAWeights, cfg, tp: int, rank: int) -> KDAWeights:
    """vLLM's stock TP layout: heads split, f_a replicated, in_proj re-laid per rank."""
    full, sh = cfg.shard(1, 0), cfg.shard(tp, rank)
    big_p, p, d = full.kda_proj, sh.kda_proj, cfg.kda_head_dim
    chans = slice(rank * p, (rank + 1) * p)
    heads = slice(rank * sh.kda_heads, (rank + 1) * sh.kda_heads)
    blocks = [w.in_proj[i * big_p:(i + 1) * big_p][chans] for i in range(4)]
    blocks.append(w.in_proj[4 * big_p:4 * big_p + d])
    blocks.append(w.in_proj[4 * big_p + d:4 * big_p + d + full.kda_heads][heads])
    rows = torch.cat(blocks)
    pad = torch.zeros(sh.kda_in_rows - rows.shape[0], rows.shape[1], dtype=rows.dtype)
    return KDAWeights(
        in_proj=torch.cat([rows, pad]),
        f_b=w.f_b[chans].clone(),
        conv=torch.cat([w.conv[i * big_p:(i + 1) * big_p][chans] for i in range(3)]),
        A_log=w.A_log[heads].clone(),
        dt_bias=w.dt_bias[chans].clone(),
        o_norm=w.o_norm.clone(),
        o_proj=w.o_proj[:, chans].clone(),
    )


def new_state(cfg=CFG, shard=None) -> DecodeState:
    return DecodeState(cfg, shard or cfg.shard(1, 0), max_requests=2, max_len=64, max_q=4)


def run_step(w, st: DecodeState, u, plan, cfg=CFG, coll=None):
    """plan: [(request, n, prefill)], rows laid out in that order; commits every segment."""
    segs, row = [], 0
    for r, n, prefill in plan:
        segs.append(st.segment(r, row, n, prefill))
        row += n
    out = kda_attention(w, cfg, st.shard, u, segs, st.kda[LAYER], coll or SingleRank())
    for seg in segs:
        st.commit(seg)
    return out


def tokens(gen, n, cfg=CFG):
    return torch.randn(n, cfg.hidden_size, generator=gen).to(torch.bfloat16)


# ---------------------------------------------------------------------- 1-3: the core rule

DECAYS = {"near_lower_bound": (-5.0, -4.9), "near_one": (-1e-3, 0.0), "mixed": (-5.0, 0.0)}


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("t,chunk", [(1, 16), (5, 16), (16, 16), (37, 16), (67, 16), (37, 8), (40, 64)])
def test_chunked_matches_recurrent(decay, t, chunk):
    gen = torch.Generator().manual_seed(1000 + t + chunk)
    args = core_inputs(gen, t, 3, 32, *DECAYS[decay])
    o_rec, s_rec = gated_delta_rule_recurrent(*args)
    o_chk, s_chk = gated_delta_rule_chunked(*args, chunk=chunk)
    assert rel(o_chk, o_rec) < 1e-5
    assert rel(s_chk, s_rec) < 1e-5


@pytest.mark.parametrize("decay", DECAYS)
def test_core_matches_dense_closed_form(decay):
    gen = torch.Generator().manual_seed(7)
    args = core_inputs(gen, 11, 2, 8, *DECAYS[decay])
    o_ref, s_ref = closed_form(*args)
    for o, s in (gated_delta_rule_recurrent(*args), gated_delta_rule_chunked(*args, chunk=4)):
        assert rel(o, o_ref) < 1e-5
        assert rel(s, s_ref) < 1e-5
    # the state really moved: the oracle is not trivially the initial state
    assert rel(s_ref, args[-1].double()) > 0.1


def test_core_and_gates_match_flash_linear_attention():
    naive = pytest.importorskip(
        "fla.ops.kda.naive",
        reason="flash-linear-attention (pip install fla-core einops triton) is the outside "
               "KDA oracle; it is optional and not installed here")
    gates = pytest.importorskip("fla.ops.kda.gate", reason="fla's gate module needs triton to import")
    gen = torch.Generator().manual_seed(11)
    t, h, d = 23, 3, 32
    q, k, v, log_alpha, beta, state = core_inputs(gen, t, h, d, -5.0, 0.0)
    o, s = gated_delta_rule_recurrent(q, k, v, log_alpha, beta, state)
    # fla: batch-first, key-major state [B, H, K, V], q scaled inside by `scale`
    o_fla, s_fla = naive.naive_recurrent_kda(
        (q * math.sqrt(d))[None], k[None], v[None], log_alpha[None], beta[None],
        scale=d ** -0.5, initial_state=state.transpose(1, 2)[None].clone(), output_final_state=True)
    assert rel(o, o_fla[0]) < 1e-5
    assert rel(s, s_fla[0].transpose(1, 2)) < 1e-5

    g_raw = torch.randn(9, h, d, generator=gen).to(torch.bfloat16)
    a_log = torch.log(1 + 15 * torch.rand(h, generator=gen))
    dt_bias = torch.randn(h * d, generator=gen)
    for lb in (-5.0, -0.5):
        ours = decay_log_alpha(g_raw, a_log, dt_bias, lb)
        theirs = gates.naive_kda_lowerbound_gate(g_raw, a_log, dt_bias, lower_bound=lb)
        assert rel(ours, theirs) < 1e-6
    big = g_raw.float() * 30  # crosses the softplus threshold of 20
    ours = decay_log_alpha(big, a_log, dt_bias, None)
    assert rel(ours, gates.naive_kda_gate(big, a_log, dt_bias)) < 1e-6


# ---------------------------------------------------------------------- the layer


def layer_oracle(w: KDAWeights, cfg, u: torch.Tensor) -> torch.Tensor:
    """A fresh request's prefill rebuilt from torch's conv1d / rms_norm and the dense oracle."""
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    p, n = h * d, u.shape[0]
    z = (u.double() @ w.in_proj.double().T).to(torch.bfloat16).float()
    q_raw, k_raw, v_raw, g_out = (z[:, i * p:(i + 1) * p] for i in range(4))
    f_a = z[:, 4 * p:4 * p + d].to(torch.bfloat16)
    beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h])
    g_raw = (f_a.double() @ w.f_b.double().T).to(torch.bfloat16).float().view(n, h, d)
    zg = g_raw + w.dt_bias.view(h, d)
    a = w.A_log.exp().view(h, 1)
    if cfg.gate_lower_bound is None:
        log_alpha = -a * torch.where(zg > 20, zg, torch.log1p(torch.exp(zg)))
    else:
        log_alpha = cfg.gate_lower_bound / (1 + torch.exp(-a * zg))
    x = torch.cat([q_raw, k_raw, v_raw], 1)
    conv = F.conv1d(x.T[None], w.conv[:, None, :], padding=3, groups=3 * p)[0, :, :n].T
    y = F.silu(conv).to(torch.bfloat16).float().view(n, 3, h, d)
    qn = y[:, 0] / torch.sqrt(y[:, 0].pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(d)
    kn = y[:, 1] / torch.sqrt(y[:, 1].pow(2).sum(-1, keepdim=True) + 1e-6)
    o, _ = closed_form(qn, kn, y[:, 2], log_alpha, beta, torch.zeros(h, d, d))
    o = o.float().to(torch.bfloat16).float()
    normed = F.rms_norm(o, (d,), w.o_norm.float(), eps=1e-5) * torch.sigmoid(g_out.view(n, h, d))
    return (normed.to(torch.bfloat16).double().reshape(n, p) @ w.o_proj.double().T).to(torch.bfloat16)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_matches_independent_oracle(lower_bound):
    cfg = CFG.replace(gate_lower_bound=lower_bound)
    gen = torch.Generator().manual_seed(21)
    w = make_weights(cfg, gen)
    u = tokens(gen, 13, cfg)
    st = new_state(cfg)
    r = st.allocate()
    out = run_step(w, st, u, [(r, 13, True)], cfg)
    ref = layer_oracle(w, cfg, u)
    assert out.dtype == torch.bfloat16 and out.shape == (13, cfg.hidden_size)
    assert rel(out, ref) < 5e-3  # same rounding points; only bf16 ties of fp32-close values differ


@pytest.mark.parametrize("split", [[(10, True)] + [(1, False)] * 14,
                                   [(5, True), (13, True)] + [(1, False)] * 6])
def test_prefill_then_decode_equals_whole_prefill(split):
    gen = torch.Generator().manual_seed(31)
    w = make_weights(CFG, gen)
    u = tokens(gen, 24)
    whole = new_state()
    r = whole.allocate()
    out_whole = run_step(w, whole, u, [(r, 24, True)])

    parts = new_state()
    r2 = parts.allocate()
    outs, row = [], 0
    for n, prefill in split:
        outs.append(run_step(w, parts, u[row:row + n], [(r2, n, prefill)]))
        row += n
    assert rel(torch.cat(outs), out_whole) < 2e-3  # bf16 outputs of fp32-close cores
    s_whole = whole.kda[LAYER].rec[whole.rec_slot(r, 0)]
    s_parts = parts.kda[LAYER].rec[parts.rec_slot(r2, 0)]
    assert rel(s_parts, s_whole) < 1e-5
    c_whole = whole.kda[LAYER].conv[whole.conv_slot(r), 0:3]
    assert torch.equal(parts.kda[LAYER].conv[parts.conv_slot(r2), 0:3], c_whole)
    # the conv window holds the last three raw q|k|v inputs
    last_x = (u[-3:].double() @ w.in_proj.double().T).to(torch.bfloat16)[:, :3 * CFG.kda_proj]
    assert torch.equal(c_whole, last_x)


def prefilled(w, gen, prompt=9):
    """A state with one request that has prefilled `prompt` tokens drawn from gen."""
    st = new_state()
    r = st.allocate()
    run_step(w, st, tokens(gen, prompt), [(r, prompt, True)])
    return st, r


def test_verify_step_equals_single_steps_and_rolls_back_exactly():
    gen = torch.Generator().manual_seed(41)
    w = make_weights(CFG, gen)
    drafts, extra = tokens(gen, 4), tokens(gen, 1)

    single, r = prefilled(w, torch.Generator().manual_seed(5))
    single_outs, single_states = [], []
    for t in range(4):
        single_outs.append(run_step(w, single, drafts[t:t + 1], [(r, 1, False)]))
        single_states.append(single.kda[LAYER].rec[single.rec_slot(r, 0)].clone())

    verify, rv = prefilled(w, torch.Generator().manual_seed(5))
    out = run_step(w, verify, drafts, [(rv, 4, False)])
    assert torch.equal(out, torch.cat(single_outs))
    for t in range(4):
        assert torch.equal(verify.kda[LAYER].rec[verify.rec_slot(rv, t)], single_states[t])

    for k in range(1, 5):
        # verify 4 drafts, keep k, decode one more token ...
        rolled, rr = prefilled(w, torch.Generator().manual_seed(5))
        run_step(w, rolled, drafts, [(rr, 4, False)])
        rolled.accept(rr, k)
        out_rolled = run_step(w, rolled, extra, [(rr, 1, False)])
        # ... equals decoding only the k kept drafts, then that token
        kept, rk = prefilled(w, torch.Generator().manual_seed(5))
        for t in range(k):
            run_step(w, kept, drafts[t:t + 1], [(rk, 1, False)])
        out_kept = run_step(w, kept, extra, [(rk, 1, False)])
        assert torch.equal(out_rolled, out_kept)
        st_r, st_k = rolled.kda[LAYER], kept.kda[LAYER]
        assert torch.equal(st_r.rec[rolled.rec_slot(rr, 0)], st_k.rec[kept.rec_slot(rk, 0)])
        assert torch.equal(st_r.conv[rolled.conv_slot(rr), 0:3], st_k.conv[kept.conv_slot(rk), 0:3])
        assert rolled.seq_lens[rr] == kept.seq_lens[rk] == 9 + k + 1


def test_two_requests_in_one_call_equal_separate_calls():
    gen = torch.Generator().manual_seed(51)
    w = make_weights(CFG, gen)
    steps = [  # (request, tokens, prefill) per step; both requests share every call
        [(0, 9, True), (1, 5, True)],
        [(0, 1, False), (1, 3, False)],
        [(1, 2, False), (0, 6, True)],
    ]
    inputs = [tokens(gen, sum(n for _, n, _ in step)) for step in steps]
    together, apart = new_state(), new_state()
    for st in (together, apart):
        st.allocate(), st.allocate()
    for step, u in zip(steps, inputs):
        out_together = run_step(w, together, u, step)
        row = 0
        for r, n, prefill in step:
            out_apart = run_step(w, apart, u[row:row + n], [(r, n, prefill)])
            assert torch.equal(out_together[row:row + n], out_apart)
            row += n
        if step[1] == (1, 3, False):
            together.accept(1, 2), apart.accept(1, 2)
    assert torch.equal(together.kda[LAYER].rec, apart.kda[LAYER].rec)
    assert torch.equal(together.kda[LAYER].conv, apart.kda[LAYER].conv)


def test_tensor_parallel_sum_equals_tp1():
    tp = 4
    gen = torch.Generator().manual_seed(61)
    w1 = make_weights(CFG, gen)
    prompt, drafts = tokens(gen, 10), tokens(gen, 3)

    def run(w, coll, shard):
        st = new_state(CFG, shard)
        r = st.allocate()
        outs = [run_step(w, st, prompt, [(r, 10, True)], coll=coll),
                run_step(w, st, drafts, [(r, 3, False)], coll=coll)]
        return torch.cat(outs), st.kda[LAYER].rec[st.rec_slot(r, 0):st.rec_slot(r, 3)]

    out_tp1, rec_tp1 = run(w1, SingleRank(), CFG.shard(1, 0))
    results = ThreadGroup.run(
        tp, lambda coll: run(shard_weights(w1, CFG, tp, coll.rank), coll, CFG.shard(tp, coll.rank)))
    hr = CFG.shard(tp, 0).kda_heads
    for rank, (out, rec) in enumerate(results):
        assert torch.equal(out, results[0][0])  # every rank holds the same all-reduced sum
        assert rel(rec, rec_tp1[:, rank * hr:(rank + 1) * hr]) < 1e-5
    # 4 bf16-rounded partials summed in fp32 vs one fp32 GEMM: a few bf16 ulps (2^-8) apart
    assert rel(results[0][0], out_tp1) < 1e-2


def test_null_slots_output_zeros_and_write_nothing():
    gen = torch.Generator().manual_seed(71)
    w = make_weights(CFG, gen)
    st, r = prefilled(w, gen)
    kda = st.kda[LAYER]
    # poison the null slot: a read of it would show in the output
    kda.rec[0] = torch.randn(kda.rec.shape[1:], generator=gen)
    kda.conv[0] = torch.randn(kda.conv.shape[1:], generator=gen).to(torch.bfloat16)
    rec_before, conv_before = kda.rec.clone(), kda.conv.clone()
    u = tokens(gen, 5)
    null_decode = Segment(request=1, row0=0, n=3, prefill=False, pos0=0, rec_slots=[0, 0, 0],
                          rec_read_slot=0, conv_slot=0, accepted=1, block_table=st.block_table[1])
    null_prefill = Segment(request=1, row0=3, n=2, prefill=True, pos0=0, rec_slots=[0],
                           rec_read_slot=0, conv_slot=0, accepted=1, block_table=st.block_table[1])
    out = kda_attention(w, CFG, st.shard, u, [null_decode, null_prefill], kda, SingleRank())
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(kda.rec, rec_before) and torch.equal(kda.conv, conv_before)

    # next to a real segment the null rows stay zero and the real rows are unaffected
    mixed = kda_attention(w, CFG, st.shard, u[:4], [null_decode, st.segment(r, 3, 1, False)],
                          kda, SingleRank())
    assert torch.equal(mixed[:3], torch.zeros_like(mixed[:3]))
    kda.rec.copy_(rec_before), kda.conv.copy_(conv_before)
    alone = kda_attention(w, CFG, st.shard, u[3:4], [st.segment(r, 0, 1, False)], kda, SingleRank())
    assert torch.equal(mixed[3:], alone) and alone.abs().sum() > 0


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(81)
    w = make_weights(CFG, gen)
    st = new_state()
    r = st.allocate()
    kda, shard = st.kda[LAYER], st.shard
    seg = st.segment(r, 0, 2, True)
    with pytest.raises(ValueError, match=r"u has shape .* expected \[N, 128\]"):
        kda_attention(w, CFG, shard, tokens(gen, 2)[:, :64], [seg], kda, SingleRank())
    with pytest.raises(ValueError, match="bf16"):
        kda_attention(w, CFG, shard, tokens(gen, 2).float(), [seg], kda, SingleRank())
    with pytest.raises(ValueError, match="weight in_proj has shape"):
        kda_attention(shard_weights(w, CFG, 2, 0), CFG, shard, tokens(gen, 2), [seg], kda, SingleRank())
    too_many = Segment(request=r, row0=0, n=5, prefill=False, pos0=0, rec_slots=[1, 2, 3, 4, 5],
                       rec_read_slot=1, conv_slot=1, accepted=1, block_table=st.block_table[r])
    with pytest.raises(ValueError, match="exceed max_q = 4"):
        kda_attention(w, CFG, shard, tokens(gen, 5), [too_many], kda, SingleRank())
    with pytest.raises(ValueError, match="rows 0..9 are not"):
        kda_attention(w, CFG, shard, tokens(gen, 2), [st.segment(r, 0, 10, True)], kda, SingleRank())
    with pytest.raises(ValueError, match="state value-major"):
        gated_delta_rule_chunked(*core_inputs(gen, 4, 2, 8, -1.0, 0.0)[:5], torch.zeros(2, 8, 4))
