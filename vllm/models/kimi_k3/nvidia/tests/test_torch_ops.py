"""`TorchOps` (the benchmark's graphed standard baseline) against `ReferenceOps` on the CPU.

They are not bit-identical: TorchOps does its pointwise math in fp32 and its GEMMs as bf16
matmuls, the CPU reference in fp64, so now and then an element rounds to the other bf16
neighbour. Two levels of test, with bounds to match:

- one op on the same inputs and state: differences are such rare one-ulp flips (bf16
  outputs) or fp32-vs-fp64 rounding (the fp32 recurrent state), so the bounds are tight;
- whole decode steps in two executors: a flip in one layer feeds every later layer and
  step, and the random `mini` weights amplify it, so the bounds are bf16-drift level, as in
  test_reference_cuda.py (the same fp32-vs-fp64 difference). Without routed experts that
  drift is continuous and is bounded on every step and state, compounding over the steps.
  With them a drifted near-tie can send a row to another expert (an O(1) change that the
  row's state then carries on), so each step starts from the reference's state and the
  steps are judged on the median and on greedy agreement, as the benchmark's parity check.

A wrong slot, offset, mask or padding row would be far outside either: O(1) on its rows.
"""

import copy
import math

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.buckets import pad_to_bucket
from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode, StepMeta
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import TorchOps
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import RandomSource, load_rank
from vllm.models.kimi_k3.nvidia.reference import moe as ref_moe
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
from vllm.models.kimi_k3.nvidia.reference.params import KDAWeights, MoEWeights
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState

from ._util import mini_model, prefill, rel_err

BUCKETS = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (16, 8)]
# one op: a handful of one-ulp bf16 flips among thousands of elements stays below 1e-3
# (one flip in 2048 outputs measures ~1e-4); the fp32 state differs only by rounding order
OP_REL, STATE_REL = 1e-3, 1e-6
# whole steps (module docstring): bf16 drift; measured up to ~3e-2 on dense mini steps
STEP_REL = 5e-2
# with routed experts (module docstring): the decode benchmark's parity criteria
MEDIAN_REL, TOP1 = 3e-2, 0.9
NAN = float("nan")


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


@pytest.fixture(scope="module")
def dense():
    """mini without routed experts: no discrete choice, so the executors' difference is continuous."""
    return mini_model(seed=0, first_k_dense_replace=6)


def _executor(model, ops, graphs=False):
    return SpecializedDecode(model, max_requests=4, max_len=96, buckets=BUCKETS, ops=ops, graphs=graphs,
                             log=lambda _: None)


def _step(ex, slots, ids, q):
    return ex(ids, [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ex.state)


def _meta(state, slots, q, bucket):
    """The StepMeta the executor would fill for a decode step of `slots` (padded to `bucket` rows)."""
    segs = [state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)]
    meta = StepMeta.padding(bucket, q, state.blocks_per_req, torch.device("cpu"))
    meta.fill(torch.zeros(len(slots) * q, dtype=torch.long), pad_to_bucket(segs, q, bucket, state), state.block_size)
    return meta


# ---------------------------------------------------------------------- one op, same inputs

STEPS = [(1, 3, 4), (2, 3, 8), (8, 1, 16), (8, 2, 16)]  # (q, requests, bucket rows): each with padding


@pytest.mark.parametrize("q, n_req, bucket", STEPS)
def test_kda_core_matches_the_reference(model, q, n_req, bucket):
    """Random states and a random accepted prefix per request; the null slot poisoned for TorchOps."""
    cfg, shard = model.cfg, model.shard
    layer = next(i for i, lw in enumerate(model.w.layers) if isinstance(lw.attn, KDAWeights))
    w = model.w.layers[layer].attn
    g = torch.Generator().manual_seed(10 * q + n_req)
    state = DecodeState(cfg, shard, max_requests=4, max_len=96, max_q=8)
    slots = [state.allocate() for _ in range(n_req)]
    for r in slots:  # a verify step after a partial accept reads slot a - 1 and conv taps C[a-1 : a+2]
        state.seq_lens[r], state.accepted[r] = 20, int(torch.randint(1, 9, (), generator=g))
    st = state.kda[layer]
    st.rec.copy_(0.1 * torch.randn(st.rec.shape, generator=g))
    st.conv.copy_(torch.randn(st.conv.shape, generator=g))
    meta = _meta(state, slots, q, bucket)
    z = (2 * torch.randn(bucket, shard.kda_in_rows, generator=g)).to(torch.bfloat16)
    g_raw = (2 * torch.randn(bucket, shard.kda_proj, generator=g)).to(torch.bfloat16)
    want_st, got_st = copy.deepcopy(st), copy.deepcopy(st)
    got_st.rec[0].fill_(NAN)
    got_st.conv[0].fill_(NAN)
    want = ReferenceOps().kda_core(z, g_raw, w, want_st, meta, cfg, shard)
    got = TorchOps().kda_core(z, g_raw, w, got_st, meta, cfg, shard)
    real = n_req * q
    assert rel_err(got[:real], want[:real]) < OP_REL
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows must be zero"
    assert rel_err(got_st.rec[1:], want_st.rec[1:]) < STATE_REL
    assert torch.equal(got_st.conv[1:], want_st.conv[1:])  # raw bf16 inputs: copied, not computed


@pytest.mark.parametrize("q, n_req, bucket", STEPS)
def test_mla_attend_matches_the_reference(model, q, n_req, bucket):
    """Random cache and lengths; NaN in the null block and past each length for TorchOps (masked)."""
    cfg, shard = model.cfg, model.shard
    r_kv, width = cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    tau = 1 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    g = torch.Generator().manual_seed(10 * q + n_req)
    state = DecodeState(cfg, shard, max_requests=4, max_len=96, max_q=8)
    slots = [state.allocate() for _ in range(n_req)]
    for r in slots:  # lengths that end inside the first block, on its edge and inside the second
        state.seq_lens[r] = int(torch.randint(0, 96 - q, (), generator=g))
    meta = _meta(state, slots, q, bucket)
    cache = (3 * torch.randn(next(iter(state.mla.values())).cache.shape, generator=g)).to(torch.bfloat16)
    poisoned = cache.clone()
    poisoned[0] = NAN
    for r in slots:
        blocks = state.block_table[r].long()
        rows = poisoned[blocks].view(-1, width)
        rows[state.seq_lens[r] + q:] = NAN
        poisoned[blocks] = rows.view(len(blocks), state.block_size, width)
    q_lat = (3 * torch.randn(bucket, shard.mla_heads, width, generator=g)).to(torch.bfloat16)
    want = ReferenceOps().mla_attend(q_lat, cache, meta, r_kv, tau)
    got = TorchOps().mla_attend(q_lat, poisoned, meta, r_kv, tau)
    real = n_req * q
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got[:real]).all()
    assert rel_err(got[:real], want[:real]) < OP_REL


def test_routed_experts_both_forms_match_the_reference(model):
    """The gather form (3·N·k <= E) and the all-experts form against `moe._routed_latent`."""
    cfg, shard = model.cfg, model.shard
    w = next(lw.mlp for lw in model.w.layers if isinstance(lw.mlp, MoEWeights))
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 5, 16):  # E = 8, k = 2: one row gathers, more rows run every expert
        x = (2 * torch.randn(n, cfg.routed_expert_hidden_size, generator=g)).to(torch.bfloat16)
        weights, ids = ref_moe.route(torch.randn(n, cfg.num_experts, generator=g), w.bias, cfg)
        want = ref_moe._routed_latent(w, cfg, shard, x, weights, ids)
        got = TorchOps().routed_experts(x, ids.to(torch.int32), weights, w, cfg, shard)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert rel_err(got, want) < OP_REL, f"{n} rows"


# ---------------------------------------------------------------------- whole steps

SCENARIOS = [
    (3, [1, 1, 1, 2, 2, 2, 1]),  # buckets (4, 1) and (8, 2), a padding request in each; rollback between
    (1, [1, 1, 8, 8, 1]),  # bucket (1, 1) (the MoE gather form) and (16, 8) (max_q, a padding request)
]


def _run_pair(model, n_req, qs, resync=False):
    """Per step: (rel err of logits, greedy agreements, rows, worst state rel err). `resync` starts
    every step of TorchOps from the reference's state, so differences do not compound over steps."""
    ref, tor = _executor(model, ReferenceOps()), _executor(model, TorchOps())
    g = torch.Generator().manual_seed(10 * n_req + len(qs))
    prompts = [torch.randint(0, 260, (7 + 5 * j,), generator=g).tolist() for j in range(n_req)]
    slots = prefill(model, ref.state, prompts)
    assert prefill(model, tor.state, prompts) == slots
    out = []
    a, b = ref.state, tor.state
    for step, q in enumerate(qs):
        if resync:
            for mine, theirs in [(b.kda[i].rec, a.kda[i].rec) for i in a.kda] + \
                    [(b.kda[i].conv, a.kda[i].conv) for i in a.kda] + [(b.mla[i].cache, a.mla[i].cache) for i in a.mla]:
                mine.copy_(theirs)
        ids = torch.randint(0, 260, (n_req * q,), generator=g)
        want, got = _step(ref, slots, ids, q), _step(tor, slots, ids, q)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert b.seq_lens == a.seq_lens and b.accepted == a.accepted
        worst = max([rel_err(b.kda[i].rec[1:], a.kda[i].rec[1:]) for i in a.kda]  # slot 0: padding scratch
                    + [rel_err(b.kda[i].conv[1:], a.kda[i].conv[1:]) for i in a.kda]
                    + [rel_err(b.mla[i].cache[1:], a.mla[i].cache[1:]) for i in a.mla])
        out.append((rel_err(got, want), int((got.argmax(-1) == want.argmax(-1)).sum()), got.shape[0], worst))
        if q > 1:  # a different accepted prefix per request: the next step reads slot k - 1, taps C[k-1 : k+2]
            for j, r in enumerate(slots):
                k = 1 + (j + step) % q
                a.accept(r, k)
                b.accept(r, k)
    assert {impl for _, impl in tor.kernels[(4, 1) if n_req == 3 else (1, 1)]} == {"torch"}
    return out


@pytest.mark.parametrize("n_req, qs", SCENARIOS)
def test_steps_track_the_reference_ops_dense(dense, n_req, qs):
    for step, (err, _, _, state_err) in enumerate(_run_pair(dense, n_req, qs)):
        assert err < STEP_REL, f"step {step} (q {qs[step]}): logits"
        assert state_err < STEP_REL, f"step {step} (q {qs[step]}): KDA state or MLA cache"


@pytest.mark.parametrize("n_req, qs", SCENARIOS)
def test_steps_track_the_reference_ops_moe(model, n_req, qs):
    steps = _run_pair(model, n_req, qs, resync=True)
    errs = sorted(err for err, *_ in steps)
    assert errs[len(errs) // 2] < MEDIAN_REL, errs
    agree, rows = sum(s[1] for s in steps), sum(s[2] for s in steps)
    assert agree >= TOP1 * rows, f"greedy tokens agree on {agree}/{rows} rows"


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_padding_and_masked_positions_never_reach_real_rows(dense):
    """NaN in the null slot / block (what padding reads) and past each request's length (what the
    fixed-shape attention gathers and masks) must not reach real rows; only owned slots change."""
    ref, tor = _executor(dense, ReferenceOps()), _executor(dense, TorchOps())
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    slots = prefill(dense, ref.state, prompts)
    prefill(dense, tor.state, prompts)
    for st in tor.state.kda.values():
        st.rec[0].fill_(NAN)
        st.conv[0].fill_(NAN)
    for st in tor.state.mla.values():
        st.cache[0].fill_(NAN)
        for r in slots:  # the request's last block: its positions 64.. are past every length here
            st.cache[int(tor.state.block_table[r, -1])].fill_(NAN)
    owned = {"rec": {tor.state.rec_slot(r, j) for r in slots for j in range(tor.state.max_q)},
             "conv": {tor.state.conv_slot(r) for r in slots},
             "cache": {int(tor.state.block_table[r, 0]) for r in slots}}
    pools = {("rec", i): st for i, st in tor.state.kda.items()} | {("conv", i): st for i, st in tor.state.kda.items()}
    pools |= {("cache", i): st for i, st in tor.state.mla.items()}
    before = {key: _bits(getattr(st, key[0])).clone() for key, st in pools.items()}
    g = torch.Generator().manual_seed(1)
    for step, q in enumerate([1, 2]):  # buckets (4, 1) and (8, 2): one padding request each
        ids = torch.randint(0, 260, (3 * q,), generator=g)
        want, got = _step(ref, slots, ids, q), _step(tor, slots, ids, q)
        assert torch.isfinite(got).all(), f"step {step}: NaN reached a real row"
        assert rel_err(got, want) < STEP_REL, f"step {step}"
    for (kind, i), st in pools.items():
        new, old = _bits(getattr(st, kind)), before[kind, i]
        for s in range(1, new.shape[0]):
            if s not in owned[kind]:
                assert torch.equal(new[s], old[s]), f"{kind} of layer {i}: slot {s} written"


# ---------------------------------------------------------------------- capturability

def _boom(*_, **__):
    raise AssertionError("host synchronisation inside a TorchOps step")


# what would make a CUDA stream wait for the host (or the host for the stream) mid-step
SYNCING = ("tolist", "item", "nonzero", "cpu", "numpy", "__int__", "__float__", "__bool__")


@pytest.mark.parametrize("n_req, q", [(3, 1), (3, 2), (1, 8)])
def test_a_step_never_syncs_with_the_host(model, monkeypatch, n_req, q):
    """The forward of a padded step with the syncing calls made to raise: what a captured graph
    runs (StepMeta.fill and the commit are host work around the replay, left unguarded)."""
    def guarded(ex):
        forward = ex._forward

        def run(meta):
            with monkeypatch.context() as m:
                for name in SYNCING:
                    m.setattr(torch.Tensor, name, _boom)
                m.setattr(torch, "unique", _boom)
                m.setattr(torch, "nonzero", _boom)
                return forward(meta)
        monkeypatch.setattr(ex, "_forward", run)
        return ex

    tor, ref = guarded(_executor(model, TorchOps())), guarded(_executor(model, ReferenceOps()))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]][:n_req]
    slots = prefill(model, tor.state, prompts)
    prefill(model, ref.state, prompts)
    ids = torch.arange(10, 10 + n_req * q)
    assert torch.isfinite(_step(tor, slots, ids, q)).all()
    with pytest.raises(AssertionError, match="host synchronisation"):  # the guard bites: the reference syncs
        _step(ref, slots, ids, q)


@pytest.mark.gpu
def test_captured_graphs_track_the_reference_on_cuda():
    """Capture is the proof that no op synchronises (a sync while capturing raises); the replays
    must then track the eager reference ops on the same device."""
    cfg = preset("mini").replace(first_k_dense_replace=6)  # continuous comparison, as above
    model = ReferenceModel(cfg, load_rank(RandomSource(cfg, seed=0), cfg, device="cuda"))
    ref, tor = _executor(model, ReferenceOps()), _executor(model, TorchOps(), graphs=True)
    assert set(tor.graph) == set(BUCKETS)
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    slots = prefill(model, ref.state, prompts)
    prefill(model, tor.state, prompts)
    g = torch.Generator().manual_seed(3)
    for step, q in enumerate([1, 1, 2, 2, 1]):
        ids = torch.randint(0, 260, (3 * q,), generator=g)
        want, got = _step(ref, slots, ids, q), _step(tor, slots, ids, q)
        assert rel_err(got.cpu(), want.cpu()) < STEP_REL, f"step {step} (q {q})"
        if q > 1:
            for j, r in enumerate(slots):
                ref.state.accept(r, 1 + j % 2)
                tor.state.accept(r, 1 + j % 2)
