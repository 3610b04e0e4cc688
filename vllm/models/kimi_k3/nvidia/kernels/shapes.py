"""The dense projections of one K3 decode step, by name, at the per-rank shapes of a TP size.

Every entry is one `y[M, N] = x[M, K] · Wᵀ` with W `[N, K]` BF16 (K3_MATH.md §5.2), read from
`K3TextConfig.shard(tp, 0)` so the list follows the config. Rank 0 stands for every rank: all
ranks of a TP size hold the same shapes. The MoE router, latent down- and up-projections are
listed replicated (every rank multiplies the full matrix: the stock layout); the router's
logits are FP32. The absorbed MLA kv_b product is a batched per-head GEMM and is not here.
Tests and benchmarks share this list so both cover the same envelope.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..latency_specialized.config import PRESETS, K3TextConfig


@dataclass(frozen=True)
class GemmShape:
    name: str  # "<projection>@tp<T>", unique across TP sizes
    tp: int
    n: int  # output features: rows of W
    k: int  # input features: columns of W and x
    out_dtype: torch.dtype = torch.bfloat16

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * 2


def k3_gemm_shapes(tps: tuple[int, ...] = (1, 8, 16),
                   cfg: K3TextConfig | None = None) -> list[GemmShape]:
    """Every dense projection of `cfg` (default: the 'k3' preset) for each TP size in `tps`."""
    cfg = PRESETS["k3"] if cfg is None else cfg
    h = cfg.hidden_size
    shapes: list[GemmShape] = []
    for tp in tps:
        s = cfg.shard(tp, 0)
        per_rank = (
            ("kda_in_proj", s.kda_in_rows, h),
            ("kda_f_b", s.kda_proj, s.kda_fa),
            ("kda_o_proj", h, s.kda_proj),
            ("mla_fused_a", s.mla_fused_a_rows, h),
            ("mla_q_b", s.mla_q_b_rows, cfg.q_lora_rank),
            ("mla_o_proj", h, s.mla_o_in),
            ("dense_gate_up", 2 * s.dense_inter, h),
            ("dense_down", h, s.dense_inter),
            ("moe_latent_down", cfg.routed_expert_hidden_size, h),
            ("moe_latent_up", h, cfg.routed_expert_hidden_size),
            ("shared_gate_up", 2 * s.shared_inter, h),
            ("shared_down", h, s.shared_inter),
            ("lm_head", s.vocab, h),
        )
        shapes += [GemmShape(f"{name}@tp{tp}", tp, n, k) for name, n, k in per_rank]
        shapes.append(GemmShape(f"moe_router@tp{tp}", tp, cfg.num_experts, h, torch.float32))
    return shapes
