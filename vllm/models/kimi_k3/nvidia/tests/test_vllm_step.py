"""`vllm_step`: a step as vLLM 0.33.0's metadata describes it fills the same `StepMeta` as the
same step described by our `Segment`s, on the device only, and bad shapes are refused by name."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import ExecutorError, StepMeta
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_step import VllmDecodeStep, fill_step_meta
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState
from vllm.models.kimi_k3.nvidia.tests._util import needs_vllm

CFG = preset("mini")
BLOCK = 16
VOCAB = CFG.vocab_size


def _state(requests: int, q: int) -> DecodeState:
    return DecodeState(CFG, CFG.shard(1, 0), max_requests=requests, max_len=256, max_q=q, block_size=BLOCK)


def _step(rng: random.Random, bucket_requests: int, q: int, vllm_requests: int):
    """A random step of real requests (random slots, lengths, accepted counts) followed by vLLM's own
    padding entries, both as our Segments (padding to the bucket) and as vLLM's tensors."""
    st = _state(bucket_requests + 2, q)
    slots = [st.allocate() for _ in range(bucket_requests + 2)]
    real = rng.randint(1, vllm_requests)
    chosen = rng.sample(slots, real)
    segments, ids = [], []
    indices, accepted, table, lens, mapping = [], [], [], [], []
    for b, r in enumerate(chosen):
        st.seq_lens[r] = rng.randint(1, 200)
        st.accepted[r] = rng.randint(1, q) if q > 1 else 1
        seg = st.segment(r, b * q, q, prefill=False)
        segments.append(seg)
        ids += [rng.randrange(VOCAB) for _ in range(q)]
        indices.append(seg.rec_slots)
        accepted.append(seg.accepted)
        table.append(seg.block_table)
        lens.append(seg.pos0 + q)
        bt = seg.block_table.tolist()
        mapping += [bt[p // BLOCK] * BLOCK + p % BLOCK for p in range(seg.pos0, seg.pos0 + q)]
    for b in range(real, vllm_requests):  # vLLM's padding: PAD_SLOT_ID -1, garbage elsewhere
        segments.append(st.padding(b * q, q))
        ids += [0] * q
        indices.append([-1] * q)
        accepted.append(rng.randint(1, q))
        table.append(torch.randint(1, 50, (st.blocks_per_req,), dtype=torch.int32))
        lens.append(rng.randint(0, 9))
        mapping += [-1] * q
    for b in range(vllm_requests, bucket_requests):
        segments.append(st.padding(b * q, q))
    ours = StepMeta.padding(bucket_requests * q, q, st.blocks_per_req, torch.device("cpu"))
    ours.fill(torch.tensor(ids), segments, BLOCK)
    extra = rng.randint(0, 3)  # vLLM's token buffers run past the step
    step = VllmDecodeStep(
        input_ids=torch.tensor(ids + [7] * extra),
        state_indices=torch.tensor(indices, dtype=torch.int32).squeeze(1) if q == 1 else torch.tensor(
            indices, dtype=torch.int32),  # vLLM's plain decode keeps a 1-D index per request
        num_accepted=None if q == 1 else torch.tensor(accepted, dtype=torch.int32),
        block_table=torch.stack(table).to(torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.tensor(mapping + [-1] * extra, dtype=torch.int64))
    return ours, step, st.blocks_per_req


@pytest.mark.parametrize("q", [1, 2, 4, 8])
def test_vllm_metadata_fills_the_meta_our_segments_fill(q):
    rng = random.Random(q)
    for _ in range(25):
        bucket = rng.randint(1, 8)
        ours, step, blocks = _step(rng, bucket, q, rng.randint(1, bucket))
        got = StepMeta.padding(bucket * q, q, blocks, torch.device("cpu"))
        for name in ("ids", "rec_slots", "rec_read_slot", "accepted", "block_table", "seq_lens", "cache_index"):
            getattr(got, name).fill_(-99)  # poison: every field must be written
        fill_step_meta(got, step)
        for name in ("ids", "rec_slots", "rec_read_slot", "accepted", "block_table", "seq_lens", "cache_index",
                     "query_start"):
            assert torch.equal(getattr(got, name), getattr(ours, name)), name
        # vLLM keeps a request's conv state in the block of its first recurrent slot; our DecodeState
        # keeps a separate conv pool, so only the rule is comparable
        assert torch.equal(got.conv_slot, got.rec_slots[:, 0])


def test_filling_reads_nothing_on_the_host():
    """On the meta device any host read (.item(), .tolist(), bool()) raises: the fill is capturable."""
    meta_dev = torch.device("meta")
    meta = StepMeta.padding(8, 4, 16, meta_dev)
    step = VllmDecodeStep(input_ids=torch.empty(8, dtype=torch.int64, device=meta_dev),
                          state_indices=torch.empty(2, 4, dtype=torch.int32, device=meta_dev),
                          num_accepted=torch.empty(2, dtype=torch.int32, device=meta_dev),
                          block_table=torch.empty(2, 16, dtype=torch.int32, device=meta_dev),
                          seq_lens=torch.empty(2, dtype=torch.int32, device=meta_dev),
                          slot_mapping=torch.empty(8, dtype=torch.int64, device=meta_dev))
    fill_step_meta(meta, step)


def _plain(requests: int, q: int, blocks: int) -> VllmDecodeStep:
    return VllmDecodeStep(input_ids=torch.zeros(requests * q, dtype=torch.int64),
                          state_indices=torch.ones(requests, q, dtype=torch.int32),
                          num_accepted=torch.ones(requests, dtype=torch.int32),
                          block_table=torch.zeros(requests, blocks, dtype=torch.int32),
                          seq_lens=torch.full((requests,), q, dtype=torch.int32),
                          slot_mapping=torch.zeros(requests * q, dtype=torch.int64))


@pytest.mark.parametrize("step, message", [
    (_plain(2, 2, 4), "columns but this bucket serves 4 tokens"),
    (_plain(3, 4, 4), "3 requests but the bucket holds 2"),
    (_plain(2, 4, 9), "max_len >= vLLM's max_model_len"),
    (dataclasses.replace(_plain(2, 4, 4), slot_mapping=torch.zeros(5, dtype=torch.int64)), "shorter than 2 requests"),
    (dataclasses.replace(_plain(2, 4, 4), inputs_embeds=torch.zeros(8, 64)),
     "the step brings embeddings but the executor was built for token ids"),
])
def test_steps_that_do_not_fit_the_bucket_are_refused_by_name(step, message):
    with pytest.raises(ExecutorError, match=message):
        fill_step_meta(StepMeta.padding(8, 4, 8, torch.device("cpu")), step)


def _kda(decodes=0, spec=0):
    return SimpleNamespace(num_decodes=decodes, num_spec_decodes=spec,
                           non_spec_state_indices_tensor=torch.tensor([3, 5]),
                           spec_state_indices_tensor=torch.tensor([[3, 4], [5, 6]]),
                           num_accepted_tokens=torch.tensor([1, 2]))


def _mla():
    return SimpleNamespace(decode=SimpleNamespace(block_table=torch.zeros(2, 4), seq_lens=torch.tensor([9, 4])),
                           slot_mapping=torch.tensor([1, 2, 3, 4]))


def test_the_step_is_read_from_the_forward_context_by_layer():
    ids = torch.tensor([1, 2, 3, 4])
    plain = VllmDecodeStep.from_forward_context({"kda.0": _kda(decodes=2), "mla.3": _mla()}, "kda.0", "mla.3", ids)
    assert plain.state_indices.tolist() == [3, 5] and plain.num_accepted is None
    verify = VllmDecodeStep.from_forward_context({"kda.0": _kda(spec=2), "mla.3": _mla()}, "kda.0", "mla.3", ids)
    assert verify.state_indices.tolist() == [[3, 4], [5, 6]] and verify.num_accepted.tolist() == [1, 2]
    assert verify.seq_lens.tolist() == [9, 4] and verify.slot_mapping.tolist() == [1, 2, 3, 4]
    per_layer = {"mla.3": torch.tensor([8, 7, 6, 5])}  # forward_context.slot_mapping, what the cache write reads
    assert VllmDecodeStep.from_forward_context({"kda.0": _kda(spec=2), "mla.3": _mla()}, "kda.0", "mla.3", ids,
                                               per_layer).slot_mapping.tolist() == [8, 7, 6, 5]
    with pytest.raises(ExecutorError, match="mixing plain decode and verify"):
        VllmDecodeStep.from_forward_context({"kda.0": _kda(decodes=1, spec=1), "mla.3": _mla()}, "kda.0", "mla.3",
                                            ids)
    with pytest.raises(ExecutorError, match=r"\['mla.3'\]"):
        VllmDecodeStep.from_forward_context({"kda.0": _kda(decodes=2)}, "kda.0", "mla.3", ids)


@needs_vllm
def test_the_fields_read_exist_in_vllms_metadata_classes():
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    def names(cls):
        return {f.name for f in dataclasses.fields(cls)}
    assert {"num_decodes", "num_spec_decodes", "spec_state_indices_tensor", "non_spec_state_indices_tensor",
            "num_accepted_tokens"} <= names(GDNAttentionMetadata)
    assert {"decode", "slot_mapping"} <= names(MLACommonMetadata)
    assert {"block_table", "seq_lens"} <= names(MLACommonDecodeMetadata)
