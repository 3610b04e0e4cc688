"""The executor inside vLLM, short of vLLM itself (issue 13): `VllmExecutor` over caches laid out as
vLLM 0.33.0 holds them (`vllm_pools`: a request's conv and recurrent state in the page of one
block, the latent cache in blocks of its block table), run from a step as vLLM's metadata holds
it (`vllm_step`), gives the hidden states and writes the state that our own executor gives and
writes for the same requests on its own pools. On the CPU with the reference ops (the mini
model); on a GPU with the CuTe DSL kernels (the shipped tiny model, inside every kernel's
envelope), recorded as `vllm_binding_parity.json` with K3_EVIDENCE_DIR."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.nvidia.evals.tiny import config_named, shipped_weights
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_executor import VllmExecutor, buckets_for
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import SafetensorsSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState

from ._evidence import parity_record
from ._util import mini_model, paged_pools, prefill, rel_err

BLOCK, MAX_LEN, REQUESTS, VLLM_BLOCKS = 16, 64, 2, 24
RESULTS: list[dict] = []
SOURCES = [f"vllm/models/kimi_k3/nvidia/{f}" for f in (
    "latency_specialized/vllm_executor.py", "latency_specialized/vllm_pools.py", "latency_specialized/vllm_step.py",
    "latency_specialized/executor.py", "latency_specialized/lanes.py", "latency_specialized/decode_ops.py",
    "reference/state.py",
    "kernels/kda_decode.py", "kernels/mla_decode.py", "kernels/mla_decode_wgmma.py", "kernels/mla_cache_write.py")]


record = parity_record("vllm_binding_parity.json", "vllm-binding",
                       "vllm/models/kimi_k3/nvidia/tests/test_vllm_binding.py", SOURCES, RESULTS)


def _vllm_caches(model, q: int, block: int = BLOCK):
    """vLLM-style caches for `model` (VLLM_BLOCKS blocks, NaN-filled), as its static forward context."""
    blank = DecodeState(model.cfg, model.shard, max_requests=VLLM_BLOCKS - 1, max_len=block, max_q=q,
                        block_size=block, device=model.w.embed.device)
    (kda, mla), _ = paged_pools(blank)
    for st in kda.values():
        st.rec.fill_(float("nan"))
        st.conv.fill_(float("nan"))
    for st in mla.values():
        st.cache.fill_(float("nan"))
    # as vLLM 0.33.0 binds them: the KDA module holds (conv, recurrent), the MLA one the cache tensor;
    # the fused-MoE runners share the layer prefixes and hold none
    bound = lambda cache: SimpleNamespace(kv_cache=cache, bind_kv_cache=lambda _: None)  # noqa: E731
    ctx = {f"model.layers.{i}.self_attn": bound((st.conv, st.rec)) for i, st in kda.items()}
    ctx |= {f"model.layers.{i}.self_attn": bound(st.cache) for i, st in mla.items()}
    ctx |= {f"model.layers.{i}.block_sparse_moe.experts": SimpleNamespace() for i in range(model.cfg.num_hidden_layers)}
    return ctx, kda, mla


@pytest.mark.parametrize("q, inputs", [(1, "ids"), (3, "ids"), (1, "embeddings"), (3, "embeddings")])
def test_a_decode_step_on_vllms_pools_and_metadata_equals_ours(q, inputs):
    """q = 1: a plain decode step; q = 3: a verify step (vLLM: spec_state_indices [B, q], the state
    after token t into column t, the conv window in the first column's page); the step starting
    from token ids, or from the embeddings vLLM's multimodal runner passes instead."""
    _step_on_vllms_layout(mini_model(seed=0), None, BLOCK, MAX_LEN, q, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("q, inputs", [(1, "ids"), (3, "ids"), (1, "embeddings")])
def test_on_the_kernels_a_decode_step_on_vllms_pools_and_metadata_equals_ours(q, inputs):
    """The same on the H200 with the CuTe DSL kernels on both sides (KDA on page-strided pools,
    MLA over vLLM's block tables, the cache write at vLLM's slot mapping), block size 64."""
    cfg = config_named("tiny")
    tiny = ReferenceModel(cfg, load_rank(SafetensorsSource(shipped_weights("tiny")), cfg, device="cuda"))
    _step_on_vllms_layout(tiny, KernelOps, 64, 256, q, inputs)


def _step_on_vllms_layout(model, ops, block: int, max_len: int, q: int, inputs: str) -> None:
    """One step of two requests through our executor on its own pools and through `VllmExecutor` on
    vLLM-laid-out caches with vLLM-style metadata: equal hidden states and written state. `ops`:
    the op table's class (None: the executor's default for the device)."""
    rng, dev = random.Random(q), model.w.embed.device
    key = (REQUESTS * q, q)
    kw = {"max_requests": REQUESTS, "max_len": max_len, "buckets": [key], "graphs": False,
          "block_size": block, "output": "hidden", "log": lambda _: None}
    own = SpecializedDecode(model, **kw, ops=None if ops is None else ops())
    slots = prefill(model, own.state, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21]])
    ctx, kda, mla = _vllm_caches(model, q, block)
    vex = VllmExecutor.build(model, ctx, max_model_len=max_len, rows=[REQUESTS * q],
                             verify_tokens=q, inputs=inputs, ops=None if ops is None else ops(), log=lambda _: None)
    assert vex.executor.state.block_size == block  # the bound MLA view's, not a config's
    kda_first = min(i for i in range(model.cfg.num_hidden_layers) if model.cfg.layer_kind(i) == "kda")
    mla_first = min(i for i in range(model.cfg.num_hidden_layers) if model.cfg.layer_kind(i) != "kda")
    assert (vex.kda_layer, vex.mla_layer) == (f"model.layers.{kda_first}.self_attn",
                                              f"model.layers.{mla_first}.self_attn")

    # place each request where vLLM would: its state in one block's page, its tokens in its own blocks
    free = rng.sample(range(1, VLLM_BLOCKS), VLLM_BLOCKS - 1)
    bpr = vex.executor.state.blocks_per_req
    state_blocks = [[free.pop() for _ in range(q)] for _ in slots]
    tables = [[free.pop() for _ in range(-(-(own.state.seq_lens[r] + q) // block))] for r in slots]
    for b, r in enumerate(slots):
        for i, st in kda.items():  # after a prefill the state is in the first slot (accepted = 1)
            st.conv[state_blocks[b][0]] = own.state.kda[i].conv[own.state.conv_slot(r)]
            st.rec[state_blocks[b][0]] = own.state.kda[i].rec[own.state.rec_slot(r, 0)]
        for p in range(own.state.seq_lens[r]):
            for i, st in mla.items():
                st.cache[tables[b][p // block], p % block] = own.state.mla[i].cache[own.state.block_table[r, p // block],
                                                                                   p % block]
    ids = torch.tensor([33, 44, 55, 66, 77, 88][:REQUESTS * q], device=dev)
    pos = [own.state.seq_lens[r] for r in slots]
    want = own(ids, [own.state.segment(r, b * q, q, prefill=False) for b, r in enumerate(slots)], own.state)

    # the step as vLLM's metadata holds it, keyed by layer prefix (vLLM 0.33.0's GDN and MLA metadata)
    states = torch.tensor(state_blocks, dtype=torch.int32, device=dev)
    kda_md = SimpleNamespace(num_decodes=REQUESTS if q == 1 else 0, num_spec_decodes=0 if q == 1 else REQUESTS,
                             non_spec_state_indices_tensor=states[:, 0], spec_state_indices_tensor=states,
                             num_accepted_tokens=torch.ones(REQUESTS, dtype=torch.int32, device=dev))
    mla_md = SimpleNamespace(
        decode=SimpleNamespace(block_table=torch.tensor([t + [0] * (bpr - len(t)) for t in tables], dtype=torch.int32,
                                                        device=dev),
                               seq_lens=torch.tensor([p + q for p in pos], dtype=torch.int32, device=dev)),
        slot_mapping=torch.tensor([tables[b][t // block] * block + t % block
                                   for b, p in enumerate(pos) for t in range(p, p + q)], device=dev))
    md = {vex.kda_layer: kda_md, vex.mla_layer: mla_md}
    if inputs == "ids":
        got = vex.run(key, md, ids, None, REQUESTS * q)
    else:  # vLLM embedded the tokens (a TP1 embedding is the table's row) and passes no ids
        got = vex.run(key, md, None, None, REQUESTS * q, inputs_embeds=model.w.embed[ids])

    written = all(
        torch.equal(st.conv[state_blocks[b][0]], own.state.kda[i].conv[own.state.conv_slot(r)])
        and all(torch.equal(st.rec[state_blocks[b][t]], own.state.kda[i].rec[own.state.rec_slot(r, t)])
                for t in range(q))
        for b, r in enumerate(slots) for i, st in kda.items())
    written = written and all(
        torch.equal(st.cache[tables[b][t // block], t % block],
                    own.state.mla[i].cache[own.state.block_table[r, t // block], t % block])
        for b, r in enumerate(slots) for i, st in mla.items() for t in range(pos[b], pos[b] + q))
    equal = got.shape == (REQUESTS * q, model.cfg.hidden_size) and torch.equal(got, want)
    if dev.type == "cuda":
        RESULTS.append({"name": f"tiny, kernels: q{q} from {inputs}, vLLM layout vs ours", "hidden_equal": equal,
                        "hidden_rel_err": rel_err(got.float(), want.float()), "state_equal": written,
                        "status": "pass" if equal and written else "fail"})
    assert equal, rel_err(got.float(), want.float())
    assert written


def test_buckets_cover_every_row_count_and_whole_verify_requests():
    assert buckets_for([1, 2, 8, 64], 1) == [(1, 1), (2, 1), (8, 1), (64, 1)]
    assert buckets_for([1, 4, 6, 8, 64], 4) == [(1, 1), (4, 1), (4, 4), (6, 1), (8, 1), (8, 4), (64, 1), (64, 4)]


def test_the_executors_block_tables_are_as_wide_as_vllms():
    """vLLM rounds a block table's width up to whole 128-token spans (`get_block_table_width`):
    at block size 16 and max_model_len 100 that is 8 blocks, not 7; the executor built over such
    caches holds at least as many, so vLLM's tables fit it."""
    model = mini_model(seed=0)
    ctx, _, _ = _vllm_caches(model, 1, 16)
    vex = VllmExecutor.build(model, ctx, max_model_len=100, rows=[2], verify_tokens=1, log=lambda _: None)
    vllm_width = -(-(-(-100 // 16)) // (128 // math.gcd(128, 16))) * (128 // math.gcd(128, 16))
    assert vllm_width == 8 and vex.executor.state.blocks_per_req >= vllm_width


def _backend_config(model, monkeypatch, tp: int):
    """A vLLM config stand-in on an H200 deployment (described, since this machine has no GPU) for
    `model`'s rank, its caches bound in the static forward context; (config, options, context,
    (kda pools, mla pools, {layer: caches}))."""
    from vllm.models.kimi_k3.nvidia.latency_specialized import vllm_hook as hook
    from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment
    from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions

    monkeypatch.setattr(hook.Deployment, "detect",
                        lambda **kw: Deployment.describe(gpu="H200", **{k: v for k, v in kw.items()
                                                                        if k != "device"}))
    block = 64  # the executor's buckets reach 64 rows: padding rows need that many rows of the null block
    ctx, kda, mla = _vllm_caches(model, 1, block)
    bound = {name: module.kv_cache for name, module in ctx.items() if hasattr(module, "kv_cache")}
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        enable_expert_parallel=False, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block), lora_config=None, quant_config=None,
        speculative_config=None,
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(decode_mode=lambda: SimpleNamespace(
            name="FULL")), static_forward_context=ctx),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, dtype=torch.bfloat16,
                                     hf_config=SimpleNamespace(quantization_config=None),
                                     hf_text_config=SimpleNamespace(to_dict=lambda: model.cfg.to_hf_dict())))
    return config, BackendOptions("latency_specialized", allow_unvalidated=True), ctx, (kda, mla, bound)


def test_the_backend_builds_the_executor_once_caches_exist_and_serves_admitted_steps(monkeypatch, caplog):
    """`VllmBackend` on an H200 deployment (described, since this machine has no GPU) with the mini
    model's weights standing in for vLLM's: no executor while the caches are unbound (vLLM's
    profiling run) or during a capture; built at the next warm-up forward; an admitted step in a
    FULL capture then carries its bucket and `run` returns the executor's hidden states; a step
    whose inputs are not those the executor was built for falls back with its reason."""
    from vllm.models.kimi_k3.nvidia.latency_specialized import vllm_hook as hook

    model = mini_model(seed=0)
    config, options, ctx, (kda, mla, bound) = _backend_config(model, monkeypatch, tp=1)
    for module in ctx.values():  # vLLM's profiling run: nothing bound yet (a KDA module has no kv_cache then)
        module.__dict__.pop("kv_cache", None)
    backend = hook.VllmBackend(config, options, tp=1, rank=0, kda_dtypes=(torch.bfloat16, torch.float32))
    assert backend.router.enabled, backend.startup_line
    backend._bound, backend.weights = True, model.w  # vLLM's loaded weights, bound (tested elsewhere)
    md = {"model.layers.0.self_attn": SimpleNamespace(num_decodes=2, num_spec_decodes=0, num_prefills=0)}

    route = backend.on_forward(None, 2, md, graph_mode="NONE", capturing=False)
    assert backend.executor is None and route.reason == hook.NOT_FULL_GRAPH_REASON
    for name, caches in bound.items():
        ctx[name].kv_cache = caches
    backend.on_forward(None, 2, md, graph_mode="FULL", capturing=True)
    assert backend.executor is None  # never built inside a capture
    backend.on_forward(None, 2, md, graph_mode="NONE", capturing=False)
    assert backend.executor is not None and backend.router.dispatcher.executor is backend.executor.executor
    assert backend.executor.executor.state.kda[0].rec is kda[0].rec  # vLLM's caches, adopted

    route = backend.on_forward(None, 2, md, graph_mode="FULL", capturing=True)
    assert route.path == "specialized" and route.plan == (2, 1)
    embeds = backend.on_forward(None, 2, md, graph_mode="FULL", capturing=True, embeddings_in=True)
    assert embeds.path == "standard" and embeds.reason == hook.INPUTS_REASON  # built for the ids it saw first
    slots = torch.tensor([3, 5], dtype=torch.int32)
    for i, st in kda.items():
        st.rec[slots.long()] = 0.0
        st.conv[slots.long()] = 0.0
    full_md = {"model.layers.0.self_attn": SimpleNamespace(
        num_decodes=2, num_spec_decodes=0, non_spec_state_indices_tensor=slots, spec_state_indices_tensor=None,
        num_accepted_tokens=None),
        "model.layers.2.self_attn": SimpleNamespace(
            decode=SimpleNamespace(block_table=torch.tensor([[7], [9]], dtype=torch.int32),
                                   seq_lens=torch.tensor([1, 1], dtype=torch.int32)),
            slot_mapping=torch.tensor([7 * 64, 9 * 64]))}  # _backend_config's blocks of 64
    hidden = backend.run(route, full_md, torch.tensor([11, 12]), None, 2)
    # two new requests (zeroed states, one cached position: the step's own) on our own pools
    own = SpecializedDecode(model, max_requests=2, max_len=MAX_LEN, buckets=[(2, 1)], graphs=False, block_size=64,
                            output="hidden", log=lambda _: None)
    fresh = [own.state.allocate() for _ in range(2)]
    want = own(torch.tensor([11, 12]), [own.state.segment(r, b, 1, prefill=False) for b, r in enumerate(fresh)],
               own.state)
    assert hidden.shape == want.shape and torch.equal(hidden, want), rel_err(hidden.float(), want.float())

    # a step whose metadata does not fit (a block table wider than any max_model_len the executor
    # was built for) turns the backend off with its reason and hands the step to vLLM's forward
    # (run returns None), where raising would end vLLM's start-up inside a capture
    wide = dict(full_md)
    wide["model.layers.2.self_attn"] = SimpleNamespace(
        decode=SimpleNamespace(block_table=torch.zeros(2, 1000, dtype=torch.int32),
                               seq_lens=torch.tensor([1, 1], dtype=torch.int32)),
        slot_mapping=torch.tensor([7 * 64, 9 * 64]))
    assert backend.run(route, wide, torch.tensor([11, 12]), None, 2) is None
    assert not backend.router.enabled and hook.STEP_REASON in caplog.text


def test_above_tp_1_the_backend_sums_over_vllms_tensor_parallel_group(monkeypatch, caplog):
    """Rank 1 of TP 8 (the mini model, 8 heads, its shard and caches of that rank): the executor is built with
    its sums over vLLM's group (`tp_group`, a stand-in here whose peer sent the same partial);
    a group whose rank is not the model's turns the backend off and says both."""
    from vllm.models.kimi_k3.nvidia.latency_specialized import vllm_hook as hook
    from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_collective import VllmCollective

    model = mini_model(seed=0, tp=8, rank=1, num_attention_heads=8, kda_num_heads=8)
    config, options, ctx, _ = _backend_config(model, monkeypatch, tp=8)
    group = SimpleNamespace(world_size=8, rank_in_group=1, gathers=0)

    def all_gather(x, dim=-1):
        group.gathers += 1
        return torch.cat([x] * 8, dim)

    group.all_gather = all_gather
    monkeypatch.setattr(hook, "tp_group", lambda: group)
    md = {"model.layers.0.self_attn": SimpleNamespace(num_decodes=2, num_spec_decodes=0, num_prefills=0)}
    backend = hook.VllmBackend(config, options, tp=8, rank=1, kda_dtypes=(torch.bfloat16, torch.float32))
    backend._bound, backend.weights = True, model.w
    backend.on_forward(None, 2, md, graph_mode="NONE", capturing=False)
    assert backend.router.enabled and backend.executor is not None, caplog.text
    coll = backend.executor.executor.model.coll
    assert isinstance(coll, VllmCollective) and coll.group is group and group.gathers > 0  # the build's warm-up
    assert backend.executor.executor.shard == model.cfg.shard(8, 1)

    group.rank_in_group = 0
    other = hook.VllmBackend(config, options, tp=8, rank=1, kda_dtypes=(torch.bfloat16, torch.float32))
    other._bound, other.weights = True, model.w
    with caplog.at_level("WARNING"):
        other.on_forward(None, 2, md, graph_mode="NONE", capturing=False)
    assert not other.router.enabled and "rank 0 of 8, but the model was built for rank 1 of 8" in caplog.text
