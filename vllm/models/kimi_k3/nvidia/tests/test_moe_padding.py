"""moe_padding: MoE weights zero-padded to the kernels' granularity route and compute exactly as the
unpadded ones (the reference functions on both, so any difference is the padding's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.moe_padding import pad_moe
from vllm.models.kimi_k3.nvidia.reference import moe as ref_moe
from vllm.models.kimi_k3.nvidia.reference.ops import F32, linear
from vllm.models.kimi_k3.nvidia.tests._util import mini_model


@pytest.fixture(scope="module")
def mini():
    model = mini_model(seed=3)
    w = next(lw.mlp for lw in model.w.layers if isinstance(lw.mlp, ref_moe.MoEWeights))
    return model, w


def test_padding_reaches_the_kernels_granularity_and_k3_is_left_alone(mini):
    model, w = mini
    p = pad_moe(w)
    assert p.router.shape[0] == 32 and p.bias.shape == (32,) and torch.isneginf(p.bias[8:]).all()
    assert p.w13.shape == (8, 128, 128) and p.w2.shape == (8, 128, 64) and p.latent_down.shape[0] == 128
    assert pad_moe(p) is p  # already at the granularity: no copy


@pytest.mark.parametrize("kind", ["normal", "ties", "saturated"])
def test_padded_experts_are_never_chosen(mini, kind):
    model, w = mini
    cfg, p = model.cfg, pad_moe(w)
    g = torch.Generator().manual_seed(len(kind))
    v = (torch.randn(64, cfg.hidden_size, generator=g)).to(torch.bfloat16)
    logits = linear(v, w.router, out_dtype=F32)
    bias = w.bias
    if kind == "ties":  # every real key equal: the lowest indices win, never a padded one
        logits, bias = torch.zeros_like(logits), torch.zeros_like(bias)
    elif kind == "saturated":  # σ → 0 and a very negative bias: real keys far below σ(0) = 0.5
        logits, bias = torch.full_like(logits, -1e4), torch.full_like(bias, -1e30)
    padded = torch.cat([logits, torch.zeros(64, 24)], dim=1) if kind != "normal" else \
        linear(v, p.router, out_dtype=F32)
    want_w, want_ids = ref_moe.route(logits, bias, cfg)
    got_w, got_ids = ref_moe.route(padded, torch.cat([bias, p.bias[8:]]) if kind != "normal" else p.bias,
                                   cfg.replace(num_experts=32))
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_padded_experts_compute_the_unpadded_result(mini):
    model, w = mini
    cfg, p = model.cfg, pad_moe(w)
    g = torch.Generator().manual_seed(5)
    v = torch.randn(16, cfg.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = ref_moe.route(linear(v, w.router, out_dtype=F32), w.bias, cfg)
    want = ref_moe._routed_latent(w, cfg, model.shard, linear(v, w.latent_down), weights, ids)
    x_pad = linear(v, p.latent_down)
    got = ref_moe._routed_latent(p, cfg, dataclasses.replace(model.shard, moe_inter=64), x_pad, weights, ids)
    assert torch.equal(x_pad[:, 64:], torch.zeros_like(x_pad[:, 64:]))
    assert torch.equal(got[:, :64], want) and not got[:, 64:].any()


def test_expert_count_alone_is_padded():
    """40 experts with latent 128 and intermediate 64 (both already at the granularity) still need
    their router padded to 64 rows: the expert count alone decides that a copy is made."""
    model = mini_model(seed=3, num_experts=40, routed_expert_hidden_size=128, moe_intermediate_size=64)
    w = next(lw.mlp for lw in model.w.layers if isinstance(lw.mlp, ref_moe.MoEWeights))
    assert w.router.shape[0] == 40 and w.w13.shape == (40, 128, 128) and w.w2.shape == (40, 128, 64)
    p = pad_moe(w)
    assert p is not w and p.router.shape[0] == 64 and p.bias.shape == (64,)
    assert torch.equal(p.router[:40], w.router) and not p.router[40:].any() and torch.isneginf(p.bias[40:]).all()
    assert torch.equal(p.w13, w.w13) and torch.equal(p.w2, w.w2)  # nothing else grows
