"""A MoE layer's weights zero-padded to the kernels' granularity, for models smaller than K3.

| dimension | padded to | with | why the result is unchanged |
| --- | --- | --- | --- |
| experts E (router rows, bias) | a multiple of 32 (`moe_router`: 32 lanes per round) | zero router rows, bias −∞ | a padded expert's key σ(0) − ∞ = −∞ ranks below every real key, and top-k ≤ E |
| latent H_lat | a multiple of 128 (`moe_experts`) | zero rows of latent_down, zero columns of w13, zero rows of w2 | the padded activations are 0 against zero weights; the executor cuts the routed output's padded (zero) columns before the latent norm |
| expert intermediate I | a multiple of 64 (`moe_experts`) | zero rows at the end of each half of w13, zero columns of w2 | SiTU(0, 0) = 0 meets zero columns |

K3 (896 experts, latent 3584, I = 3072 / TP) needs none of it: its weights come back as they are,
no copy. The tiny eval model (8 experts, latent 64, I = 32) is padded to 32, 128 and 64: a few
hundred KB.
"""

from __future__ import annotations

import dataclasses

import torch

from ..reference.params import MoEWeights

EXPERT_MULTIPLE = 32
LATENT_MULTIPLE = 128
INTER_MULTIPLE = 64


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_moe(w: MoEWeights) -> MoEWeights:
    """`w`, or a copy zero-padded as the table above says when any dimension needs it."""
    e, two_i, lat = w.w13.shape  # the experts' own count is never padded: ids stay below it
    e_r, inter = w.router.shape[0], two_i // 2
    e_p, lat_p, i_p = (_round_up(e_r, EXPERT_MULTIPLE), _round_up(lat, LATENT_MULTIPLE),
                       _round_up(inter, INTER_MULTIPLE))
    if (e_p, lat_p, i_p) == (e_r, lat, inter):
        return w

    def zeros(*shape: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    router = zeros(e_p, w.router.shape[1], like=w.router)
    router[:e_r] = w.router
    bias = torch.full((e_p,), float("-inf"), dtype=w.bias.dtype, device=w.bias.device)
    bias[:e_r] = w.bias
    latent_down = zeros(lat_p, w.latent_down.shape[1], like=w.latent_down)
    latent_down[:lat] = w.latent_down
    w13 = zeros(e, 2 * i_p, lat_p, like=w.w13)
    w13[:, :inter, :lat] = w.w13[:, :inter]
    w13[:, i_p:i_p + inter, :lat] = w.w13[:, inter:]
    w2 = zeros(e, lat_p, i_p, like=w.w2)
    w2[:, :lat, :inter] = w.w2
    return dataclasses.replace(w, router=router, bias=bias, latent_down=latent_down, w13=w13, w2=w2)
