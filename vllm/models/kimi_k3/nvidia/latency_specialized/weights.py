"""Weights: the real K3 checkpoint's names (K3_MATH.md §7), TP sharding, seeded random init.

A `TensorSource` yields full checkpoint tensors by name, or row/column slices of them:
`SafetensorsSource` reads HF safetensors shards lazily (only the slices a rank needs);
`RandomSource` makes each tensor from a seed derived from its name, at realistic scales,
so every rank of a TP group slices the same full tensor. `load_rank` turns a source into
one rank's `ModelWeights` in vLLM's stock layout (fused in_proj_qkvgfab, fused
q_a/kv_a/g, merged gate/up, routed experts split on the intermediate dim and zero-padded
to `min_moe_intermediate_per_partition`). Routed experts may be stored as bf16 `.weight`
or, like the real checkpoint, as MXFP4 `.weight_packed` + `.weight_scale`; the reference
path dequantizes them to bf16 on load (exactly: every MXFP4 value is a bf16 value).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable

import torch

from ..reference.params import (AttnResWeights, DenseMLPWeights, KDAWeights, LayerWeights,
                                MLAWeights, ModelWeights, MoEWeights)
from .config import K3TextConfig, ShardShapes

BF16, F32 = torch.bfloat16, torch.float32


class WeightError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape."""


Slice = tuple[int, int] | None


def expected_shapes(cfg: K3TextConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor of the text decoder: name -> (full shape, dtype)."""
    H, P, d = cfg.hidden_size, cfg.kda_proj, cfg.kda_head_dim
    nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    m = "language_model.model."
    out[m + "embed_tokens.weight"] = ((cfg.vocab_size, H), BF16)
    out[m + "norm.weight"] = ((H,), BF16)
    out[m + "output_attn_res_norm.weight"] = ((H,), BF16)
    out[m + "output_attn_res_proj.weight"] = ((1, H), BF16)
    if not cfg.tie_word_embeddings:
        out["language_model.lm_head.weight"] = ((cfg.vocab_size, H), BF16)
    for i in range(cfg.num_hidden_layers):
        p = f"{m}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            out[p + n + ".weight"] = ((H,), BF16)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            out[p + n + ".weight"] = ((1, H), BF16)
        a = p + "self_attn."
        if cfg.layer_kind(i) == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                out[a + n + ".weight"] = ((P, H), BF16)
            out[a + "f_a_proj.weight"] = ((d, H), BF16)
            out[a + "b_proj.weight"] = ((cfg.kda_num_heads, H), BF16)
            out[a + "f_b_proj.weight"] = ((P, d), BF16)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                out[a + n + ".weight"] = ((P, 1, cfg.short_conv_kernel_size), F32)
            out[a + "A_log"] = ((cfg.kda_num_heads,), F32)
            out[a + "dt_bias"] = ((P,), F32)
            out[a + "o_norm.weight"] = ((d,), BF16)
            out[a + "o_proj.weight"] = ((H, P), BF16)
        else:
            out[a + "q_a_proj.weight"] = ((cfg.q_lora_rank, H), BF16)
            out[a + "kv_a_proj_with_mqa.weight"] = ((cfg.kv_lora_rank + dr, H), BF16)
            out[a + "g_proj.weight"] = ((nh * dv, H), BF16)
            out[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), BF16)
            out[a + "q_b_proj.weight"] = ((nh * (dn + dr), cfg.q_lora_rank), BF16)
            out[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), BF16)
            out[a + "kv_b_proj.weight"] = ((nh * (dn + dv), cfg.kv_lora_rank), BF16)
            out[a + "o_proj.weight"] = ((H, nh * dv), BF16)
        if cfg.mlp_kind(i) == "dense":
            out[p + "mlp.gate_proj.weight"] = ((cfg.intermediate_size, H), BF16)
            out[p + "mlp.up_proj.weight"] = ((cfg.intermediate_size, H), BF16)
            out[p + "mlp.down_proj.weight"] = ((H, cfg.intermediate_size), BF16)
        else:
            b = p + "block_sparse_moe."
            E, L, I, Is = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate
            out[b + "gate.weight"] = ((E, H), BF16)
            out[b + "gate.e_score_correction_bias"] = ((E,), F32)
            out[b + "routed_expert_down_proj.weight"] = ((L, H), BF16)
            out[b + "routed_expert_norm.weight"] = ((L,), BF16)
            out[b + "routed_expert_up_proj.weight"] = ((H, L), BF16)
            out[b + "shared_experts.gate_proj.weight"] = ((Is, H), BF16)
            out[b + "shared_experts.up_proj.weight"] = ((Is, H), BF16)
            out[b + "shared_experts.down_proj.weight"] = ((H, Is), BF16)
            for e in range(E):
                out[f"{b}experts.{e}.w1.weight"] = ((I, L), BF16)
                out[f"{b}experts.{e}.w3.weight"] = ((I, L), BF16)
                out[f"{b}experts.{e}.w2.weight"] = ((L, I), BF16)
    return out


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _init_kind(name: str) -> str:
    if name.endswith("A_log"):
        return "a_log"
    if name.endswith("dt_bias"):
        return "dt_bias"
    if "conv1d" in name:
        return "conv"
    if name.endswith("e_score_correction_bias"):
        return "router_bias"
    if "embed_tokens" in name:
        return "embed"
    if name.endswith("_res_proj.weight"):
        return "res_proj"
    if "norm" in name:
        return "norm"
    return "linear"


class TensorSource:
    """Full checkpoint tensors by name; `get` may slice rows/columns before materializing."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        raise NotImplementedError

    def get(self, name: str, rows: Slice = None, cols: Slice = None) -> torch.Tensor:
        raise NotImplementedError


class RandomSource(TensorSource):
    """Seeded random checkpoint at realistic scales: linears N(0, 1/fan_in), norms ≈ 1."""

    def __init__(self, cfg: K3TextConfig, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self._shapes = expected_shapes(cfg)

    def shape(self, name: str) -> tuple[int, ...] | None:
        s = self._shapes.get(name)
        return None if s is None else s[0]

    def _spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self._shapes:
            raise WeightError(f"random checkpoint has no tensor {name}")
        return self._shapes[name]

    def get(self, name: str, rows: Slice = None, cols: Slice = None) -> torch.Tensor:
        shape, dtype = self._spec(name)
        g = torch.Generator().manual_seed(_seed_of(self.seed, name))
        return _slice(_draw(_init_kind(name), shape, shape, g, "cpu"), rows, cols).to(dtype)


class ShardRandomSource(RandomSource):
    """`RandomSource`'s scales, drawn slice by slice on `device`: only what a rank loads is ever
    materialized, so a K3 shard with all 896 experts builds in seconds on a GPU (the whole
    checkpoint never exists). Its values differ from `RandomSource`'s; a slice's values depend
    on (seed, name, slice), so two loads of one rank agree."""

    def __init__(self, cfg: K3TextConfig, seed: int = 0, device: torch.device | str = "cuda"):
        super().__init__(cfg, seed)
        self.device = torch.device(device)

    def get(self, name: str, rows: Slice = None, cols: Slice = None) -> torch.Tensor:
        shape, dtype = self._spec(name)
        out = list(shape)
        if rows:
            out[0] = rows[1] - rows[0]
        if cols:
            out[1] = cols[1] - cols[0]
        g = torch.Generator(self.device).manual_seed(_seed_of(self.seed, f"{name}:{rows}:{cols}"))
        return _draw(_init_kind(name), shape, tuple(out), g, self.device).to(dtype)


def _draw(kind: str, full: tuple[int, ...], shape: tuple[int, ...], g: torch.Generator,
          device: torch.device | str) -> torch.Tensor:
    """Random values of one init kind; fan-in scales use the full tensor's last dimension."""
    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device)
    if kind == "a_log":
        return torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g))
    if kind == "dt_bias":
        return 0.5 * randn()
    if kind == "router_bias":
        return 0.02 * randn()
    if kind == "embed":
        return randn()
    if kind == "norm":
        return 1.0 + 0.1 * randn()
    if kind == "res_proj":
        return randn() * (2.0 / math.sqrt(full[-1]))
    return randn() / math.sqrt(full[-1])  # linear and conv: N(0, 1/fan_in)


class SafetensorsSource(TensorSource):
    """HF safetensors shards (a file, or a directory with *.safetensors), read lazily."""

    def __init__(self, path: str | Path):
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.exists() for f in files):
            raise WeightError(f"{path}: no .safetensors files found")
        self._handles = []
        for f in files:
            try:
                self._handles.append(safe_open(str(f), framework="pt"))
            except (SafetensorError, OSError) as e:  # a text file, a truncated download, no access
                raise WeightError(f"{f}: not a readable safetensors file ({e}); give a .safetensors "
                                  "checkpoint file, or a directory of them (HF shards)") from None
        self._where: dict[str, object] = {}
        for h in self._handles:
            for k in h.keys():
                self._where[_canonical(k)] = (h, k)

    def shape(self, name: str) -> tuple[int, ...] | None:
        hit = self._where.get(name)
        if hit is None:
            return None
        h, k = hit
        return tuple(h.get_slice(k).get_shape())

    def get(self, name: str, rows: Slice = None, cols: Slice = None) -> torch.Tensor:
        h, k = self._where[name]
        sl = h.get_slice(k)
        r = slice(*rows) if rows else slice(None)
        if cols is None:
            return sl[r]
        return sl[r, slice(*cols)]


def _canonical(name: str) -> str:
    # vLLM's multimodal mapper: language_model.layers.N. -> language_model.model.layers.N.
    if name.startswith("language_model.layers."):
        return "language_model.model." + name[len("language_model."):]
    return name


def _slice(t: torch.Tensor, rows: Slice, cols: Slice) -> torch.Tensor:
    if rows:
        t = t[rows[0]:rows[1]]
    if cols:
        t = t[:, cols[0]:cols[1]]
    return t


# FP4 E2M1 magnitudes by code (bit 3 is the sign)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 → bf16: W[o, i] = fp4(nibble of packed[o, i // 2]) · 2^(scale[o, i // 32] − 127).

    Two values per byte along the input dim, the even index in the low nibble (the
    compressed-tensors convention; K3_MATH.md §7 marks the nibble order unverified).
    Every result is exact in bf16 (≤ 2 significant bits times a power of two).
    """
    table = torch.tensor(_FP4_VALUES + tuple(-v for v in _FP4_VALUES), dtype=torch.float32)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    exp = scale.to(torch.int64).repeat_interleave(MXFP4_GROUP, dim=1) - 127
    return (table[codes] * torch.exp2(exp.to(torch.float32))).to(BF16)


class _Reader:
    """Checks each tensor against the config's expected shape before slicing it."""

    def __init__(self, source: TensorSource, cfg: K3TextConfig, device: torch.device):
        self.src, self.expected, self.device = source, expected_shapes(cfg), device

    def __call__(self, name: str, rows: Slice = None, cols: Slice = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        want, default_dtype = self.expected[name]
        found = self.src.shape(name)
        if found is None:
            raise WeightError(f"missing tensor {name} (expected shape {list(want)})")
        if tuple(found) != tuple(want) and not _accepted_alias(name, found, want):
            raise WeightError(f"tensor {name} has shape {list(found)}, expected {list(want)}")
        t = self.src.get(name, rows, cols)
        return t.to(device=self.device, dtype=dtype or default_dtype).contiguous()

    def expert(self, name: str, rows: Slice = None, cols: Slice = None) -> torch.Tensor:
        """A routed-expert matrix stored as bf16 `.weight` or as MXFP4 `.weight_packed` + `.weight_scale`."""
        stem = name.removesuffix(".weight")
        if self.src.shape(name) is not None or self.src.shape(stem + ".weight_packed") is None:
            return self(name, rows, cols)
        (o, i), _ = self.expected[name]
        for suffix, want in ((".weight_packed", (o, i // 2)), (".weight_scale", (o, i // MXFP4_GROUP))):
            found = self.src.shape(stem + suffix)
            if found is None:
                raise WeightError(f"missing tensor {stem + suffix} (expected shape {list(want)}; "
                                  f"MXFP4 experts need both .weight_packed and .weight_scale)")
            if tuple(found) != want:
                raise WeightError(f"tensor {stem + suffix} has shape {list(found)}, expected {list(want)}")
        if cols and (cols[0] % MXFP4_GROUP or cols[1] % MXFP4_GROUP):
            raise WeightError(f"{name}: TP column slice {cols} does not align with MXFP4 groups of "
                              f"{MXFP4_GROUP}; choose a TP size whose per-rank width is a multiple of 32")
        pc = (cols[0] // 2, cols[1] // 2) if cols else None
        sc = (cols[0] // MXFP4_GROUP, cols[1] // MXFP4_GROUP) if cols else None
        w = dequant_mxfp4(self.src.get(stem + ".weight_packed", rows, pc), self.src.get(stem + ".weight_scale", rows, sc))
        return w.to(self.device).contiguous()


def _accepted_alias(name: str, found: Iterable[int], want: tuple[int, ...]) -> bool:
    found = tuple(found)
    if "conv1d" in name:  # [P, 4] is accepted as well as [P, 1, 4]
        return found == (want[0], want[2])
    if name.endswith("A_log"):  # legacy [1, 1, h, 1]
        return found == (1, 1, want[0], 1)
    return False


def load_rank(source: TensorSource, cfg: K3TextConfig, tp: int = 1, rank: int = 0,
              device: torch.device | str = "cpu") -> ModelWeights:
    """One rank's weights in vLLM's stock TP layout (K3_MATH.md §5.1)."""
    shard = cfg.shard(tp, rank)
    rd = _Reader(source, cfg, torch.device(device))
    m = "language_model.model."
    v0, v1 = shard.vocab_start, shard.vocab_start + shard.vocab
    embed = rd(m + "embed_tokens.weight", rows=(v0, v1))
    lm_name = m + "embed_tokens.weight" if cfg.tie_word_embeddings else "language_model.lm_head.weight"
    layers = [_load_layer(rd, cfg, shard, i) for i in range(cfg.num_hidden_layers)]
    return ModelWeights(
        embed=embed, lm_head=rd(lm_name, rows=(v0, v1)),
        final_norm=rd(m + "norm.weight"),
        out_res_norm=rd(m + "output_attn_res_norm.weight"),
        out_res_proj=rd(m + "output_attn_res_proj.weight").reshape(-1),
        layers=layers,
    )


def _load_layer(rd: _Reader, cfg: K3TextConfig, s: ShardShapes, i: int) -> LayerWeights:
    p = f"language_model.model.layers.{i}."
    ar = AttnResWeights(
        attn_norm=rd(p + "self_attention_res_norm.weight"),
        attn_proj=rd(p + "self_attention_res_proj.weight").reshape(-1),
        input_norm=rd(p + "input_layernorm.weight"),
        mlp_norm=rd(p + "mlp_res_norm.weight"),
        mlp_proj=rd(p + "mlp_res_proj.weight").reshape(-1),
        post_norm=rd(p + "post_attention_layernorm.weight"),
    )
    attn = _load_kda(rd, cfg, s, p + "self_attn.") if cfg.layer_kind(i) == "kda" else _load_mla(rd, cfg, s, p + "self_attn.")
    mlp = _load_dense(rd, s, p + "mlp.") if cfg.mlp_kind(i) == "dense" else _load_moe(rd, cfg, s, p + "block_sparse_moe.")
    return LayerWeights(attn_res=ar, attn=attn, mlp=mlp)


def _heads(s: ShardShapes, width: int) -> tuple[int, int]:
    return s.rank * width, (s.rank + 1) * width


def _load_kda(rd: _Reader, cfg: K3TextConfig, s: ShardShapes, a: str) -> KDAWeights:
    hs = _heads(s, s.kda_proj)
    parts = [rd(a + n + ".weight", rows=hs) for n in ("q_proj", "k_proj", "v_proj", "g_proj")]
    parts.append(rd(a + "f_a_proj.weight"))  # replicated on every rank
    parts.append(rd(a + "b_proj.weight", rows=_heads(s, s.kda_heads)))
    in_proj = torch.cat(parts)
    pad = s.kda_in_rows - in_proj.shape[0]
    in_proj = torch.cat([in_proj, in_proj.new_zeros(pad, in_proj.shape[1])])
    conv = torch.cat([rd(a + n + ".weight", rows=hs).reshape(s.kda_proj, -1)
                      for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    a_log = rd(a + "A_log").reshape(-1)[s.rank * s.kda_heads:(s.rank + 1) * s.kda_heads].contiguous()
    return KDAWeights(
        in_proj=in_proj, f_b=rd(a + "f_b_proj.weight", rows=hs), conv=conv, A_log=a_log,
        dt_bias=rd(a + "dt_bias", rows=hs), o_norm=rd(a + "o_norm.weight"),
        o_proj=rd(a + "o_proj.weight", cols=hs),
    )


def _load_mla(rd: _Reader, cfg: K3TextConfig, s: ShardShapes, a: str) -> MLAWeights:
    g_rows = _heads(s, s.mla_o_in)
    fused = torch.cat([rd(a + "q_a_proj.weight"), rd(a + "kv_a_proj_with_mqa.weight"),
                       rd(a + "g_proj.weight", rows=g_rows)])
    return MLAWeights(
        fused_a=fused, q_a_norm=rd(a + "q_a_layernorm.weight"), kv_a_norm=rd(a + "kv_a_layernorm.weight"),
        q_b=rd(a + "q_b_proj.weight", rows=_heads(s, s.mla_q_b_rows)),
        kv_b=rd(a + "kv_b_proj.weight", rows=_heads(s, s.mla_kv_b_rows)),
        o_proj=rd(a + "o_proj.weight", cols=g_rows),
    )


def _load_dense(rd: _Reader, s: ShardShapes, p: str) -> DenseMLPWeights:
    r = _heads(s, s.dense_inter)
    return DenseMLPWeights(
        gate_up=torch.cat([rd(p + "gate_proj.weight", rows=r), rd(p + "up_proj.weight", rows=r)]),
        down=rd(p + "down_proj.weight", cols=r),
    )


def _load_moe(rd: _Reader, cfg: K3TextConfig, s: ShardShapes, b: str) -> MoEWeights:
    r = _heads(s, s.moe_inter_real)
    pad = s.moe_inter - s.moe_inter_real  # TP16: 192 real rows padded with zeros to 256

    def padded_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    w13, w2 = [], []
    for e in range(cfg.num_experts):
        gate = padded_rows(rd.expert(f"{b}experts.{e}.w1.weight", rows=r))
        up = padded_rows(rd.expert(f"{b}experts.{e}.w3.weight", rows=r))
        w13.append(torch.cat([gate, up]))
        down = rd.expert(f"{b}experts.{e}.w2.weight", cols=r)
        w2.append(torch.cat([down, down.new_zeros(down.shape[0], pad)], dim=1) if pad else down)
    sr = _heads(s, s.shared_inter)
    return MoEWeights(
        router=rd(b + "gate.weight"), bias=rd(b + "gate.e_score_correction_bias"),
        latent_down=rd(b + "routed_expert_down_proj.weight"),
        latent_norm=rd(b + "routed_expert_norm.weight"),
        latent_up=rd(b + "routed_expert_up_proj.weight"),
        w13=torch.stack(w13), w2=torch.stack(w2),
        shared_gate_up=torch.cat([rd(b + "shared_experts.gate_proj.weight", rows=sr),
                                  rd(b + "shared_experts.up_proj.weight", rows=sr)]),
        shared_down=rd(b + "shared_experts.down_proj.weight", cols=sr),
    )


def save_checkpoint(source: TensorSource, cfg: K3TextConfig, out_dir: str | Path) -> Path:
    """Write a whole (small) checkpoint as one safetensors file plus its config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: source.get(n).contiguous() for n in expected_shapes(cfg)}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": cfg.to_hf_dict()}, indent=1))
    return out
