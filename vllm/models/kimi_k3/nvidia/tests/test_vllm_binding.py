"""The executor inside vLLM, short of vLLM itself (issue 13), on the CPU with the reference ops: over
pools laid out as vLLM 0.33.0 holds them (`vllm_pools`: a request's conv and recurrent state in
the page of one block, the latent cache in blocks of its block table) and with the step described
by vLLM's metadata (`vllm_step`), a decode step gives the hidden states and writes the state that
our own executor gives and writes for the same requests on its own pools."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_pools import pools_from_forward_context
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_step import VllmDecodeStep, fill_step_meta
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState

from ._util import mini_model, paged_pools, prefill

BLOCK, MAX_LEN, REQUESTS, VLLM_BLOCKS = 16, 64, 2, 24


def _vllm_caches(model):
    """vLLM-style caches for `model` (VLLM_BLOCKS blocks, NaN-filled), as its static forward context."""
    blank = DecodeState(model.cfg, model.shard, max_requests=VLLM_BLOCKS - 1, max_len=BLOCK, block_size=BLOCK)
    (kda, mla), _ = paged_pools(blank)
    for st in kda.values():
        st.rec.fill_(float("nan"))
        st.conv.fill_(float("nan"))
    for st in mla.values():
        st.cache.fill_(float("nan"))
    ctx = {f"model.layers.{i}.self_attn": SimpleNamespace(kv_cache=[(st.conv, st.rec)]) for i, st in kda.items()}
    ctx |= {f"model.layers.{i}.self_attn.attn": SimpleNamespace(kv_cache=[st.cache]) for i, st in mla.items()}
    return ctx, kda, mla


def test_a_decode_step_on_vllms_pools_and_metadata_equals_ours():
    model, rng = mini_model(seed=0), random.Random(0)
    kw = {"max_requests": REQUESTS, "max_len": MAX_LEN, "buckets": [(REQUESTS, 1)], "graphs": False,
          "block_size": BLOCK, "output": "hidden", "log": lambda _: None}
    own = SpecializedDecode(model, **kw)
    slots = prefill(model, own.state, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21]])
    ctx, kda, mla = _vllm_caches(model)
    vllm_ex = SpecializedDecode(model, **kw, pools=pools_from_forward_context(ctx, model.cfg))

    # place each request where vLLM would: its state in one block's page, its tokens in its own blocks
    free = rng.sample(range(1, VLLM_BLOCKS), VLLM_BLOCKS - 1)
    bpr = vllm_ex.state.blocks_per_req
    state_block = [free.pop() for _ in slots]
    tables = [[free.pop() for _ in range(-(-(own.state.seq_lens[r] + 1) // BLOCK))] for r in slots]
    for b, r in enumerate(slots):
        for i, st in kda.items():
            st.conv[state_block[b]] = own.state.kda[i].conv[own.state.conv_slot(r)]
            st.rec[state_block[b]] = own.state.kda[i].rec[own.state.rec_slot(r, 0)]
        for p in range(own.state.seq_lens[r]):
            for i, st in mla.items():
                st.cache[tables[b][p // BLOCK], p % BLOCK] = own.state.mla[i].cache[own.state.block_table[r, p // BLOCK],
                                                                                   p % BLOCK]
    ids = torch.tensor([33, 44])
    pos = [own.state.seq_lens[r] for r in slots]
    want = own(ids, [own.state.segment(r, b, 1, prefill=False) for b, r in enumerate(slots)], own.state)

    step = VllmDecodeStep(
        input_ids=ids, state_indices=torch.tensor(state_block, dtype=torch.int32), num_accepted=None,
        block_table=torch.tensor([t + [0] * (bpr - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32),
        slot_mapping=torch.tensor([tables[b][p // BLOCK] * BLOCK + p % BLOCK for b, p in enumerate(pos)]))
    fill_step_meta(vllm_ex.meta[(REQUESTS, 1)], step)
    got = vllm_ex.replay((REQUESTS, 1))[:REQUESTS]

    assert got.shape == (REQUESTS, model.cfg.hidden_size) and torch.equal(got, want)
    for b, r in enumerate(slots):  # the state the step wrote, where each side keeps it
        for i, st in kda.items():
            assert torch.equal(st.conv[state_block[b]], own.state.kda[i].conv[own.state.conv_slot(r)])
            assert torch.equal(st.rec[state_block[b]], own.state.kda[i].rec[own.state.rec_slot(r, 0)])
        for i, st in mla.items():
            p = pos[b]
            assert torch.equal(st.cache[tables[b][p // BLOCK], p % BLOCK],
                               own.state.mla[i].cache[own.state.block_table[r, p // BLOCK], p % BLOCK])
