"""The standard (reference) decode path: one rank's K3 text decoder in plain PyTorch.

    x0 = Embed(ids)                       vocab-parallel rows + all-reduce
    for each layer: u = AttnRes_pre → KDA | MLA → AttnRes_post → dense | latent MoE
    h  = AttnRes_final (bf16) → RMSNorm → LM head (vocab-parallel + all-gather) → fp32 logits

`forward` serves prefill, plain decode (q = 1) and verify steps (q ≤ 8 per request) alike:
the step's requests are `Segment`s of one flattened [N, H] batch; row-wise work (GEMMs,
AttnRes, MoE) runs on all rows at once and attention runs per segment against the
request's state in `DecodeState`. This is both the fallback of the specialized backend and
the oracle its kernels are tested against.
"""

from __future__ import annotations

import torch

from ..latency_specialized.config import K3TextConfig, ShardShapes
from .attn_res import AttnResStream, attn_res_mix
from .collective import Collective, SingleRank
from .dense_mlp import dense_mlp
from .kda import kda_attention
from .mla import mla_attention
from .moe import moe
from .ops import F32, linear, rms_norm
from .params import KDAWeights, ModelWeights, MoEWeights
from .state import DecodeState, Segment


def embed(ids: torch.Tensor, table: torch.Tensor, shard: ShardShapes, vocab_size: int,
          coll: Collective) -> torch.Tensor:
    """Vocab-parallel lookup: rows outside this rank's range (or the vocab) are zero, then summed."""
    ids = ids.to(table.device)
    local = ids - shard.vocab_start
    mine = (local >= 0) & (local < shard.vocab) & (ids >= 0) & (ids < vocab_size)
    rows = table[local.clamp(0, shard.vocab - 1)]
    return coll.all_reduce(torch.where(mine.unsqueeze(-1), rows, torch.zeros_like(rows)))


def lm_head(h_n: torch.Tensor, table: torch.Tensor, coll: Collective, logit_scale: float) -> torch.Tensor:
    """Full-vocab fp32 logits from normalized hidden states (bf16 GEMM, then all-gather)."""
    logits = coll.all_gather(linear(h_n, table), dim=-1).to(F32)
    return logits * logit_scale if logit_scale != 1.0 else logits


class ReferenceModel:
    def __init__(self, cfg: K3TextConfig, weights: ModelWeights, tp: int = 1, rank: int = 0,
                 coll: Collective | None = None, *, decode_forms_in_prefill: bool = False):
        # decode_forms_in_prefill: run prefill with the decode forms (absorbed MLA, recurrent
        # KDA) instead of vLLM's prefill forms (naive MLA, chunked KDA); tests use it to check
        # the prefill-to-decode state hand-off for exact equality.
        self.cfg, self.w, self.decode_forms = cfg, weights, decode_forms_in_prefill
        self.coll = coll or SingleRank(tp, rank)
        self.shard = cfg.shard(self.coll.tp, self.coll.rank)

    def new_state(self, *, max_requests: int, max_len: int, max_q: int = 1,
                  device: torch.device | str | None = None) -> DecodeState:
        return DecodeState(self.cfg, self.shard, max_requests=max_requests, max_len=max_len,
                           max_q=max_q, device=device or self.w.embed.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, segments: list[Segment], state: DecodeState) -> torch.Tensor:
        """Final-normed hidden states [N, H] bf16 for the step's rows; commits the step to `state`."""
        cfg, coll, shard = self.cfg, self.coll, self.shard
        eps = cfg.rms_norm_eps
        stream = AttnResStream(embed(ids, self.w.embed, shard, cfg.vocab_size, coll), cfg.attn_res_block_size)
        for i, lw in enumerate(self.w.layers):
            ar = lw.attn_res
            u = attn_res_mix(stream.pre_attention_sources(i), ar.attn_norm, ar.attn_proj, eps, ar.input_norm)
            if isinstance(lw.attn, KDAWeights):
                a = kda_attention(lw.attn, cfg, shard, u, segments, state.kda[i], coll,
                                  chunked_prefill=not self.decode_forms)
            else:
                a = mla_attention(lw.attn, cfg, shard, u, segments, state.mla[i], coll,
                                  naive_prefill=not self.decode_forms)
            v = attn_res_mix(stream.add_attention(a), ar.mlp_norm, ar.mlp_proj, eps, ar.post_norm)
            if isinstance(lw.mlp, MoEWeights):
                stream.add_mlp(moe(lw.mlp, cfg, shard, v, coll))
            else:
                stream.add_mlp(dense_mlp(lw.mlp, cfg, v, coll))
        h = attn_res_mix(stream.final_sources(), self.w.out_res_norm, self.w.out_res_proj, eps)
        for seg in segments:
            state.commit(seg)
        return rms_norm(h, self.w.final_norm, eps)

    def logits(self, h_n: torch.Tensor) -> torch.Tensor:
        return lm_head(h_n, self.w.lm_head, self.coll, self.cfg.logit_scale)
