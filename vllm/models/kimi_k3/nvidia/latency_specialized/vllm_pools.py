"""vLLM 0.33.0's per-layer decode state as the executor's pools (issue 13's binding).

vLLM binds each attention layer's cache to the layer's module in the static forward context
(`vllm_config.compilation_config.static_forward_context[prefix].kv_cache[0]`, one entry per
virtual engine) before it warms up and captures its graphs. `pools_from_forward_context` reads
them into the `(kda, mla)` pools that `SpecializedDecode(pools=...)` adopts, no copy:

| layer | vLLM's `kv_cache[0]` | pool |
| --- | --- | --- |
| KDA | `(conv [blocks, 3 + num_spec, 3P] bf16, recurrent [blocks, h, 128, 128] fp32)`, views into one page per block | `KDALayerState(rec=recurrent, conv=conv)` |
| MLA | `[blocks, block_size, 576]` bf16 | `MLALayerState(cache)` |

The layer index comes from the `model.layers.<i>.` part of the module's prefix (MTP layers sit
elsewhere or past the decoder's count, and are skipped); what each pool must look like
(shapes, dtypes, a contiguous slot) is `DecodeState`'s to check when it adopts them.
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


def _layer_caches(static_forward_context: Mapping[str, Any], cfg: K3TextConfig) -> dict[int, tuple[str, Any]]:
    """Decoder layer index -> (module prefix, its bound cache) for every decoder layer."""
    found: dict[int, tuple[str, Any]] = {}
    for prefix, module in static_forward_context.items():
        match = LAYER_INDEX.search(prefix)
        if match is None or int(match.group(1)) >= cfg.num_hidden_layers:
            continue
        caches = getattr(module, "kv_cache", None)
        if not caches:
            raise CachesNotBound(f"{prefix}: vLLM has bound no cache to this layer yet; build the executor after "
                             "vLLM allocated its KV cache (its first warm-up forward), not before")
        found[int(match.group(1))] = (prefix, caches[0])
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
            if not (isinstance(cache, (list, tuple)) and len(cache) == 2):
                raise PoolsError(f"{prefix}: a KDA layer's cache must be (conv state, recurrent state), got "
                                 f"{type(cache).__name__}")
            conv, rec = cache
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
