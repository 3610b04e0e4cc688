"""`K3TextConfig`: the Kimi K3 text decoder's configuration, its presets and per-rank shapes.

Read from an HF-style ``config.json``: Kimi K3 nests the text model in ``text_config``
(model_type ``kimi_k3``); a bare Kimi-Linear text config (model_type ``kimi_linear``)
works too. Every field of K3_MATH.md §1 is kept; unknown keys of the HF file are ignored
(HF configs carry many unrelated ones), wrong values raise `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config value is missing or outside what the K3 decoder supports."""


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class K3TextConfig:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    # MLA
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    min_moe_intermediate_per_partition: int = 256
    # AttnRes
    attn_res_block_size: int = 12
    # KDA (linear_attn_config); layer lists are 1-based as in the HF file
    kda_layers: tuple[int, ...] = ()
    full_attn_layers: tuple[int, ...] = ()
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    # misc
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    logit_scale: float = 1.0
    max_position_embeddings: int = 1048576
    name: str = field(default="custom", compare=False)

    # ---------------------------------------------------------------- construction

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>") -> "K3TextConfig":
        """Build from an HF config dict (K3 multimodal, or bare Kimi-Linear text)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: 'text_config' must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in text.items() if k in known and k != "name"}
        lin = text.get("linear_attn_config")
        if lin is None:
            raise ConfigError(
                f"{source}: 'linear_attn_config' is missing; K3 needs kda_layers and "
                "full_attn_layers (1-based layer indices)"
            )
        for src, dst in (
            ("kda_layers", "kda_layers"),
            ("full_attn_layers", "full_attn_layers"),
            ("num_heads", "kda_num_heads"),
            ("head_dim", "kda_head_dim"),
            ("short_conv_kernel_size", "short_conv_kernel_size"),
            ("use_full_rank_gate", "use_full_rank_gate"),
            ("gate_lower_bound", "gate_lower_bound"),
        ):
            if src in lin:
                kw[dst] = lin[src]
        for key in ("kda_layers", "full_attn_layers"):
            if key in kw:
                if not isinstance(kw[key], (list, tuple)) or not all(
                    isinstance(i, int) for i in kw[key]
                ):
                    raise ConfigError(
                        f"{source}: linear_attn_config.{key} must be a list of 1-based "
                        f"layer indices, found {kw[key]!r}"
                    )
                kw[key] = tuple(kw[key])
        # the class default of rms_norm_eps is 1e-6 in vLLM; keep the file's value if given
        kw.setdefault("rms_norm_eps", 1e-6)
        try:
            return cls(name=Path(source).parent.name or source, **kw)
        except TypeError as e:  # wrong types reach the constructor
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "K3TextConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The bare Kimi-Linear text config this object reads back identically."""
        d = dataclasses.asdict(self)
        d.pop("name")
        lin = {
            "kda_layers": list(d.pop("kda_layers")),
            "full_attn_layers": list(d.pop("full_attn_layers")),
            "num_heads": d.pop("kda_num_heads"),
            "head_dim": d.pop("kda_head_dim"),
            "short_conv_kernel_size": d.pop("short_conv_kernel_size"),
            "use_full_rank_gate": d.pop("use_full_rank_gate"),
            "gate_lower_bound": d.pop("gate_lower_bound"),
        }
        return {"model_type": "kimi_linear", **d, "linear_attn_config": lin}

    # ---------------------------------------------------------------- validation

    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{self.name}: {fld}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "kda_num_heads", "kda_head_dim", "num_experts", "num_experts_per_token",
                  "moe_intermediate_size", "routed_expert_hidden_size", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "attn_res_block_size", "short_conv_kernel_size"):
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f, f"must be a positive integer, found {v!r}")
        need(self.hidden_act in ("situ", "silu"), "hidden_act",
             f"must be 'situ' or 'silu', found {self.hidden_act!r}")
        need(self.moe_router_activation_func in ("sigmoid", "softmax"),
             "moe_router_activation_func",
             f"must be 'sigmoid' or 'softmax', found {self.moe_router_activation_func!r}")
        need(self.mla_use_nope, "mla_use_nope", "K3's MLA layers are NoPE; must be true")
        need(self.mla_use_output_gate, "mla_use_output_gate", "K3's MLA has an output gate; must be true")
        need(self.use_full_rank_gate, "linear_attn_config.use_full_rank_gate",
             "K3's KDA uses the full-rank output gate; must be true")
        need(self.short_conv_kernel_size == 4, "linear_attn_config.short_conv_kernel_size",
             f"only 4 is supported, found {self.short_conv_kernel_size}")
        need(self.gate_lower_bound is None or -5.0 <= self.gate_lower_bound < 0.0,
             "linear_attn_config.gate_lower_bound",
             f"must be null or in [-5, 0), found {self.gate_lower_bound!r}")
        need(1 <= self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"must be in [1, num_experts={self.num_experts}], found {self.num_experts_per_token}")
        need(self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0,
             "num_expert_group", f"must divide num_experts={self.num_experts}")
        need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
             f"must be in [1, num_expert_group={self.num_expert_group}]")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
        n = self.num_hidden_layers
        kda, mla = set(self.kda_layers), set(self.full_attn_layers)
        need(len(kda) == len(self.kda_layers), "linear_attn_config.kda_layers", "has duplicates")
        need(len(mla) == len(self.full_attn_layers), "linear_attn_config.full_attn_layers",
             "has duplicates")
        bad = sorted(i for i in kda | mla if not 1 <= i <= n)
        need(not bad, "linear_attn_config", f"layer indices {bad} outside 1..{n} (the lists are 1-based)")
        both = sorted(kda & mla)
        need(not both, "linear_attn_config", f"layers {both} are listed as both KDA and MLA")
        missing = sorted(set(range(1, n + 1)) - kda - mla)
        need(not missing, "linear_attn_config",
             f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers; "
             "every layer needs a kind")

    # ---------------------------------------------------------------- derived facts

    def layer_kind(self, i: int) -> str:
        """'kda' or 'mla' for 0-based layer i."""
        if not 0 <= i < self.num_hidden_layers:
            raise ConfigError(f"layer index {i} outside 0..{self.num_hidden_layers - 1}")
        return "kda" if (i + 1) in self.kda_layers else "mla"

    def mlp_kind(self, i: int) -> str:
        """'dense' or 'moe' for 0-based layer i."""
        if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0:
            return "moe"
        return "dense"

    @property
    def kda_proj(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.layer_kind(i) == "mla"]

    def shard(self, tp: int, rank: int) -> "ShardShapes":
        return ShardShapes.of(self, tp, rank)

    def replace(self, **kw: Any) -> "K3TextConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class ShardShapes:
    """Per-rank shapes of one tensor-parallel rank (vLLM's stock TP layout, K3_MATH.md §5)."""

    tp: int
    rank: int
    kda_heads: int  # h_K / T
    kda_proj: int  # P / T
    kda_fa: int  # f_a width (head_dim), replicated
    kda_in_rows: int  # 4·P/T + f_a + h_K/T, padded to ×16
    mla_heads: int  # n_h / T
    mla_fused_a_rows: int  # r_q + r_kv + d_r + n_h/T·d_v
    mla_q_b_rows: int  # n_h/T · (d_n + d_r)
    mla_kv_b_rows: int  # n_h/T · (d_n + d_v)
    mla_o_in: int  # n_h/T · d_v
    moe_inter: int  # routed expert intermediate per rank, padded to the minimum
    moe_inter_real: int  # I / T, the checkpoint rows a rank holds
    shared_inter: int  # I_s / T
    dense_inter: int  # I_d / T
    vocab: int  # V / T
    vocab_start: int  # first vocab row of this rank

    @classmethod
    def of(cls, cfg: K3TextConfig, tp: int, rank: int) -> "ShardShapes":
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, found {tp!r}")
        if not 0 <= rank < tp:
            raise ConfigError(f"rank {rank} outside 0..{tp - 1} for tensor_parallel_size {tp}")
        for fld, v in (("linear_attn_config.num_heads", cfg.kda_num_heads),
                       ("num_attention_heads", cfg.num_attention_heads),
                       ("moe_intermediate_size", cfg.moe_intermediate_size),
                       ("moe_intermediate_size × num_shared_experts", cfg.shared_intermediate),
                       ("intermediate_size", cfg.intermediate_size),
                       ("vocab_size", cfg.vocab_size)):
            if v % tp:
                raise ConfigError(
                    f"{cfg.name}: {fld} = {v} is not divisible by tensor_parallel_size {tp}; "
                    "choose a TP size that divides it"
                )
        h = cfg.kda_num_heads // tp
        p = h * cfg.kda_head_dim
        nh = cfg.num_attention_heads // tp
        inter = cfg.moe_intermediate_size // tp
        vocab = cfg.vocab_size // tp
        return cls(
            tp=tp, rank=rank,
            kda_heads=h, kda_proj=p, kda_fa=cfg.kda_head_dim,
            kda_in_rows=_round_up(4 * p + cfg.kda_head_dim + h, 16),
            mla_heads=nh,
            mla_fused_a_rows=cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim + nh * cfg.v_head_dim,
            mla_q_b_rows=nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
            mla_kv_b_rows=nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            mla_o_in=nh * cfg.v_head_dim,
            moe_inter=max(inter, cfg.min_moe_intermediate_per_partition),
            moe_inter_real=inter,
            shared_inter=cfg.shared_intermediate // tp,
            dense_inter=cfg.intermediate_size // tp,
            vocab=vocab, vocab_start=rank * vocab,
        )


def _k3_layer_lists(n: int = 93) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Assumed pattern (K3_MATH.md §9.1: the exact list is unverified): MLA every 4th layer
    # (0-based 3, 7, ..., 91) plus layer 92, giving 24 MLA layers; this keeps every AttnRes
    # block-write layer (0, 12, ..., 84) KDA, which is the one fact known about the list.
    mla = [i for i in range(n) if i % 4 == 3] + [92]
    kda = [i for i in range(n) if i not in mla]
    return tuple(i + 1 for i in kda), tuple(i + 1 for i in mla)


def _mini_layer_lists() -> tuple[tuple[int, ...], tuple[int, ...]]:
    # 6 layers, AttnRes blocks of 3 (block-write layers 0 and 3 are KDA like in K3)
    return (1, 2, 4, 5), (3, 6)


PRESETS: dict[str, K3TextConfig] = {}


def _register() -> None:
    kda, mla = _k3_layer_lists()
    PRESETS["k3"] = K3TextConfig(kda_layers=kda, full_attn_layers=mla, name="k3")
    mk, mm = _mini_layer_lists()
    PRESETS["mini"] = K3TextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=6, intermediate_size=256,
        first_k_dense_replace=1, rms_norm_eps=1e-5,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=32, routed_expert_hidden_size=64,
        routed_scaling_factor=2.5, min_moe_intermediate_per_partition=8,
        attn_res_block_size=3, kda_layers=mk, full_attn_layers=mm,
        kda_num_heads=4, kda_head_dim=32, gate_lower_bound=-5.0,
        max_position_embeddings=4096, name="mini",
    )


_register()


def preset(name: str) -> K3TextConfig:
    """A named preset (`k3`, `mini`, or `tiny`: the shipped eval model), or a config.json path / directory."""
    if name == "tiny":  # defined beside its checkpoint in evals/
        from ..evals.tiny import config_named
        return config_named("tiny")
    if name in PRESETS:
        return PRESETS[name]
    p = Path(name)
    if p.exists():
        return K3TextConfig.from_json(p)
    if "/" in name or os.sep in name or name.endswith(".json"):  # meant as a path, not a preset
        raise ConfigError(
            f"config {name!r}: no such file or directory; give the path of an existing config.json "
            f"(or of its folder), or one of {sorted([*PRESETS, 'tiny'])}"
        )
    raise ConfigError(
        f"unknown config {name!r}: use one of {sorted([*PRESETS, 'tiny'])} or a path to a config.json"
    )
