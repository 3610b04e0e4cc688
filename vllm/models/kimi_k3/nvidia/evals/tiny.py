"""The `tiny` config: Kimi K3's architecture and per-head geometry at ~1.9 M parameters.

What is K3's and kept exactly (K3_MATH.md §1, §3):

| part | K3 | tiny |
| --- | --- | --- |
| KDA | 96 heads × 128, short conv 4, bounded gate lb = −5, full-rank output gate | 1 head × 128, same |
| MLA | 96 heads, NoPE, r_q 1536, r_kv 512, d_n 128 / d_r 64 / d_v 128, output gate | 1 head, r_q 32, r_kv 512, 128 / 64 / 128, same |
| MoE | latent 3584, 896 experts top-16 sigmoid, 2 shared, SiTU β 4 λ 25, latent norm | latent 64, 8 experts top-2 sigmoid, 1 shared, same |
| dense | layer 0, 33792 wide | layer 0, 128 wide |
| AttnRes | blocks of 12 over 93 layers | blocks of 4 over 8 layers |
| interleave | MLA every 4th layer (+ the last), block-write layers KDA | MLA at layers 3 and 7 (0-based); 0 and 4 (block writes) KDA |
| vocab | 163840 | 256 bytes + 4 specials = 260, padded to 320 (× 64) |

Size: 1,886,398 parameters, 3,792,888 bytes as the checkpoint stores them (bf16, with the
conv taps, A_log, dt_bias and router bias in fp32), under the 4 MB every tracked file may
take (each travels to the H200 with every run). The trained checkpoint, HF-style
`config.json` + `model.safetensors` with the real checkpoint's names, lives in `TINY_DIR`.
"""

from __future__ import annotations

from pathlib import Path

from ..latency_specialized.config import K3TextConfig, preset
from ..latency_specialized.tokenizer import ByteTokenizer

TINY_DIR = Path(__file__).resolve().parent / "tiny"
VOCAB_MULTIPLE = 64  # vLLM pads vocabularies to this unit


def _padded_vocab() -> int:
    n = ByteTokenizer.vocab_size
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


TINY = K3TextConfig(
    vocab_size=_padded_vocab(), hidden_size=128, num_hidden_layers=8, intermediate_size=128,
    first_k_dense_replace=1, rms_norm_eps=1e-5,
    num_attention_heads=1, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128,
    num_experts=8, num_experts_per_token=2, num_shared_experts=1,
    moe_intermediate_size=32, routed_expert_hidden_size=64, min_moe_intermediate_per_partition=32,
    attn_res_block_size=4,
    # 1-based, as in the HF file: MLA at 0-based layers 3 and 7
    kda_layers=(1, 2, 3, 5, 6, 7), full_attn_layers=(4, 8),
    kda_num_heads=1, kda_head_dim=128, gate_lower_bound=-5.0,
    max_position_embeddings=131072, name="tiny",
)


def has_checkpoint(folder: Path = TINY_DIR) -> bool:
    """Whether a trained checkpoint (config.json and model.safetensors) is in `folder`."""
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def shipped_weights(config: str) -> Path | None:
    """The shipped weights file for a config name: tiny's checkpoint once committed, else None."""
    return TINY_DIR / "model.safetensors" if config == "tiny" and has_checkpoint() else None


def config_named(name: str) -> K3TextConfig:
    """`tiny` (the shipped checkpoint's config.json once it exists, else `TINY`), a preset or a path."""
    if name == "tiny":
        return K3TextConfig.from_json(TINY_DIR) if has_checkpoint() else TINY
    return preset(name)
