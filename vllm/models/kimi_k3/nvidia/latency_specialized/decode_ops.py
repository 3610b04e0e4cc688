"""The op table of a specialized decode step: CuTe DSL kernels, or the reference on the same contract.

`SpecializedDecode` (executor.py) writes a decode step once, in terms of the ops below, and
runs it with one of two tables:

| table | op implementations | used for |
| --- | --- | --- |
| `KernelOps` | the CuTe DSL kernels of `kernels/` (and the glue op named in `GLUE`) | the specialized path on a GPU |
| `ReferenceOps` | the functions of `reference/` on the same tensors and metadata | CPU tests of the executor's plumbing (buffers, AttnRes slots, metadata, padding), exact against `ReferenceModel` |

Every call is recorded in `trace` as `(op, implementation)`; the executor captures one trace
per CUDA graph, so the path counters list exactly the launches a replay runs, and a test can
assert that no op of an admitted step ran anything but a kernel or a declared glue op.

Step metadata (`StepMeta`, executor.py) is device tensors only, so a captured graph reads new
slots and lengths in place: `ReferenceOps` rebuilds `reference.state.Segment`s from the same
tensors, which is how the CPU tests prove the metadata itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..reference import attn_res as ref_attn_res
from ..reference import kda as ref_kda
from ..reference import mla as ref_mla
from ..reference import moe as ref_moe
from ..reference.collective import SingleRank
from ..reference.model import embed as ref_embed
from ..reference.ops import BF16, F32, acc_dtype, bf16_add, linear, rms_norm, situ_and_mul
from .moe_padding import pad_moe

if TYPE_CHECKING:
    from ..reference.params import KDAWeights, MoEWeights
    from ..reference.state import KDALayerState
    from .config import K3TextConfig, ShardShapes
    from .executor import StepMeta

# Ops that run as plain torch on both tables: the copy of an operand no kernel can read in
# place (vLLM's embeddings into the step's block slot; a GEMM input whose rows are not 16-byte
# aligned, which K3's and the tiny model's never are).
GLUE = ("copy",)


@dataclass(frozen=True)
class MLAAbsorption:
    """One MLA layer's kv_b, split per head for the absorbed form (built once, at the build).

    w_uk `[h, d_n, r_kv]` and w_uv `[h, d_v, r_kv]` (reference/mla.py::split_kv_b); q_to_latent
    `[h, r_kv + d_r, d_n + d_r]` = [[W_UKᵀ, 0], [0, I]] per head, so that one GEMM per head gives
    q_lat = [q_nope · W_UK | q_pe] exactly: the identity block copies q_pe (one nonzero product
    per output) and the zero blocks add exact zeros to the fp32 sums."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    q_to_latent: torch.Tensor

    @staticmethod
    def of(w_uk: torch.Tensor, w_uv: torch.Tensor, d_r: int) -> MLAAbsorption:
        heads, d_n, r_kv = w_uk.shape
        q_to_latent = torch.zeros(heads, r_kv + d_r, d_n + d_r, dtype=w_uk.dtype, device=w_uk.device)
        q_to_latent[:, :r_kv, :d_n] = w_uk.transpose(1, 2)
        q_to_latent[:, r_kv:, d_n:] = torch.eye(d_r, dtype=w_uk.dtype, device=w_uk.device)
        return MLAAbsorption(w_uk.contiguous(), w_uv.contiguous(), q_to_latent)


class DecodeOps:
    """Shared recording and the glue ops; subclasses provide the kernel-able ops."""

    impl = "?"

    def __init__(self) -> None:
        self.trace: list[tuple[str, str]] = []
        # each MoE layer's expert ids of the last traced step; after a capture these are graph-pool
        # tensors that every replay rewrites, so a benchmark reads the experts a step really touched
        self.routed: list[torch.Tensor] = []

    def reset(self) -> None:
        self.trace, self.routed = [], []

    def _rec(self, op: str, impl: str | None = None) -> None:
        self.trace.append((op, impl or self.impl))

    def prepare_moe(self, w: MoEWeights) -> MoEWeights:
        """A MoE layer's weights as this table's ops take them (once, at the executor's build)."""
        return w

    # ---- glue (same on both tables)
    def copy(self, x: torch.Tensor) -> torch.Tensor:
        self._rec("copy", "torch")
        return x.contiguous()

    # ---- the reference's forms, which ReferenceOps and TorchOps share
    @staticmethod
    def linear_epilogue(y: torch.Tensor, out_dtype: torch.dtype, addend: torch.Tensor | None,
                        scale: float | None) -> torch.Tensor:
        """After the bf16 product y: bf16(y + addend) (reference/ops.py::bf16_add, routed + shared),
        or y in fp32 times scale (the logit scale), in out_dtype."""
        if addend is not None:
            y = bf16_add(y, addend)
        if scale is not None:
            y = y.to(F32) * scale if scale != 1.0 else y.to(F32)
        return y.to(out_dtype)

    def situ_and_mul(self, gate_up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
        """The reference's SiTU-and-mul on [g | u] (KernelOps runs kernels/situ_mul.py instead)."""
        self._rec("situ_and_mul")
        gate, up = gate_up.chunk(2, dim=-1)
        return situ_and_mul(gate, up, beta, linear_beta)

    def mla_absorb(self, q: torch.Tensor, mla: MLAAbsorption) -> torch.Tensor:
        """q [N, h, d_n + d_r] -> q_lat [N, h, r_kv + d_r] = [bf16(q_nope · W_UK) | q_pe]."""
        self._rec("mla_absorb")
        if acc_dtype(q) != F32:
            return ref_mla.absorb_query(q, mla.w_uk)
        d_n = mla.w_uk.shape[1]
        ql = torch.bmm(q[..., :d_n].transpose(0, 1), mla.w_uk).transpose(0, 1)  # one batched GEMM on the GPU
        return torch.cat([ql, q[..., d_n:]], dim=-1)

    def mla_unabsorb(self, ol: torch.Tensor, mla: MLAAbsorption, gate: torch.Tensor) -> torch.Tensor:
        """ol [N, h, r_kv] -> the gated output [N, h·d_v] = bf16(o · σ(gate)), o = bf16(ol · W_UVᵀ)."""
        self._rec("mla_unabsorb")
        if acc_dtype(ol) != F32:
            o = ref_mla.unabsorb(ol, mla.w_uv)
        else:
            o = torch.bmm(ol.transpose(0, 1), mla.w_uv.transpose(1, 2)).transpose(0, 1)
        return (o.reshape(gate.shape).to(F32) * torch.sigmoid(gate.to(F32))).to(BF16)


class ReferenceOps(DecodeOps):
    """The reference functions on the executor's tensors and metadata (CPU tests, oracles)."""

    impl = "reference"

    def linear(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = BF16, *,
               addend: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """x · wᵀ; with an addend or a scale the product is rounded to bf16 first (`linear_epilogue`)."""
        self._rec("linear")
        if addend is None and scale is None:
            return linear(x, w, out_dtype)
        return self.linear_epilogue(linear(x, w, BF16), out_dtype, addend, scale)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        self._rec("rms_norm")
        return rms_norm(x, w, eps)

    def embed(self, ids: torch.Tensor, table: torch.Tensor, shard: ShardShapes, vocab_size: int,
              out: torch.Tensor) -> torch.Tensor:
        self._rec("embed")
        return out.copy_(ref_embed(ids, table, shard, vocab_size, SingleRank()))

    def mla_cache_write(self, kv_c: torch.Tensor, k_pe: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        cache: torch.Tensor, index: torch.Tensor) -> None:
        """cache rows `index` (flat block·block_size + offset) ← [RMSNorm(kv_c) | k_pe]."""
        self._rec("mla_cache_write")
        rows = torch.cat([rms_norm(kv_c, norm_w, eps), k_pe], dim=-1)
        cache.view(-1, cache.shape[-1]).index_copy_(0, index, rows)

    def attn_res(self, blocks: torch.Tensor, n_blocks: int, prefix: torch.Tensor | None, norm_w: torch.Tensor,
                 proj_w: torch.Tensor, eps: float, *, addend: torch.Tensor | None = None,
                 live_out: torch.Tensor | None = None, out_w: torch.Tensor | None = None,
                 final_norm: torch.Tensor | None = None) -> torch.Tensor:
        self._rec("attn_res")
        live = prefix if addend is None or prefix is None else bf16_add(prefix, addend)
        if live_out is not None:
            live_out.copy_(live)
        sources = [blocks[j] for j in range(n_blocks)] + ([live] if live is not None else [])
        if final_norm is not None:
            return rms_norm(ref_attn_res.attn_res_mix(sources, norm_w, proj_w, eps), final_norm, eps)
        return ref_attn_res.attn_res_mix(sources, norm_w, proj_w, eps, out_w)

    def kda_core(self, z: torch.Tensor, g_raw: torch.Tensor, w: KDAWeights, st: KDALayerState,
                 meta: StepMeta, cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("kda_core")
        return ref_kda.kda_core(z, g_raw, w, cfg, shard, meta.kda_segments(), st)

    def mla_attend(self, q_lat: torch.Tensor, cache: torch.Tensor, meta: StepMeta, r_kv: int,
                   tau: float) -> torch.Tensor:
        self._rec("mla_attend")
        ol = torch.zeros(q_lat.shape[0], q_lat.shape[1], r_kv, dtype=BF16, device=q_lat.device)
        bs = cache.shape[1]
        starts = meta.query_start.tolist()
        for r, length in enumerate(meta.seq_lens.tolist()):
            pos = torch.arange(length, device=cache.device)
            kv = cache[meta.block_table[r].long()[pos // bs], pos % bs]
            ol[starts[r]:starts[r + 1]] = ref_mla.attend_latent(q_lat[starts[r]:starts[r + 1]], kv, r_kv, tau)
        return ol

    def route(self, logits: torch.Tensor, bias: torch.Tensor, cfg: K3TextConfig
              ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rec("moe_route")
        e = cfg.num_experts  # experts past it are moe_padding's, never chosen (key −∞)
        weights, ids = ref_moe.route(logits[:, :e], bias[:e], cfg)
        self.routed.append(ids)
        return weights, ids.to(torch.int32)

    def routed_experts(self, x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights,
                       cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("moe_experts")
        if w.w2.shape[2] != shard.moe_inter:  # padded by moe_padding (zero rows and columns)
            shard = dataclasses.replace(shard, moe_inter=w.w2.shape[2])
        return ref_moe._routed_latent(w, cfg, shard, x_lat, weights, ids.long())


class KernelOps(DecodeOps):
    """The CuTe DSL kernels (imported lazily: the DSL is only needed where they run)."""

    impl = "cute"

    def __init__(self) -> None:
        super().__init__()
        from ..kernels import (attn_res, embedding, kda_decode, mla_cache_write, mla_decode, moe_experts, moe_router,
                               rms_norm, situ_mul, skinny_gemm)
        self.k_attn_res, self.k_embedding, self.k_kda = attn_res, embedding, kda_decode
        self.k_cache_write = mla_cache_write
        self.k_mla, self.k_experts, self.k_router = mla_decode, moe_experts, moe_router
        self.k_norm, self.k_gemm, self.k_situ = rms_norm, skinny_gemm, situ_mul

    def prepare_moe(self, w: MoEWeights) -> MoEWeights:
        """Zero-padded to the MoE kernels' granularity where a model is smaller than K3 (moe_padding.py)."""
        return pad_moe(w)

    def situ_and_mul(self, gate_up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
        self._rec("situ_and_mul")
        return self.k_situ.launch(gate_up, beta, linear_beta)

    def linear(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = BF16, *,
               addend: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        if not self.k_gemm.reads_in_place(x):
            x = self.copy(x)
        self._rec("skinny_gemm")
        return self.k_gemm.launch(x, w, out_dtype=out_dtype, addend=addend, scale=scale)

    def mla_absorb(self, q: torch.Tensor, mla: MLAAbsorption) -> torch.Tensor:
        self._rec("skinny_gemm")  # per head: q · [[W_UKᵀ, 0], [0, I]]ᵀ = [q_nope · W_UK | q_pe]
        return self.k_gemm.launch(q, mla.q_to_latent)

    def mla_unabsorb(self, ol: torch.Tensor, mla: MLAAbsorption, gate: torch.Tensor) -> torch.Tensor:
        self._rec("skinny_gemm")  # per head, the output gate in its epilogue
        heads, d_v = mla.w_uv.shape[:2]
        o = self.k_gemm.launch(ol, mla.w_uv, gate=gate.view(-1, heads, d_v))
        return o.view(-1, heads * d_v)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        self._rec("rms_norm")
        return self.k_norm.launch(x, w, eps)

    def embed(self, ids: torch.Tensor, table: torch.Tensor, shard: ShardShapes, vocab_size: int,
              out: torch.Tensor) -> torch.Tensor:
        self._rec("embedding")
        return self.k_embedding.launch(ids, table, shard.vocab_start, vocab_size, out)

    def attn_res(self, blocks: torch.Tensor, n_blocks: int, prefix: torch.Tensor | None, norm_w: torch.Tensor,
                 proj_w: torch.Tensor, eps: float, *, addend: torch.Tensor | None = None,
                 live_out: torch.Tensor | None = None, out_w: torch.Tensor | None = None,
                 final_norm: torch.Tensor | None = None) -> torch.Tensor:
        self._rec("attn_res")
        mix_out = None
        if final_norm is not None:
            out_w, mix_out = final_norm, torch.empty_like(blocks[0])
        return self.k_attn_res.launch(blocks, n_blocks, prefix, norm_w, proj_w, eps, addend=addend,
                                      live_out=live_out, out_w=out_w, mix_out=mix_out)

    def kda_core(self, z: torch.Tensor, g_raw: torch.Tensor, w: KDAWeights, st: KDALayerState,
                 meta: StepMeta, cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("kda_decode")
        return self.k_kda.launch(z, g_raw, w.conv, w.A_log, w.dt_bias, w.o_norm, st.rec, st.conv,
                                 meta.conv_slot, meta.rec_read_slot, meta.rec_slots, meta.accepted,
                                 cfg.gate_lower_bound)

    def mla_cache_write(self, kv_c: torch.Tensor, k_pe: torch.Tensor, norm_w: torch.Tensor, eps: float,
                        cache: torch.Tensor, index: torch.Tensor) -> None:
        self._rec("mla_cache_write")
        self.k_cache_write.launch(kv_c, k_pe, norm_w, eps, cache, index)

    def mla_attend(self, q_lat: torch.Tensor, cache: torch.Tensor, meta: StepMeta, r_kv: int,
                   tau: float) -> torch.Tensor:
        self._rec("mla_decode")
        self._rec("mla_combine")
        return self.k_mla.launch(q_lat.contiguous(), cache, meta.block_table, meta.seq_lens, meta.query_start,
                                 meta.q, tau=tau)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, cfg: K3TextConfig
              ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rec("moe_router")
        weights, ids = self.k_router.launch(logits, bias, cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
                                            routed_scaling_factor=cfg.routed_scaling_factor,
                                            scoring=cfg.moe_router_activation_func,
                                            expert_groups=ref_moe.selection_groups(cfg))
        self.routed.append(ids)
        return weights, ids

    def routed_experts(self, x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights,
                       cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("moe_expert_gemv")  # gate/up + SiTU
        self._rec("moe_expert_gemv")  # down
        self._rec("moe_combine")
        beta, linear_beta = ref_moe.activation_clips(cfg)
        # the real columns only: TP16's slices are padded to 256 (moe_inter) around 192 real ones
        return self.k_experts.launch(x_lat, ids, weights, w.w13, w.w2, inter=shard.moe_inter_real, beta=beta,
                                     linear_beta=linear_beta)
