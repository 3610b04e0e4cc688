"""vLLM's loaded Kimi K3 text modules -> one rank's `ModelWeights`, without copying weights.

vLLM's stock layer layout is the layout `weights.load_rank` prepares (K3_MATH.md §5, §7),
so every `ModelWeights` tensor is a view of a vLLM parameter:

| ModelWeights | vLLM parameter (under `model.`) | view |
|---|---|---|
| KDA `in_proj` | `self_attn.in_proj_qkvgfab.weight` (q, k, v, g, f_a, beta, zero pad) | whole |
| KDA `conv` | `self_attn.conv1d.weight` `[3·P/T, 1, 4]` | `[3·P/T, 4]` |
| MLA `fused_a` | `self_attn.fused_qkv_a_g_proj.weight` (q_a, kv_a, g) | whole |
| dense / shared `gate_up` | `gate_up_proj.weight` (gate rows, then up rows) | whole |
| routed `w13`, `w2` | `experts.routed_experts.w13_weight` / `w2_weight` (zero-padded halves) | whole |
| AttnRes projections | `*_res_proj.weight` `[1, H]` | `[H]` |
| embedding / LM head | the rank's vocab shard | rows `[0, V/T)` |

Every tensor is checked for shape and dtype against the shard shapes, and must share
storage with its parameter (`BindingError` otherwise), so a later change of vLLM's
layout surfaces here, not as wrong numbers. Bind after vLLM has processed the loaded
weights (`process_weights_after_loading` may replace parameters; views taken before
would point at the old storage), and only where `repacked_experts` finds none: most of
vLLM's MoE backends rewrite the routed experts in place into their kernel's layout
(FlashInfer swaps or shuffles the gate/up halves, the CPU backend prepacks, AITER
shuffles) keeping the shape, which no shape check can see; the Triton backend keeps the
checkpoint layout (`--moe-backend triton`).

Envelope: unquantized experts only. `ModelWeights` holds BF16 routed experts; with an
MXFP4 checkpoint vLLM stores packed `w13_weight_packed` / scales, which have no BF16
view, and binding refuses them by name. Pipeline parallelism is not covered (every
layer must be on this rank).
"""

from __future__ import annotations

import torch
from torch import nn

from ..reference.params import (AttnResWeights, DenseMLPWeights, KDAWeights, LayerWeights,
                                MLAWeights, ModelWeights, MoEWeights)
from .config import K3TextConfig, ShardShapes

F32 = torch.float32
# vLLM MoE backends (UnquantizedMoeBackend names) that keep the routed experts as loaded
STOCK_LAYOUT_MOE_BACKENDS = ("TRITON",)
# the routed experts' storage dtypes `ModelWeights` can view (the MoE kernels read BF16 experts)
BOUND_EXPERT_DTYPES = ("bfloat16",)


class BindingError(ValueError):
    """vLLM's loaded modules are not in the layout this backend reads."""


class _Binder:
    """Fetches vLLM parameters by dotted name and checks each view it makes of them."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # the model dtype: every tensor not marked fp32 is stored in it
        self.dtype = self.param("model.norm.weight").dtype
        self.views = 0

    def module(self, name: str) -> nn.Module:
        try:
            return self.root.get_submodule(name)
        except AttributeError:
            raise BindingError(f"vLLM's model has no module {name}") from None

    def param(self, name: str) -> torch.Tensor:
        owner, _, leaf = name.rpartition(".")
        tensor = getattr(self.module(owner), leaf, None) if owner else getattr(self.root, leaf, None)
        if not isinstance(tensor, torch.Tensor):
            raise BindingError(f"vLLM's model has no tensor {name}")
        return tensor

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None, *,
             stored: tuple[int, ...] | None = None, rows: int | None = None) -> torch.Tensor:
        """`name` (its first `rows` rows if given), stored as `stored` (default `shape`),
        viewed as `shape`; never a copy."""
        source = self.param(name)
        tensor = source.detach()
        if rows is not None:
            tensor = tensor[:rows]
        want = dtype or self.dtype
        if tensor.dtype != want:
            raise BindingError(f"{name}: dtype {tensor.dtype}, the backend reads {want}")
        layout = stored or shape
        if tuple(tensor.shape) != layout or not tensor.is_contiguous():
            raise BindingError(
                f"{name}: shape {list(source.shape)}"
                f"{'' if tensor.is_contiguous() else ' (not contiguous)'}, the backend reads "
                f"{list(layout)}" + ("" if rows is None else f" from its first {rows} rows")
            )
        out = tensor.view(shape)
        if out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
            raise BindingError(f"{name}: the view does not share the parameter's storage")
        self.views += 1
        return out


def bind_vllm_weights(language_model: nn.Module, cfg: K3TextConfig, tp: int = 1,
                      rank: int = 0) -> ModelWeights:
    """`ModelWeights` of rank `rank` of `tp`, as views of vLLM's `KimiLinearForCausalLM`."""
    shard = cfg.shard(tp, rank)
    b = _Binder(language_model)
    H = cfg.hidden_size
    _check_vocab_shard(b.module("model.embed_tokens"), shard, "model.embed_tokens")
    embed = b.view("model.embed_tokens.weight", (shard.vocab, H), rows=shard.vocab)
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        _check_vocab_shard(b.module("lm_head"), shard, "lm_head")
        lm_head = b.view("lm_head.weight", (shard.vocab, H), rows=shard.vocab)
    return ModelWeights(
        embed=embed, lm_head=lm_head,
        final_norm=b.view("model.norm.weight", (H,)),
        out_res_norm=b.view("model.output_attn_res_norm.weight", (H,)),
        out_res_proj=b.view("model.output_attn_res_proj.weight", (H,), stored=(1, H)),
        layers=[_bind_layer(b, cfg, shard, i) for i in range(cfg.num_hidden_layers)],
    )


def _check_vocab_shard(module: nn.Module, shard: ShardShapes, name: str) -> None:
    # vLLM pads the vocabulary to a multiple of 64 before splitting it; the rank's real
    # rows start where ours do only when that padding leaves the split points in place
    indices = getattr(module, "shard_indices", None)
    if indices is None:
        return
    start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
    if (start, end - start) != (shard.vocab_start, shard.vocab):
        raise BindingError(
            f"{name}: vLLM's vocab shard of rank {shard.rank} is rows [{start}, {end}), the "
            f"backend's is [{shard.vocab_start}, {shard.vocab_start + shard.vocab}); the "
            f"vocabulary must divide into {shard.tp} shards of a multiple of 64 rows"
        )


def _bind_layer(b: _Binder, cfg: K3TextConfig, s: ShardShapes, i: int) -> LayerWeights:
    p, H = f"model.layers.{i}.", cfg.hidden_size
    attn_res = AttnResWeights(
        attn_norm=b.view(p + "self_attention_res_norm.weight", (H,)),
        attn_proj=b.view(p + "self_attention_res_proj.weight", (H,), stored=(1, H)),
        input_norm=b.view(p + "input_layernorm.weight", (H,)),
        mlp_norm=b.view(p + "mlp_res_norm.weight", (H,)),
        mlp_proj=b.view(p + "mlp_res_proj.weight", (H,), stored=(1, H)),
        post_norm=b.view(p + "post_attention_layernorm.weight", (H,)),
    )
    a = p + "self_attn."
    attn = _bind_kda(b, cfg, s, a) if cfg.layer_kind(i) == "kda" else _bind_mla(b, cfg, s, a)
    if cfg.mlp_kind(i) == "dense":
        mlp = DenseMLPWeights(gate_up=b.view(p + "mlp.gate_up_proj.weight", (2 * s.dense_inter, H)),
                              down=b.view(p + "mlp.down_proj.weight", (H, s.dense_inter)))
    else:
        mlp = _bind_moe(b, cfg, s, p + "block_sparse_moe.")
    return LayerWeights(attn_res=attn_res, attn=attn, mlp=mlp)


def _bind_kda(b: _Binder, cfg: K3TextConfig, s: ShardShapes, a: str) -> KDAWeights:
    H, d, P, k = cfg.hidden_size, cfg.kda_head_dim, s.kda_proj, cfg.short_conv_kernel_size
    return KDAWeights(
        in_proj=b.view(a + "in_proj_qkvgfab.weight", (s.kda_in_rows, H)),
        f_b=b.view(a + "f_b_proj.weight", (P, d)),
        conv=b.view(a + "conv1d.weight", (3 * P, k), F32, stored=(3 * P, 1, k)),
        A_log=b.view(a + "A_log", (s.kda_heads,), F32),
        dt_bias=b.view(a + "dt_bias", (P,), F32),
        o_norm=b.view(a + "o_norm.weight", (d,)),
        o_proj=b.view(a + "o_proj.weight", (H, P)),
    )


def _bind_mla(b: _Binder, cfg: K3TextConfig, s: ShardShapes, a: str) -> MLAWeights:
    H = cfg.hidden_size
    return MLAWeights(
        fused_a=b.view(a + "fused_qkv_a_g_proj.weight", (s.mla_fused_a_rows, H)),
        q_a_norm=b.view(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
        kv_a_norm=b.view(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        q_b=b.view(a + "q_b_proj.weight", (s.mla_q_b_rows, cfg.q_lora_rank)),
        kv_b=b.view(a + "kv_b_proj.weight", (s.mla_kv_b_rows, cfg.kv_lora_rank)),
        o_proj=b.view(a + "o_proj.weight", (H, s.mla_o_in)),
    )


def repacked_experts(language_model: nn.Module) -> str | None:
    """Why vLLM's routed experts are not in the checkpoint layout, or None when they are."""
    for name, module in language_model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        if backend is not None and backend.name not in STOCK_LAYOUT_MOE_BACKENDS:
            return (f"{name}: vLLM's {backend.value} MoE backend rewrites the routed experts into "
                    "its kernel's layout; the backend reads the checkpoint layout, which vLLM's "
                    "Triton MoE backend keeps (--moe-backend triton)")
    return None


def _routed_experts(b: _Binder, moe: str) -> str:
    """Dotted prefix of the module holding the routed experts' w13 / w2 parameters."""
    experts = b.module(moe + "experts")
    for name, _ in experts.named_parameters():
        if name.endswith("w13_weight"):
            owner = name.rpartition(".")[0]
            return f"{moe}experts." + (f"{owner}." if owner else "")
        if name.endswith("w13_weight_packed"):
            raise BindingError(
                f"{moe}experts: the routed experts are quantized ({name}); ModelWeights "
                "holds BF16 experts, so only an unquantized checkpoint binds"
            )
    raise BindingError(f"{moe}experts: no w13_weight parameter (vLLM's routed experts)")


def _bind_moe(b: _Binder, cfg: K3TextConfig, s: ShardShapes, moe: str) -> MoEWeights:
    H, E, L = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size
    experts = _routed_experts(b, moe)
    return MoEWeights(
        router=b.view(moe + "gate.weight", (E, H)),
        bias=b.view(moe + "gate.e_score_correction_bias", (E,), F32),
        latent_down=b.view(moe + "routed_expert_down_proj.weight", (L, H)),
        latent_norm=b.view(moe + "routed_expert_norm.weight", (L,)),
        latent_up=b.view(moe + "routed_expert_up_proj.weight", (H, L)),
        w13=b.view(experts + "w13_weight", (E, 2 * s.moe_inter, L)),
        w2=b.view(experts + "w2_weight", (E, L, s.moe_inter)),
        shared_gate_up=b.view(moe + "shared_experts.gate_up_proj.weight", (2 * s.shared_inter, H)),
        shared_down=b.view(moe + "shared_experts.down_proj.weight", (H, s.shared_inter)),
    )
