"""K3TextConfig: HF parsing, validation errors naming the field, presets, per-rank shapes."""

import json

import pytest

from vllm.models.kimi_k3.nvidia.latency_specialized.config import (ConfigError, K3TextConfig,
                                                                    preset)


def test_k3_preset_matches_the_spec():
    c = preset("k3")
    assert c.num_hidden_layers == 93 and len(c.kda_layers) == 69 and len(c.full_attn_layers) == 24
    assert [c.layer_kind(i) for i in range(0, 93, 12)] == ["kda"] * 8  # block-write layers
    assert c.mlp_kind(0) == "dense" and all(c.mlp_kind(i) == "moe" for i in range(1, 93))
    assert c.num_attn_res_blocks == 8
    # per-rank shapes of K3_MATH.md §3.4-3.6 and §5.2
    s8, s16 = c.shard(8, 0), c.shard(16, 15)
    assert (s8.kda_in_rows, s16.kda_in_rows) == (6288, 3216)
    assert (s8.mla_fused_a_rows, s16.mla_fused_a_rows) == (3648, 2880)
    assert (s8.moe_inter, s16.moe_inter, s16.moe_inter_real) == (384, 256, 192)
    assert (s8.shared_inter, s8.dense_inter, s16.dense_inter) == (768, 4224, 2112)
    assert (s16.vocab, s16.vocab_start) == (10240, 15 * 10240)
    for tp in (1, 2, 4, 8, 16):
        assert c.shard(tp, tp - 1).kda_heads * tp == 96


def test_reads_nested_k3_and_bare_kimi_linear(tmp_path):
    c = preset("mini")
    bare = c.to_hf_dict()
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(bare))
    nested = {"model_type": "kimi_k3", "vision_config": {"hidden_size": 1}, "text_config": bare}
    (tmp_path / "k3.json").write_text(json.dumps(nested))
    assert K3TextConfig.from_json(tmp_path / "bare") == c
    assert K3TextConfig.from_json(tmp_path / "k3.json") == c


def _bad(**changes):
    d = preset("mini").to_hf_dict()
    lin = changes.pop("lin", {})
    d.update(changes)
    d["linear_attn_config"].update(lin)
    return d


@pytest.mark.parametrize("raw, message", [
    (_bad(lin={"kda_layers": [1, 2, 4]}), r"layers \[5\] \(1-based\) are in neither"),
    (_bad(lin={"kda_layers": [1, 2, 3, 4, 5]}), r"layers \[3\] are listed as both KDA and MLA"),
    (_bad(lin={"full_attn_layers": [3, 7]}), r"outside 1..6"),
    (_bad(lin={"kda_layers": "1,2"}), r"kda_layers must be a list"),
    (_bad(hidden_act="gelu"), r"hidden_act: must be 'situ' or 'silu'"),
    (_bad(moe_router_activation_func="relu"), r"moe_router_activation_func"),
    (_bad(lin={"gate_lower_bound": -7.0}), r"gate_lower_bound: must be null or in \[-5, 0\)"),
    (_bad(num_experts_per_token=99), r"num_experts_per_token: must be in \[1, num_experts=8\]"),
    (_bad(mla_use_nope=False), r"mla_use_nope"),
    (_bad(lin={"short_conv_kernel_size": 3}), r"short_conv_kernel_size: only 4"),
])
def test_invalid_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        K3TextConfig.from_dict(raw)


def test_missing_linear_attn_config_and_bad_files(tmp_path):
    d = preset("mini").to_hf_dict()
    del d["linear_attn_config"]
    with pytest.raises(ConfigError, match="linear_attn_config' is missing"):
        K3TextConfig.from_dict(d)
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3TextConfig.from_json(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="no such config file"):
        K3TextConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="unknown config 'k4'"):
        preset("k4")


@pytest.mark.parametrize("name", ["/tmp/nonexistent-k3/config.json", "missing.json", "configs/k3"])
def test_a_config_path_that_does_not_exist_says_no_such_file(name):
    """Not "unknown config ... or a path to a config.json", which reads as if the path form were wrong."""
    with pytest.raises(ConfigError) as info:
        preset(name)
    assert str(info.value).startswith(f"config {name!r}: no such file or directory; give the path of an "
                                      "existing config.json"), str(info.value)


def test_tp_that_does_not_divide_heads_is_refused():
    with pytest.raises(ConfigError, match=r"num_heads = 4 is not divisible by tensor_parallel_size 8"):
        preset("mini").shard(8, 0)
    with pytest.raises(ConfigError, match="rank 4 outside 0..3"):
        preset("mini").shard(4, 4)
    with pytest.raises(ConfigError, match="num_attention_heads = 96 is not divisible by tensor_parallel_size 5"):
        preset("k3").replace(kda_num_heads=100).shard(5, 0)
