"""Router, latent MoE and dense MLP of the reference path against independent oracles.

The oracles here are written from K3_MATH.md §3.6/§3.7 alone: a per-row Python top-k for
the router, and an fp32 MoE that runs every expert densely under a one-hot weight mask.
TP checks slice TP1 weights the way the stock layout does (K3_MATH.md §5.1) and run the
ranks as threads.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank, ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.dense_mlp import dense_mlp
from vllm.models.kimi_k3.nvidia.reference.moe import moe, route
from vllm.models.kimi_k3.nvidia.tests._util import rand_norm, rand_w, rel_err
from vllm.models.kimi_k3.nvidia.reference.params import DenseMLPWeights, MoEWeights

BF16, F32 = torch.bfloat16, torch.float32
MINI = preset("mini")



def full_moe_weights(cfg, seed: int) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    e, h, lat, i, i_s = (cfg.num_experts, cfg.hidden_size, cfg.routed_expert_hidden_size,
                         cfg.moe_intermediate_size, cfg.shared_intermediate)
    return MoEWeights(
        router=rand_w(g, e, h), bias=0.05 * torch.randn(e, generator=g),
        latent_down=rand_w(g, lat, h), latent_norm=rand_norm(g, lat), latent_up=rand_w(g, h, lat),
        w13=rand_w(g, e, 2 * i, lat), w2=rand_w(g, e, lat, i),
        shared_gate_up=rand_w(g, 2 * i_s, h), shared_down=rand_w(g, h, i_s),
    )


def split_gate_up(gate_up: torch.Tensor, inter: int, tp: int, rank: int, padded: int) -> torch.Tensor:
    """Rank's rows of the gate half and of the up half, each zero-padded to `padded` rows."""
    per = inter // tp
    out = torch.zeros(*gate_up.shape[:-2], 2 * padded, gate_up.shape[-1], dtype=gate_up.dtype)
    out[..., :per, :] = gate_up[..., rank * per:(rank + 1) * per, :]
    out[..., padded:padded + per, :] = gate_up[..., inter + rank * per:inter + (rank + 1) * per, :]
    return out


def split_down(down: torch.Tensor, inter: int, tp: int, rank: int, padded: int) -> torch.Tensor:
    per = inter // tp
    out = torch.zeros(*down.shape[:-1], padded, dtype=down.dtype)
    out[..., :per] = down[..., rank * per:(rank + 1) * per]
    return out


def shard_moe(full: MoEWeights, cfg, tp: int, rank: int) -> MoEWeights:
    sh = cfg.shard(tp, rank)
    i, i_s = cfg.moe_intermediate_size, cfg.shared_intermediate
    return MoEWeights(
        router=full.router, bias=full.bias, latent_down=full.latent_down,
        latent_norm=full.latent_norm, latent_up=full.latent_up,
        w13=split_gate_up(full.w13, i, tp, rank, sh.moe_inter),
        w2=split_down(full.w2, i, tp, rank, sh.moe_inter),
        shared_gate_up=split_gate_up(full.shared_gate_up, i_s, tp, rank, i_s // tp),
        shared_down=split_down(full.shared_down, i_s, tp, rank, i_s // tp),
    )


def situ_f32(g: torch.Tensor, u: torch.Tensor, cfg) -> torch.Tensor:
    if cfg.hidden_act == "silu":
        return g * torch.sigmoid(g) * u
    b, lam = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    return b * torch.tanh(g / b) * torch.sigmoid(g) * lam * torch.tanh(u / lam)


def gated_f32(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, cfg) -> torch.Tensor:
    gu = x @ gate_up.float().T
    inter = down.shape[1]
    return situ_f32(gu[:, :inter], gu[:, inter:], cfg) @ down.float().T


def brute_moe(full: MoEWeights, cfg, v: torch.Tensor) -> torch.Tensor:
    """fp32 latent MoE: every expert on every row, weighted by a one-hot routing mask."""
    vf = v.float()
    s = torch.sigmoid(vf @ full.router.float().T)
    top = (s + full.bias).topk(cfg.num_experts_per_token, dim=-1).indices
    sel = s.gather(1, top)
    mask = torch.zeros_like(s).scatter(1, top, sel / sel.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    x = vf @ full.latent_down.float().T
    y = torch.zeros(v.shape[0], cfg.routed_expert_hidden_size)
    for e in range(cfg.num_experts):
        y += mask[:, e:e + 1] * gated_f32(full.w13[e], full.w2[e], x, cfg)
    if cfg.latent_moe_use_norm:
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * full.latent_norm.float()
    return y @ full.latent_up.float().T + gated_f32(full.shared_gate_up, full.shared_down, vf, cfg)


def rand_v(seed: int, n: int, cfg=MINI) -> torch.Tensor:
    return torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(BF16)


# ------------------------------------------------------------------------------ route


def test_ties_go_to_lower_index_in_key_order():
    cfg = MINI.replace(num_experts_per_token=3)
    logits = torch.tensor([[0.5] * 8,
                           [0.0, 1.0, 1.0, 2.0, 1.0, 0.0, 2.0, 0.0],
                           [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]], dtype=F32)
    _, ids = route(logits, torch.zeros(8), cfg)
    assert ids.tolist() == [[0, 1, 2], [3, 6, 1], [0, 7, 1]]


def test_nan_scores_rank_below_every_number():
    cfg = MINI.replace(num_experts_per_token=3)
    nan = float("nan")
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    best_two = logits[0].topk(2).indices
    logits[0, best_two] = nan  # NaN where the winners would have been
    logits[1] = torch.tensor([nan, nan, nan, 0.3, nan, nan, -30.0, nan])
    logits[2] = torch.tensor([0.0, nan, nan, 0.0, nan, nan, 0.0, nan])
    bias = torch.zeros(8)
    bias[3] = float("-inf")  # a −inf key still outranks NaN
    w, ids = route(logits, bias, cfg)
    assert not set(ids[0].tolist()) & (set(best_two.tolist()) | {3})
    assert not torch.isnan(w[0]).any()
    assert ids[1].tolist() == [6, 3, 0]  # the finite key, then −inf, then the lowest NaN
    assert ids[2].tolist() == [0, 6, 3]  # a tie between 0 and 6 goes to 0


def test_bias_moves_selection_but_not_weights():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 8, generator=g)
    weakest = logits.argmin(-1)
    bias = torch.zeros(16, 8).scatter(1, weakest[:, None], 5.0)
    for row in range(16):  # per-row bias: route one row at a time
        w, ids = route(logits[row:row + 1], bias[row], MINI)
        assert ids[0, 0].item() == weakest[row].item()
        s = torch.sigmoid(logits[row, ids[0]])
        torch.testing.assert_close(w[0], s / s.sum() * MINI.routed_scaling_factor, rtol=1e-6, atol=0)


def test_weights_sum_to_scaling_factor_or_stay_raw():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(32, 8, generator=g), 0.1 * torch.randn(8, generator=g)
    w, ids = route(logits, bias, MINI)
    torch.testing.assert_close(w.sum(-1), torch.full((32,), MINI.routed_scaling_factor), rtol=1e-6, atol=0)
    raw_w, raw_ids = route(logits, bias, MINI.replace(moe_renormalize=False))
    assert torch.equal(raw_ids, ids)
    torch.testing.assert_close(raw_w, torch.sigmoid(logits).gather(1, ids) * MINI.routed_scaling_factor)
    soft_cfg = MINI.replace(moe_router_activation_func="softmax")
    soft_w, soft_ids = route(logits, bias, soft_cfg)
    s = torch.softmax(logits, -1).gather(1, soft_ids)
    torch.testing.assert_close(soft_w, s / s.sum(-1, keepdim=True) * MINI.routed_scaling_factor)


def brute_grouped_topk(keys: np.ndarray, cfg) -> list[list[int]]:
    """Per-row Python grouped top-k: group score = sum of its two best keys (fp32 adds)."""
    n_grp, size = cfg.num_expert_group, cfg.num_experts // cfg.num_expert_group
    out = []
    for row in keys:
        scores = []
        for grp in range(n_grp):
            best = sorted(row[grp * size:(grp + 1) * size], reverse=True)[:2]
            scores.append((-(np.float32(best[0]) + np.float32(best[1])), grp))
        kept = {grp for _, grp in sorted(scores)[:cfg.topk_group]}
        cands = [(-row[e], e) for e in range(cfg.num_experts) if e // size in kept]
        out.append([e for _, e in sorted(cands)[:cfg.num_experts_per_token]])
    return out


def test_grouped_topk_matches_brute_force():
    cfg = MINI.replace(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(48, 16, generator=g)
    logits[24:] = torch.randint(-2, 3, (24, 16), generator=g).float()  # many exact ties
    bias = 0.1 * torch.randn(16, generator=g)
    bias[8:] = 0.0
    w, ids = route(logits, bias, cfg)
    keys = (torch.sigmoid(logits) + bias).numpy()
    assert ids.tolist() == brute_grouped_topk(keys, cfg)
    s = torch.sigmoid(logits).gather(1, ids)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    assert all(len({e // 4 for e in row}) <= cfg.topk_group for row in ids.tolist())


def test_route_rejects_bf16_logits():
    with pytest.raises(ValueError, match="fp32"):
        route(torch.randn(2, 8).to(BF16), torch.zeros(8), MINI)


# ------------------------------------------------------------------------------ moe

# moe() rounds x_lat, each expert's FC1/hidden/output, the combined latent, z and both
# branch outputs to bf16 (8 significant bits, ~2e-3 relative each); the oracle keeps fp32
# throughout; a few such roundings stacked give ~5e-3 relative error here.
MOE_TOL = 1.5e-2


def test_moe_matches_dense_fp32_brute_force():
    full = full_moe_weights(MINI, seed=10)
    v = rand_v(11, 24)
    out = moe(full, MINI, MINI.shard(1, 0), v, SingleRank())
    assert out.dtype == BF16 and out.shape == v.shape
    assert rel_err(out, brute_moe(full, MINI, v)) < MOE_TOL


def test_moe_rows_sharing_experts():
    full = full_moe_weights(MINI, seed=12)
    full.bias = torch.zeros(8)
    full.bias[[3, 5]] = 100.0  # every row picks experts 5 and 3 (bias decides, weights don't see it)
    v = rand_v(13, 9)
    _, ids = route(torch.randn(9, 8), full.bias, MINI)
    assert set(ids.flatten().tolist()) == {3, 5}
    out = moe(full, MINI, MINI.shard(1, 0), v, SingleRank())
    assert rel_err(out, brute_moe(full, MINI, v)) < MOE_TOL


@pytest.mark.parametrize("change", [{"hidden_act": "silu"}, {"latent_moe_use_norm": False}],
                         ids=["silu", "no-latent-norm"])
def test_moe_variants_match_brute_force(change):
    # without the latent norm the routing weights' scale (routed_scaling_factor) shows
    cfg = MINI.replace(**change)
    full = full_moe_weights(cfg, seed=14)
    v = rand_v(15, 8)
    assert rel_err(moe(full, cfg, cfg.shard(1, 0), v, SingleRank()), brute_moe(full, cfg, v)) < MOE_TOL


def run_moe_tp(full: MoEWeights, cfg, v: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return ThreadGroup.run(tp, lambda coll: moe(shard_moe(full, cfg, tp, coll.rank), cfg,
                                                cfg.shard(tp, coll.rank), v, coll))


# The TP partials are rounded to bf16 per rank before the ordered fp32 sum, TP1 rounds once.
TP_TOL = 1e-2


@pytest.mark.parametrize("cfg", [MINI, MINI.replace(min_moe_intermediate_per_partition=16)],
                         ids=["unpadded", "padded"])
def test_moe_tp4_equals_tp1(cfg):
    sh = cfg.shard(4, 0)
    if cfg.min_moe_intermediate_per_partition == 16:
        assert sh.moe_inter == 16 and sh.moe_inter_real == 8  # the padding path really runs
    full = full_moe_weights(cfg, seed=20)
    v = rand_v(21, 16, cfg)
    ref = moe(full, cfg, cfg.shard(1, 0), v, SingleRank())
    outs = run_moe_tp(full, cfg, v, 4)
    for out in outs:
        assert torch.equal(out, outs[0])  # replicated routing + ordered sums: ranks agree exactly
    assert rel_err(outs[0], ref) < TP_TOL


def test_moe_rejects_unpadded_expert_shard():
    cfg = MINI.replace(min_moe_intermediate_per_partition=16)
    full = full_moe_weights(cfg, seed=22)
    bad = shard_moe(full, MINI, 4, 0)  # sliced without padding
    with pytest.raises(ValueError, match="moe_inter=16"):
        moe(bad, cfg, cfg.shard(4, 0), rand_v(23, 2), SingleRank())


# ------------------------------------------------------------------------------ dense


def full_dense_weights(cfg, seed: int) -> DenseMLPWeights:
    g = torch.Generator().manual_seed(seed)
    i, h = cfg.intermediate_size, cfg.hidden_size
    return DenseMLPWeights(gate_up=rand_w(g, 2 * i, h), down=rand_w(g, h, i))


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_dense_mlp_matches_fp32_and_tp4_equals_tp1(act):
    cfg = MINI.replace(hidden_act=act)
    full = full_dense_weights(cfg, seed=30)
    v = rand_v(31, 12, cfg)
    ref = dense_mlp(full, cfg, v, SingleRank())
    assert rel_err(ref, gated_f32(full.gate_up, full.down, v.float(), cfg)) < 1e-2
    i = cfg.intermediate_size

    def rank_fn(coll):
        w = DenseMLPWeights(gate_up=split_gate_up(full.gate_up, i, 4, coll.rank, i // 4),
                            down=split_down(full.down, i, 4, coll.rank, i // 4))
        return dense_mlp(w, cfg, v, coll)

    outs = ThreadGroup.run(4, rank_fn)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert rel_err(outs[0], ref) < TP_TOL
