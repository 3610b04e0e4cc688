"""A decode step's `StepMeta` from vLLM 0.33.0's attention metadata (issue 13's binding).

Under vLLM the executor's graph inputs come from vLLM's per-step tensors instead of our
`Segment`s. `VllmDecodeStep.from_forward_context` picks them out of
`get_forward_context().attn_metadata`; `fill_step_meta` writes them into a `StepMeta` with
device-side torch ops only (no host reads), so it can run inside vLLM's FULL CUDA-graph capture.

| `StepMeta` field | vLLM source | rule |
| --- | --- | --- |
| `rec_slots [R, q]` | KDA `spec_state_indices_tensor [B, q]` (verify) or `non_spec_state_indices_tensor [B]` (q = 1) | the state after token t goes to column t (`fused_recurrent_kda`) |
| `accepted [R]` | KDA `num_accepted_tokens` (verify), else 1 | |
| `rec_read_slot [R]` | `rec_slots[r, accepted − 1]` | `fused_recurrent_kda`'s initial state index |
| `conv_slot [R]` | `rec_slots[r, 0]` | `causal_conv1d_update`'s `conv_state_indices` |
| `block_table`, `seq_lens` | MLA `decode.block_table`, `decode.seq_lens` (cached tokens after this step's) | columns past vLLM's: block 0 |
| `cache_index [rows]` | the forward context's `slot_mapping[mla_layer]` (flat cache row per token), else the MLA metadata's | |
| `ids [rows]` | `input_ids` | |
| `embeds [rows, H]` | `inputs_embeds` (vLLM's multimodal runner embeds the tokens itself) | executors built with `inputs="embeddings"` |

A request whose KDA state index is ≤ 0 is padding (vLLM's KDA kernels skip it, its
`slot_mapping` rows are −1), as are the bucket's requests past vLLM's B: it gets our padding
(`StepMeta.padding`): slots 0, block table 0, `seq_lens` q, `accepted` 1, token 0, and its
rows write distinct rows of the null block 0, so no real request's state is touched.

Cost: about fifteen small torch ops per step (a few µs each in a graph); not yet measured, and
one fused kernel would replace them if the profile of a served step shows it matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .executor import ExecutorError, StepMeta


@dataclass
class VllmDecodeStep:
    """The tensors of one pure decode (q = 1) or uniform verify (q > 1) step, as vLLM holds them."""

    input_ids: torch.Tensor | None  # [>= B·q] token ids (vLLM pads to its graph size); None with inputs_embeds
    state_indices: torch.Tensor  # [B] (q = 1) or [B, q] KDA state slots, ≤ 0 for padding
    num_accepted: torch.Tensor | None  # [B] tokens accepted by each request's last verify step; None: 1
    block_table: torch.Tensor  # [B, blocks] MLA blocks of each request
    seq_lens: torch.Tensor  # [B] cached tokens after this step's
    slot_mapping: torch.Tensor  # [>= B·q] flat MLA cache row of each token, −1 for padding
    inputs_embeds: torch.Tensor | None = None  # [>= B·q, H] when vLLM embedded the tokens itself

    @classmethod
    def from_forward_context(cls, attn_metadata: Mapping[str, Any], kda_layer: str, mla_layer: str,
                             input_ids: torch.Tensor | None, slot_mapping: Mapping[str, torch.Tensor] | None = None,
                             inputs_embeds: torch.Tensor | None = None) -> VllmDecodeStep:
        """The step from `get_forward_context().attn_metadata`, keyed by layer prefix: `kda_layer` names
        a KDA layer (GDN metadata), `mla_layer` an MLA layer (MLA common metadata with `.decode`).
        `slot_mapping` is `get_forward_context().slot_mapping`: vLLM 0.33.0's MLA cache write reads the
        layer's entry there; the metadata's own `slot_mapping` is used where it has none."""
        kda, mla = attn_metadata.get(kda_layer), attn_metadata.get(mla_layer)
        if kda is None or mla is None or getattr(mla, "decode", None) is None:
            missing = [n for n, md in ((kda_layer, kda), (mla_layer, mla)) if md is None]
            raise ExecutorError(f"no decode metadata for layer(s) {missing or [mla_layer + '.decode']} in this "
                                "step; only pure decode and uniform verify steps reach the executor")
        spec = kda.spec_state_indices_tensor if kda.num_spec_decodes else None
        if spec is not None and kda.num_decodes:
            raise ExecutorError("a step mixing plain decode and verify requests is not a uniform step")
        return cls(input_ids=input_ids,
                   state_indices=spec if spec is not None else kda.non_spec_state_indices_tensor,
                   num_accepted=kda.num_accepted_tokens if spec is not None else None,
                   block_table=mla.decode.block_table, seq_lens=mla.decode.seq_lens,
                   slot_mapping=(slot_mapping or {}).get(mla_layer, mla.slot_mapping), inputs_embeds=inputs_embeds)


def fill_step_meta(meta: StepMeta, step: VllmDecodeStep) -> None:
    """Write `step` into `meta`'s buffers in place (the graph inputs); host-side checks of shapes only."""
    q, rows, requests = meta.q, meta.ids.shape[0], meta.requests
    slots = step.state_indices if step.state_indices.dim() == 2 else step.state_indices[:, None]
    b = slots.shape[0]
    if slots.shape[1] != q:
        raise ExecutorError(f"vLLM's KDA state indices have {slots.shape[1]} columns but this bucket serves "
                            f"{q} tokens per request")
    if b > requests:
        raise ExecutorError(f"vLLM's step has {b} requests but the bucket holds {requests}; pick a larger bucket")
    if step.block_table.shape[0] < b or step.block_table.shape[1] > meta.block_table.shape[1]:
        raise ExecutorError(f"vLLM's MLA block table is {tuple(step.block_table.shape)} for {b} requests but the "
                            f"executor's holds {meta.block_table.shape[1]} blocks per request: build it with "
                            "max_len >= vLLM's max_model_len and vLLM's block size")
    tokens = step.input_ids if step.inputs_embeds is None else step.inputs_embeds
    if tokens is None or step.seq_lens.shape[0] < b or step.slot_mapping.shape[0] < b * q or tokens.shape[0] < b * q:
        raise ExecutorError(f"vLLM's seq_lens / slot_mapping / input_ids are shorter than {b} requests of {q} tokens")
    if step.num_accepted is not None and step.num_accepted.shape[0] < b:
        raise ExecutorError(f"vLLM's num_accepted_tokens has {step.num_accepted.shape[0]} entries for {b} requests")
    brings = "token ids" if step.inputs_embeds is None else "embeddings"
    built = "token ids" if meta.embeds is None else "embeddings"
    if brings != built:
        raise ExecutorError(f"the step brings {brings} but the executor was built for {built}; build it with "
                            "the inputs vLLM passes")
    if step.inputs_embeds is not None and step.inputs_embeds.shape[1:] != meta.embeds.shape[1:]:
        raise ExecutorError(f"vLLM's inputs_embeds is {tuple(step.inputs_embeds.shape)}; the model's rows are "
                            f"{meta.embeds.shape[1]} wide")

    device = meta.ids.device
    real = torch.zeros(requests, dtype=torch.bool, device=device)
    real[:b] = slots[:, 0] > 0
    real_rows = real.repeat_interleave(q)
    accepted = None if step.num_accepted is None else step.num_accepted[:b].clamp(1, q)  # a valid gather index
    _fill(meta.rec_slots, slots.clamp_min(0), real[:, None], 0)
    _fill(meta.accepted, accepted, real, 1)
    meta.rec_read_slot.copy_(meta.rec_slots.gather(1, (meta.accepted - 1).long()[:, None])[:, 0])
    meta.conv_slot.copy_(meta.rec_slots[:, 0])
    _fill(meta.block_table, step.block_table[:b], real[:, None], 0)
    _fill(meta.seq_lens, step.seq_lens[:b], real, q)
    _fill(meta.cache_index, step.slot_mapping[:b * q], real_rows,
          torch.arange(rows, dtype=torch.int64, device=device))  # distinct rows of the null block 0
    if step.inputs_embeds is not None:
        _fill(meta.embeds, step.inputs_embeds[:b * q], real_rows[:, None], 0)
    else:
        _fill(meta.ids, step.input_ids[:b * q], real_rows, 0)


def _fill(buf: torch.Tensor, src: torch.Tensor | None, keep: torch.Tensor, pad: int | torch.Tensor) -> None:
    """buf ← src (which covers buf's leading rows and columns) where `keep`, `pad` everywhere else."""
    staged = pad.clone() if isinstance(pad, torch.Tensor) else torch.full_like(buf, pad)
    if src is not None:
        staged[tuple(slice(0, n) for n in src.shape)] = src
    buf.copy_(torch.where(keep, staged, pad))
