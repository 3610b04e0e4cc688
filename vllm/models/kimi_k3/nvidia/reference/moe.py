"""Latent MoE layer of the reference path, one TP rank (K3_MATH.md §3.6, §5.1, §8).

    ℓ = v · W_gᵀ (fp32 out);  s = σ(ℓ) (or softmax);  s' = s + bias     (selection keys)
    Top = grouped top-k of s';  w_j = s_Top_j / (Σ s_Top + 1e-20) · routed_scaling_factor
    x_lat = v · W_downᵀ
    y_e   = SiTU(x_lat · W13_eᵀ) · W2_eᵀ                  (each selected expert, bf16 rows)
    y     = all_reduce( bf16(Σ_j w_j · y_Top_j) )          (fp32 accumulation in selection order)
    routed = RMSNorm(y, γ_lat) · W_upᵀ                     (norm only if latent_moe_use_norm)
    shared = all_reduce( SiTU(v · W_sguᵀ) · W_sdᵀ )
    m      = bf16(routed + shared)

Stock off-SM100 TP layout: router, bias, latent down, latent norm and latent up are
replicated (every rank routes identically and multiplies the full up-projection after the
latent sum); routed and shared experts split the intermediate dimension, routed slices
zero-padded to `shard.moe_inter` (inert: SiTU(0, 0) = 0 and the padded W2 columns are 0).

Selection: bias moves only the choice, never the weights. With use_grouped_topk and
num_expert_group > 1, groups are contiguous expert ranges scored by the sum of their two
best s'; the best `topk_group` groups survive (ties to the lower group) and the others
drop to −∞. Order is s' descending, ties to the lower index (stable sort, not
`torch.topk`), NaN keys below everything including −∞, so they are picked only when
nothing else is left. Each selected expert runs once over the rows that chose it.
"""

from __future__ import annotations

import torch

from ..latency_specialized.config import K3TextConfig, ShardShapes
from .collective import Collective
from .dense_mlp import activation_clips, gated_mlp_partial
from .ops import BF16, F32, bf16_add, linear, rms_norm, situ_and_mul
from .params import MoEWeights

RENORM_EPS = 1e-20


def selection_groups(cfg: K3TextConfig) -> int:
    """The expert groups the selection really uses: 1 where grouping is off or keeps every group."""
    grouped = cfg.use_grouped_topk and cfg.num_expert_group > 1 and cfg.topk_group < cfg.num_expert_group
    return cfg.num_expert_group if grouped else 1


def _keep_best_groups(keys: torch.Tensor, cfg: K3TextConfig) -> torch.Tensor:
    """keys [N, E] (no NaN) with experts outside the `topk_group` best groups set to −∞."""
    groups = selection_groups(cfg)
    if groups == 1:
        return keys
    n_rows, n_exp = keys.shape
    grouped = keys.view(n_rows, groups, n_exp // groups)
    group_score = grouped.topk(min(2, n_exp // groups), dim=-1).values.sum(-1)
    best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :cfg.topk_group]
    keep = torch.zeros(n_rows, groups, dtype=torch.bool, device=keys.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n_rows, n_exp)


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: K3TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: fp32 logits [N, E] -> (weights fp32 [N, k], expert ids int64 [N, k]) in selection order."""
    n_exp, k = cfg.num_experts, cfg.num_experts_per_token
    if logits.dim() != 2 or logits.shape[1] != n_exp or logits.dtype != F32:
        raise ValueError(f"router logits must be fp32 [N, num_experts={n_exp}], found "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if bias.shape != (n_exp,):
        raise ValueError(f"e_score_correction_bias must be [{n_exp}], found {tuple(bias.shape)}")
    if cfg.moe_router_activation_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    keys = scores + bias.to(F32)
    is_nan = torch.isnan(keys)
    keys = _keep_best_groups(keys.masked_fill(is_nan, float("-inf")), cfg)
    # two stable sorts give the order (not NaN, s' descending, index ascending)
    by_key = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(is_nan.gather(1, by_key).to(torch.int8), dim=-1, stable=True).indices
    ids = by_key.gather(1, nan_last)[:, :k]
    weights = scores.gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return weights * cfg.routed_scaling_factor, ids


def _check_shapes(w: MoEWeights, cfg: K3TextConfig, shard: ShardShapes, v: torch.Tensor) -> None:
    if v.dim() != 2 or v.shape[1] != cfg.hidden_size:
        raise ValueError(f"v must be [N, hidden_size={cfg.hidden_size}], found {tuple(v.shape)}")
    lat, inter = cfg.routed_expert_hidden_size, shard.moe_inter
    want = {"w13": (cfg.num_experts, 2 * inter, lat), "w2": (cfg.num_experts, lat, inter),
            "latent_down": (lat, cfg.hidden_size), "latent_up": (cfg.hidden_size, lat)}
    for name, shape in want.items():
        got = tuple(getattr(w, name).shape)
        if got != shape:
            raise ValueError(f"MoEWeights.{name} is {got} but TP{shard.tp} rank {shard.rank} needs "
                             f"{shape} (expert slices zero-padded to moe_inter={inter})")


def _routed_latent(w: MoEWeights, cfg: K3TextConfig, shard: ShardShapes, x_lat: torch.Tensor,
                   weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """This rank's bf16 partial Σ_j w_j · y_Top_j [N, H_lat]."""
    n_rows, k = ids.shape
    inter = shard.moe_inter
    beta, linear_beta = activation_clips(cfg)
    expert_out = torch.empty(n_rows * k, x_lat.shape[1], dtype=BF16, device=x_lat.device)
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        picks = (flat_ids == e).nonzero().squeeze(1)  # flat (row, slot) indices row·k + j
        gate, up = linear(x_lat[picks // k], w.w13[e]).split([inter, inter], dim=-1)
        expert_out[picks] = linear(situ_and_mul(gate, up, beta, linear_beta), w.w2[e])
    expert_out = expert_out.view(n_rows, k, -1)
    acc = torch.zeros(n_rows, x_lat.shape[1], dtype=F32, device=x_lat.device)
    for j in range(k):  # selection order fixes the fp32 summation order
        acc += weights[:, j:j + 1] * expert_out[:, j].to(F32)
    return acc.to(BF16)


def moe(w: MoEWeights, cfg: K3TextConfig, shard: ShardShapes, v: torch.Tensor, coll: Collective) -> torch.Tensor:
    """Latent MoE on v [N, H] bf16 -> m [N, H] bf16 (routed + shared, both fully reduced)."""
    _check_shapes(w, cfg, shard, v)
    weights, ids = route(linear(v, w.router, out_dtype=F32), w.bias, cfg)
    x_lat = linear(v, w.latent_down)
    y = coll.all_reduce(_routed_latent(w, cfg, shard, x_lat, weights, ids))
    if cfg.latent_moe_use_norm:
        y = rms_norm(y, w.latent_norm, cfg.rms_norm_eps)
    routed = linear(y, w.latent_up)
    shared = coll.all_reduce(gated_mlp_partial(w.shared_gate_up, w.shared_down, v, cfg))
    return bf16_add(routed, shared)
