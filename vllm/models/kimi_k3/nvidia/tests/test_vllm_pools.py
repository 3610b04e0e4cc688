"""`vllm_pools.pools_from_forward_context` on a stand-in for vLLM's static forward context (no vLLM
needed): every decoder layer's bound cache becomes the executor's pool, as the same tensors, and
what is missing or malformed is named."""

from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_pools import PoolsError, pools_from_forward_context

from ._util import mini_model, paged_pools


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


def _layer(kv_cache=None):
    """A cache-holding module as vLLM 0.33.0 binds it (`bind_kv_cache`); an unbound KDA one has no
    `kv_cache` at all."""
    layer = SimpleNamespace(bind_kv_cache=lambda _: None)
    if kv_cache is not None:
        layer.kv_cache = kv_cache
    return layer


def _context(model):
    """vLLM 0.33.0's layout: each decoder layer's attention module at `model.layers.<i>.self_attn`,
    a KDA one holding the tuple (conv, recurrent, ...) of page views, an MLA one the cache tensor;
    around them modules without a cache, among them the fused-MoE runners vLLM registers under the
    same layer prefix, and MTP layers."""
    own = SpecializedDecode(model, max_requests=2, max_len=64, buckets=[(2, 1)], graphs=False, log=lambda _: None)
    (kda, mla), _ = paged_pools(own.state)
    ctx = {"model.embed_tokens": SimpleNamespace(), "mtp.layers.0.attn": _layer(torch.ones(1)),
           f"model.layers.{model.cfg.num_hidden_layers}.self_attn": _layer(torch.ones(1))}
    for i, st in kda.items():
        ctx[f"model.layers.{i}.self_attn"] = _layer((st.conv, st.rec))
    for i, st in mla.items():
        ctx[f"model.layers.{i}.self_attn"] = _layer(st.cache)
    for i in range(model.cfg.num_hidden_layers):
        ctx[f"model.layers.{i}.block_sparse_moe.experts"] = SimpleNamespace()
    return ctx, kda, mla


def test_every_layer_cache_becomes_its_pool_without_a_copy(model):
    ctx, kda, mla = _context(model)
    pools = pools_from_forward_context(ctx, model.cfg)
    ex = SpecializedDecode(model, max_requests=2, max_len=64, buckets=[(2, 1)], graphs=False, pools=pools,
                           log=lambda _: None)
    assert ex.state.kda.keys() == kda.keys() and ex.state.mla.keys() == mla.keys()
    for i, st in kda.items():
        assert ex.state.kda[i].rec is st.rec and ex.state.kda[i].conv is st.conv
    for i, st in mla.items():
        assert ex.state.mla[i].cache is st.cache


def test_a_kda_cache_with_more_states_gives_its_first_two(model):
    """vLLM's KDA reads `kv_cache[:2]`: whatever follows (RecoverSSM's records) is not a pool."""
    ctx, kda, _ = _context(model)
    extra = torch.ones(3)
    ctx["model.layers.0.self_attn"].kv_cache = (kda[0].conv, kda[0].rec, extra)
    pools = pools_from_forward_context(ctx, model.cfg)
    assert pools[0][0].rec is kda[0].rec and pools[0][0].conv is kda[0].conv


@pytest.mark.parametrize("case, match", [
    ("unbound_kda", r"model.layers.0.self_attn: vLLM has bound no cache to this layer yet"),
    ("unbound_mla", r"self_attn: vLLM has bound no cache to this layer yet"),
    ("kda_not_pair", r"a KDA layer's cache must be \(conv state, recurrent state, ...\), got Tensor"),
    ("mla_pair", r"an MLA layer's cache must be one tensor, got tuple"),
    ("missing", r"no cache for decoder layer\(s\) \[1\]"),
    ("twice", r"both hold a cache of decoder layer 0"),
])
def test_what_is_missing_or_malformed_is_named(model, case, match):
    ctx, kda, mla = _context(model)
    first_mla = min(mla)
    if case == "unbound_kda":
        ctx["model.layers.0.self_attn"] = _layer()
    elif case == "unbound_mla":
        ctx[f"model.layers.{first_mla}.self_attn"].kv_cache = torch.tensor([])
    elif case == "kda_not_pair":
        ctx["model.layers.0.self_attn"].kv_cache = kda[0].rec
    elif case == "mla_pair":
        ctx[f"model.layers.{first_mla}.self_attn"].kv_cache = (mla[first_mla].cache,) * 2
    elif case == "twice":
        ctx["model.layers.0.self_attn.extra"] = _layer((kda[0].conv, kda[0].rec))
    else:
        del ctx["model.layers.1.self_attn"]
    with pytest.raises(PoolsError, match=match):
        pools_from_forward_context(ctx, model.cfg)
