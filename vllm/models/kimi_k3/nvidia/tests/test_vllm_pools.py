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


def _context(model):
    """vLLM's layout: KDA modules at `model.layers.<i>.self_attn` holding (conv, recurrent) page views,
    MLA ones one level deeper holding the cache; entries of other modules around them."""
    own = SpecializedDecode(model, max_requests=2, max_len=64, buckets=[(2, 1)], graphs=False, log=lambda _: None)
    (kda, mla), _ = paged_pools(own.state)
    ctx = {"model.embed_tokens": SimpleNamespace(), "mtp.layers.0.attn": SimpleNamespace(kv_cache=[torch.zeros(1)]),
           f"model.layers.{model.cfg.num_hidden_layers}.self_attn": SimpleNamespace(kv_cache=[torch.zeros(1)])}
    for i, st in kda.items():
        ctx[f"model.layers.{i}.self_attn"] = SimpleNamespace(kv_cache=[(st.conv, st.rec)])
    for i, st in mla.items():
        ctx[f"model.layers.{i}.self_attn.attn"] = SimpleNamespace(kv_cache=[st.cache])
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


@pytest.mark.parametrize("case, match", [
    ("unbound", r"model.layers.0.self_attn: vLLM has bound no cache to this layer yet"),
    ("kda_not_pair", r"a KDA layer's cache must be \(conv state, recurrent state\), got Tensor"),
    ("mla_pair", r"an MLA layer's cache must be one tensor, got tuple"),
    ("missing", r"no cache for decoder layer\(s\) \[1\]"),
])
def test_what_is_missing_or_malformed_is_named(model, case, match):
    ctx, kda, mla = _context(model)
    first_mla = min(mla)
    if case == "unbound":
        ctx["model.layers.0.self_attn"].kv_cache = []
    elif case == "kda_not_pair":
        ctx["model.layers.0.self_attn"].kv_cache = [kda[0].rec]
    elif case == "mla_pair":
        ctx[f"model.layers.{first_mla}.self_attn.attn"].kv_cache = [(mla[first_mla].cache,) * 2]
    else:
        del ctx["model.layers.1.self_attn"]
    with pytest.raises(PoolsError, match=match):
        pools_from_forward_context(ctx, model.cfg)
