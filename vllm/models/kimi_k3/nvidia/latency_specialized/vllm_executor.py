"""`VllmExecutor`: the specialized executor over vLLM 0.33.0's caches, run from vLLM's step metadata.

| stage | what happens |
| --- | --- |
| `build` | once, after vLLM bound its caches and before it captures a graph (a warm-up forward): the pools are vLLM's caches (`vllm_pools`), no copy; the step starts from token ids or, as vLLM's multimodal runner passes them, embeddings; buckets (rows, 1) and, with speculative decoding, (rows, q) for the envelope's rows; no graphs of our own and hidden states out, since the step runs inside vLLM's FULL graph capture and vLLM's `compute_logits` applies the final norm |
| `run(key, ...)` | one admitted step: `vllm_step` writes vLLM's metadata into the bucket's `StepMeta` with device ops only, the step's kernels run, the hidden states of vLLM's rows come back |

Captured in vLLM's graph, both stages' device work replays on every later step of that size
with vLLM's persistent metadata buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..reference.model import ReferenceModel
from .decode_ops import DecodeOps
from .executor import SpecializedDecode
from .vllm_pools import PoolsError, metadata_layers, pools_from_forward_context
from .vllm_step import VllmDecodeStep, fill_step_meta


TABLE_TOKEN_ALIGNMENT = 128  # tokens: vLLM rounds a block table's width up to a multiple of this


def buckets_for(rows: Sequence[int], verify_tokens: int) -> list[tuple[int, int]]:
    """Plain decode buckets for every row count, and verify buckets where whole requests fit."""
    plain = [(r, 1) for r in rows]
    verify = [(r, verify_tokens) for r in rows if verify_tokens > 1 and r >= verify_tokens and r % verify_tokens == 0]
    return sorted(set(plain + verify))


@dataclass
class VllmExecutor:
    executor: SpecializedDecode
    kda_layer: str  # the attn_metadata keys a step is read from
    mla_layer: str

    @classmethod
    def build(cls, model: ReferenceModel, static_forward_context: Mapping[str, Any], *, max_model_len: int,
              rows: Sequence[int], verify_tokens: int, inputs: str = "ids",
              ops: DecodeOps | None = None, log: Callable[[str], None] | None = None) -> VllmExecutor:
        """The executor over the caches vLLM bound. The block size is the bound MLA view's: vLLM
        may split its cache blocks into smaller kernel blocks (its block tables then count those),
        so `cache_config.block_size` need not be what the caches and tables use."""
        buckets = buckets_for(rows, verify_tokens)
        pools = pools_from_forward_context(static_forward_context, model.cfg)
        if not pools[1]:
            raise PoolsError("no MLA layer among vLLM's caches: the block size is read from one")
        block_size = next(iter(pools[1].values())).cache.shape[1]
        # vLLM's block tables are max_model_len's blocks rounded up to whole 128-token spans
        # (`get_block_table_width`): ours are at least as wide
        span = math.lcm(TABLE_TOKEN_ALIGNMENT, block_size)
        max_len = -(-max_model_len // span) * span
        executor = SpecializedDecode(model, max_requests=max(r // q for r, q in buckets), max_len=max_len,
                                     buckets=buckets, ops=ops, graphs=False, block_size=block_size,
                                     output="hidden", inputs=inputs, pools=pools, log=log)
        return cls(executor, *metadata_layers(static_forward_context, model.cfg))

    def run(self, key: tuple[int, int], attn_metadata: Mapping[str, Any], input_ids: torch.Tensor | None,
            slot_mapping: Mapping[str, torch.Tensor] | None, rows: int,
            inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [rows, H] (before the final norm) of one admitted step of bucket `key`."""
        step = VllmDecodeStep.from_forward_context(attn_metadata, self.kda_layer, self.mla_layer, input_ids,
                                                   slot_mapping, inputs_embeds)
        fill_step_meta(self.executor.meta[key], step)
        return self.executor.replay(key)[:rows]
