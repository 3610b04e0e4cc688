"""Checkpoint loading: real names, safetensors round trip, TP slicing, clear errors."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import (RandomSource, SafetensorsSource,
                                                                     WeightError, expected_shapes,
                                                                     load_rank, save_checkpoint)

CFG = preset("mini")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(RandomSource(CFG, seed=3), CFG, tmp_path_factory.mktemp("ckpt"))


def _flat(w):
    out = {"embed": w.embed, "lm_head": w.lm_head, "final_norm": w.final_norm}
    for i, lw in enumerate(w.layers):
        for part in (lw.attn_res, lw.attn, lw.mlp):
            for k, t in part.tensors().items():
                out[f"{i}.{type(part).__name__}.{k}"] = t
    return out


def test_safetensors_round_trip_equals_random_source(ckpt):
    a = _flat(load_rank(RandomSource(CFG, seed=3), CFG, tp=2, rank=1))
    b = _flat(load_rank(SafetensorsSource(ckpt), CFG, tp=2, rank=1))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_tp_slices_partition_the_full_tensors():
    src = RandomSource(CFG, seed=1)
    full = load_rank(src, CFG, tp=1, rank=0)
    ranks = [load_rank(src, CFG, tp=4, rank=r) for r in range(4)]
    kda0 = full.layers[0].attn
    P = CFG.kda_proj
    q_full = kda0.in_proj[:P]
    q_ranks = torch.cat([r.layers[0].attn.in_proj[:P // 4] for r in ranks])
    assert torch.equal(q_full, q_ranks)
    fa = kda0.in_proj[4 * P:4 * P + CFG.kda_head_dim]
    for r in ranks:  # f_a is replicated on every rank, right after g_out
        s = r.layers[0].attn
        assert torch.equal(s.in_proj[P:P + CFG.kda_head_dim], fa)
        assert s.in_proj.shape[0] % 16 == 0
    o_ranks = torch.cat([r.layers[0].attn.o_proj for r in ranks], dim=1)
    assert torch.equal(o_ranks, kda0.o_proj)
    assert torch.equal(torch.cat([r.embed for r in ranks]), full.embed)


def test_expert_slices_are_zero_padded_to_the_minimum():
    cfg = CFG.replace(min_moe_intermediate_per_partition=16)
    s = cfg.shard(4, 2)
    assert (s.moe_inter_real, s.moe_inter) == (8, 16)
    w = load_rank(RandomSource(cfg), cfg, tp=4, rank=2)
    moe = w.layers[1].mlp
    assert moe.w13.shape == (cfg.num_experts, 32, cfg.routed_expert_hidden_size)
    assert not moe.w13[:, 8:16].any() and not moe.w13[:, 24:32].any()
    assert moe.w13[:, :8].abs().sum() > 0 and not moe.w2[:, :, 8:].any()
    src = RandomSource(cfg)
    assert torch.equal(moe.w13[3, :8], src.get("language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight")[16:24])


def test_missing_tensor_is_named(ckpt, tmp_path):
    t = load_file(str(ckpt / "model.safetensors"))
    name = "language_model.model.layers.2.self_attn.kv_b_proj.weight"
    del t[name]
    save_file(t, str(tmp_path / "m.safetensors"))
    with pytest.raises(WeightError, match=rf"missing tensor {name} \(expected shape \[128, 32\]\)"):
        load_rank(SafetensorsSource(tmp_path), CFG)


def test_misshaped_tensor_names_both_shapes(ckpt, tmp_path):
    t = load_file(str(ckpt / "model.safetensors"))
    name = "language_model.model.layers.1.block_sparse_moe.gate.weight"
    t[name] = t[name][:, :64].contiguous()
    save_file(t, str(tmp_path / "m.safetensors"))
    with pytest.raises(WeightError, match=rf"tensor {name} has shape \[8, 64\], expected \[8, 128\]"):
        load_rank(SafetensorsSource(tmp_path), CFG)


def test_multimodal_name_form_and_legacy_shapes_are_accepted(ckpt, tmp_path):
    t = load_file(str(ckpt / "model.safetensors"))
    renamed = {}
    for k, v in t.items():
        k2 = k.replace("language_model.model.layers.", "language_model.layers.")
        if k2.endswith("conv1d.weight"):
            v = v.reshape(v.shape[0], -1).contiguous()  # [P, 4] form
        if k2.endswith("A_log"):
            v = v.reshape(1, 1, -1, 1).contiguous()
        renamed[k2] = v
    save_file(renamed, str(tmp_path / "m.safetensors"))
    a = _flat(load_rank(SafetensorsSource(tmp_path), CFG))
    b = _flat(load_rank(SafetensorsSource(ckpt), CFG))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(WeightError, match="no .safetensors files found"):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("content", [b"not a checkpoint\n", b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_a_file_that_is_not_safetensors_is_a_weight_error_naming_it(tmp_path, content):
    """A text file, an empty file or a truncated one: safetensors' own error would reach the operator
    as a traceback."""
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(content)
    for given in (bad, tmp_path):  # the file itself, or the directory holding it
        with pytest.raises(WeightError, match=re.escape(f"{bad}: not a readable safetensors file") + ".*a directory of them"):
            SafetensorsSource(given)


def test_expected_shapes_cover_the_k3_checkpoint():
    shapes = expected_shapes(preset("k3"))
    assert shapes["language_model.model.layers.0.self_attn.q_proj.weight"][0] == (12288, 7168)
    assert shapes["language_model.model.layers.3.self_attn.kv_b_proj.weight"][0] == (24576, 512)
    assert shapes["language_model.model.layers.5.block_sparse_moe.experts.895.w2.weight"][0] == (3584, 3072)
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in shapes


def _fp4(code):  # E2M1 by hand: sign, 2 exponent bits (bias 1), 1 mantissa bit
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_mxfp4_dequant_by_hand():
    from vllm.models.kimi_k3.nvidia.latency_specialized.weights import dequant_mxfp4
    packed = torch.tensor([[0x21] + [0xF8] * 15], dtype=torch.uint8)  # 32 values in one group
    out = dequant_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))
    assert out[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]  # 0.5·2, 1·2, -0·2, -6·2
    assert [_fp4(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_mxfp4_experts_load_like_their_bf16_values(ckpt, tmp_path):
    t = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [n for n in t if ".experts." in n]:
        o, i = t[name].shape
        codes = torch.randint(0, 16, (o, i), generator=g)
        scale = torch.randint(120, 130, (o, i // 32), generator=g)
        t[name.replace(".weight", ".weight_packed")] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        t[name.replace(".weight", ".weight_scale")] = scale.to(torch.uint8)
        vals = torch.tensor([[_fp4(int(c)) for c in row] for row in codes])
        t[name] = (vals * 2.0 ** (scale.repeat_interleave(32, 1) - 127).float()).to(torch.bfloat16)
    bf16_dir, fp4_dir = tmp_path / "bf16", tmp_path / "fp4"
    bf16_dir.mkdir(), fp4_dir.mkdir()
    save_file({k: v for k, v in t.items() if "weight_packed" not in k and "weight_scale" not in k},
              str(bf16_dir / "m.safetensors"))
    save_file({k: v for k, v in t.items() if not (".experts." in k and k.endswith(".weight"))},
              str(fp4_dir / "m.safetensors"))
    a = _flat(load_rank(SafetensorsSource(bf16_dir), CFG))
    b = _flat(load_rank(SafetensorsSource(fp4_dir), CFG))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(WeightError, match="does not align with MXFP4 groups of 32"):
        load_rank(SafetensorsSource(fp4_dir), CFG, tp=2, rank=0)
