"""AttnRes (attention residuals): the learned softmax mixture over depth that replaces K3's
residual stream (K3_MATH.md §3.2).

    c      = γ ⊙ w                                 (fp32 product of two bf16 weights)
    ℓ_s    = (v_s · c) / RMS_ε(v_s)                (fp32, fp64 on CPU; one logit per source)
    p      = softmax(ℓ)                            (fp32)
    mix    = Σ_s p_s v_s                           (fp32, raw sources as values)
    out    = bf16(mix / RMS_ε'(mix) ⊙ g)  or  bf16(mix)   (final call: no norm)

`AttnResStream` keeps the per-step bookkeeping (embedding, completed block sums, the
running partial sum, each rounded to bf16 after every add) and is built fresh for every
forward: nothing persists across steps.
"""

from __future__ import annotations

import torch

from .ops import BF16, F32, acc_dtype, bf16_add


def attn_res_mix(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float, out_w: torch.Tensor | None = None,
                 out_eps: float | None = None) -> torch.Tensor:
    """Mix `sources` (each [N, H] bf16) into one [N, H] bf16 tensor."""
    if len(sources) == 1 and out_w is None:
        return sources[0]
    acc = acc_dtype(sources[0])  # fp64 on CPU: the oracle's sums must not depend on threads
    v = torch.stack([s.to(acc) for s in sources])  # [S, N, H]
    if len(sources) == 1:
        mix = v[0]
    else:
        c = (norm_w.to(F32) * proj_w.to(F32)).to(acc)
        rms = torch.sqrt(v.pow(2).mean(-1) + eps)  # [S, N]
        logits = (v @ c) / rms
        p = torch.softmax(logits, dim=0)
        mix = (p.unsqueeze(-1) * v).sum(0)
    if out_w is None:
        return mix.to(BF16)
    rrms = torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + (eps if out_eps is None else out_eps))
    return (mix * rrms * out_w.to(acc)).to(BF16)


class AttnResStream:
    """Sources of every AttnRes call of one forward, in upstream's order (blocks, then prefix)."""

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = [embedding]  # e, S_0, S_1, ...
        self.partial: torch.Tensor | None = None  # running sum of the current block
        self.pending_mlp: torch.Tensor | None = None  # m_{i-1}, folded in by the next consumer

    def _fold_mlp(self) -> None:
        if self.pending_mlp is not None:
            m, self.pending_mlp = self.pending_mlp, None
            self.partial = m if self.partial is None else bf16_add(self.partial, m)

    def pre_attention_sources(self, layer: int) -> list[torch.Tensor]:
        self._fold_mlp()
        if layer % self.block_size == 0 and layer > 0:
            assert self.partial is not None
            self.blocks.append(self.partial)  # the block of layers layer-12 .. layer-1 is complete
            self.partial = None
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add_attention(self, a: torch.Tensor) -> list[torch.Tensor]:
        """Fold a_i into the prefix and return the post-attention (MLP input) sources."""
        self.partial = a if self.partial is None else bf16_add(self.partial, a)
        return self.blocks + [self.partial]

    def add_mlp(self, m: torch.Tensor) -> None:
        self.pending_mlp = m

    def final_sources(self) -> list[torch.Tensor]:
        self._fold_mlp()
        return self.blocks + ([self.partial] if self.partial is not None else [])
