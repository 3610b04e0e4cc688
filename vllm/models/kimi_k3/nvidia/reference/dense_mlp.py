"""The gated SiTU MLP of the reference path: the dense layer-0 MLP (K3_MATH.md §3.7).

    [γ | υ] = v · W_guᵀ        (gate rows, then up rows; bf16)
    h       = SiTU(γ, υ) = β·tanh(γ/β)·σ(γ) · λ·tanh(υ/λ)     (fp32, one rounding)
    m       = all_reduce( h · W_dᵀ )

TP splits the intermediate dimension (the rank holds its gate rows, the matching up rows
and down columns), so the only cross-rank sum is after the down-projection. The shared
experts of the MoE layer are the same MLP and reuse `gated_mlp_partial`.
"""

from __future__ import annotations

import torch

from ..latency_specialized.config import K3TextConfig
from .collective import Collective
from .ops import linear, situ_and_mul
from .params import DenseMLPWeights


def activation_clips(cfg: K3TextConfig) -> tuple[float | None, float | None]:
    """(β, λ) of `ops.situ_and_mul` for the config's hidden_act; SiLU clips nothing."""
    if cfg.hidden_act == "silu":
        return None, None
    return cfg.activation_situ_beta, cfg.activation_situ_linear_beta


def gated_mlp_partial(gate_up: torch.Tensor, down: torch.Tensor, v: torch.Tensor,
                      cfg: K3TextConfig) -> torch.Tensor:
    """This rank's partial h · W_dᵀ [N, H] bf16, before the cross-rank sum."""
    inter = down.shape[1]
    if gate_up.shape[0] != 2 * inter or gate_up.shape[1] != v.shape[-1]:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [2·{inter}, {v.shape[-1]}] to match "
                         f"down {tuple(down.shape)} and the input width")
    gate, up = linear(v, gate_up).split([inter, inter], dim=-1)
    beta, linear_beta = activation_clips(cfg)
    return linear(situ_and_mul(gate, up, beta, linear_beta), down)


def dense_mlp(w: DenseMLPWeights, cfg: K3TextConfig, v: torch.Tensor, coll: Collective) -> torch.Tensor:
    """Dense MLP on v [N, H] bf16 -> all-reduced [N, H] bf16."""
    if v.dim() != 2 or v.shape[1] != cfg.hidden_size:
        raise ValueError(f"v must be [N, hidden_size={cfg.hidden_size}], found {tuple(v.shape)}")
    return coll.all_reduce(gated_mlp_partial(w.gate_up, w.down, v, cfg))
