"""Per-rank weight containers of the reference path (vLLM's stock TP layout, K3_MATH.md §5).

Shapes use `ShardShapes` names: P_r = shard.kda_proj, h_r = shard.kda_heads, etc. All
BF16 unless marked. `latency_specialized/weights.py` fills these from a checkpoint or a
seeded random init; the layers in this package only read them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Union

import torch


class _Tensors:
    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str) -> "_Tensors":
        for name, t in self.tensors().items():
            setattr(self, name, t.to(device))
        return self


@dataclass
class AttnResWeights(_Tensors):
    attn_norm: torch.Tensor  # self_attention_res_norm [H]
    attn_proj: torch.Tensor  # self_attention_res_proj [H] (checkpoint [1, H])
    input_norm: torch.Tensor  # input_layernorm [H]
    mlp_norm: torch.Tensor  # mlp_res_norm [H]
    mlp_proj: torch.Tensor  # mlp_res_proj [H]
    post_norm: torch.Tensor  # post_attention_layernorm [H]


@dataclass
class KDAWeights(_Tensors):
    in_proj: torch.Tensor  # [kda_in_rows, H]: q | k | v | g_out (P_r each) | f_a (d) | beta (h_r) | 0-pad
    f_b: torch.Tensor  # [P_r, d]
    conv: torch.Tensor  # fp32 [3·P_r, 4]: channels q | k | v, tap 3 multiplies the current token
    A_log: torch.Tensor  # fp32 [h_r]
    dt_bias: torch.Tensor  # fp32 [P_r]
    o_norm: torch.Tensor  # [d], shared by heads
    o_proj: torch.Tensor  # [H, P_r]


@dataclass
class MLAWeights(_Tensors):
    fused_a: torch.Tensor  # [r_q + r_kv + d_r + n_h/T·d_v, H]: q_c | kv_c | k_pe | g
    q_a_norm: torch.Tensor  # [r_q]
    kv_a_norm: torch.Tensor  # [r_kv]
    q_b: torch.Tensor  # [n_h/T·(d_n + d_r), r_q], per head [q_nope | q_pe]
    kv_b: torch.Tensor  # [n_h/T·(d_n + d_v), r_kv], per head [k_nope rows | v rows]
    o_proj: torch.Tensor  # [H, n_h/T·d_v]


@dataclass
class DenseMLPWeights(_Tensors):
    gate_up: torch.Tensor  # [2·I_d/T, H]: gate rows then up rows
    down: torch.Tensor  # [H, I_d/T]


@dataclass
class MoEWeights(_Tensors):
    router: torch.Tensor  # gate.weight [E, H] (replicated: stock layout)
    bias: torch.Tensor  # fp32 e_score_correction_bias [E]
    latent_down: torch.Tensor  # [H_lat, H] (replicated)
    latent_norm: torch.Tensor  # [H_lat]
    latent_up: torch.Tensor  # [H, H_lat] (replicated, full: off-SM100 stock layout)
    w13: torch.Tensor  # [E, 2·moe_inter, H_lat]: gate rows then up rows, zero-padded per half
    w2: torch.Tensor  # [E, H_lat, moe_inter], zero-padded columns
    shared_gate_up: torch.Tensor  # [2·I_s/T, H]
    shared_down: torch.Tensor  # [H, I_s/T]


AttnWeights = Union[KDAWeights, MLAWeights]
MLPWeights = Union[DenseMLPWeights, MoEWeights]


@dataclass
class LayerWeights:
    attn_res: AttnResWeights
    attn: AttnWeights
    mlp: MLPWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V/T, H], rows [vocab_start, vocab_start + V/T)
    lm_head: torch.Tensor  # [V/T, H]
    final_norm: torch.Tensor  # [H]
    out_res_norm: torch.Tensor  # output_attn_res_norm [H]
    out_res_proj: torch.Tensor  # output_attn_res_proj [H]
    layers: list[LayerWeights]

    def to(self, device: torch.device | str) -> "ModelWeights":
        for n in ("embed", "lm_head", "final_norm", "out_res_norm", "out_res_proj"):
            setattr(self, n, getattr(self, n).to(device))
        for lw in self.layers:
            lw.attn_res.to(device)
            lw.attn.to(device)
            lw.mlp.to(device)
        return self
