"""The specialized executor's plumbing on CPU: with `ReferenceOps` its step must equal the
reference model's bit for bit (AttnRes block slots, MLA cache writes, KDA slots, padding to a
bucket, verify steps and rollback), since both run the same functions and only the executor's
buffers, metadata and layer wiring differ. The kernels themselves are the GPU tests' job."""

import dataclasses
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import GLUE, ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import Dispatcher
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request, build_specialized
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import ExecutorError, SpecializedDecode, StepMeta
from vllm.models.kimi_k3.nvidia.latency_specialized.lanes import Lanes
from vllm.models.kimi_k3.nvidia.latency_specialized.moe_padding import pad_moe
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.reference.collective import ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.ops import rms_norm
from vllm.models.kimi_k3.nvidia.reference.state import KDALayerState, StateError

from ._util import executor_rank_steps, mini_model, paged_pools, prefill

BUCKETS = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (16, 8)]


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


def _executor(model, ops=None, **kw):
    return SpecializedDecode(model, max_requests=4, max_len=96, buckets=BUCKETS, ops=ops or ReferenceOps(),
                             graphs=False, log=lambda _: None, **kw)


class PaddedReferenceOps(ReferenceOps):
    """The reference ops on MoE weights padded as KernelOps pads them for the kernels."""

    def prepare_moe(self, w):
        return pad_moe(w)


def _same_state(a, b):
    assert a.seq_lens == b.seq_lens and a.accepted == b.accepted
    for i in a.kda:  # every slot a request owns; slot 0 is scratch for padding
        assert torch.equal(a.kda[i].rec[1:], b.kda[i].rec[1:]), f"layer {i} recurrent state"
        assert torch.equal(a.kda[i].conv[1:], b.kda[i].conv[1:]), f"layer {i} conv state"
    for i in a.mla:
        assert torch.equal(a.mla[i].cache[1:], b.mla[i].cache[1:]), f"layer {i} latent cache"


@pytest.mark.parametrize("n_req, q, padded", [(1, 1, False), (3, 1, False), (4, 2, False), (2, 8, False),
                                              (3, 1, True), (2, 8, True)])
def test_step_equals_reference_bit_for_bit(model, n_req, q, padded):
    """Decode and verify steps (padded to their bucket where needed), then a partial accept; with
    `padded`, on MoE weights zero-padded to the kernels' granularity (moe_padding.py), which
    must change nothing."""
    ex = _executor(model, PaddedReferenceOps() if padded else None)
    if padded:  # mini: 8 experts, latent 64, I = 32 -> 32, 128, 64
        assert {tuple(w.w13.shape) for w in ex.moe.values()} == {(8, 128, 128)}
        assert {tuple(w.router.shape) for w in ex.moe.values()} == {(32, model.cfg.hidden_size)}
    ref = model.new_state(max_requests=4, max_len=96, max_q=ex.state.max_q)
    g = torch.Generator().manual_seed(n_req * 10 + q)
    prompts = [torch.randint(0, 260, (7 + 5 * j,), generator=g).tolist() for j in range(n_req)]
    slots = prefill(model, ex.state, prompts)
    assert prefill(model, ref, prompts) == slots
    for step in range(3):
        ids = torch.randint(0, 260, (n_req * q,), generator=g)
        segs_x = [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)]
        segs_r = [ref.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)]
        got = ex(ids, segs_x, ex.state)
        want = model.logits(model.forward(ids, segs_r, ref))
        assert got.shape == want.shape and torch.equal(got, want), f"step {step}"
        _same_state(ex.state, ref)
        if q > 1:  # keep a different prefix per request: the next step must start from it exactly
            for j, r in enumerate(slots):
                k = 1 + (j + step) % q
                ex.state.accept(r, k)
                ref.accept(r, k)


def test_hidden_output_is_what_the_logits_are_computed_from(model):
    """`output="hidden"` returns the hidden states before the final norm (vLLM's forward output; its
    compute_logits applies the norm): the final norm and the model's LM head on them give the
    logits the default executor returns for the same step."""
    with pytest.raises(ExecutorError, match="output must be one of 'logits', 'hidden'"):
        _executor(model, output="probs")
    hid, log = _executor(model, output="hidden"), _executor(model)
    prompts = [[1, 2, 3, 4], [5, 6]]
    slots = prefill(model, hid.state, prompts)
    assert prefill(model, log.state, prompts) == slots
    ids = torch.tensor([7, 8])
    h = hid(ids, [hid.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)], hid.state)
    logits = log(ids, [log.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)], log.state)
    assert h.shape == (2, model.cfg.hidden_size) and h.dtype == torch.bfloat16
    assert torch.equal(model.logits(rms_norm(h, model.w.final_norm, model.cfg.rms_norm_eps)), logits)
    _same_state(hid.state, log.state)


def test_adopted_page_strided_pools_serve_like_own_ones(model):
    """The executor over vLLM-style pools (`pools=`: KDA slots a page apart, conv and recurrent state in
    one page) gives the logits and states of the executor over its own pools, bit for bit, and
    writes nothing between the views."""
    own = _executor(model)
    slots = prefill(model, own.state, [[1, 2, 3, 4, 5], [6, 7, 8]])
    pools, pages = paged_pools(own.state)
    paged = _executor(model, pools=pools)
    assert all(st.rec.stride(0) > st.rec[0].numel() for st in paged.state.kda.values())
    for r in slots:  # the same requests, already prefilled: the pools were copied
        paged.state.in_use[r], paged.state.seq_lens[r] = True, own.state.seq_lens[r]
    g = torch.Generator().manual_seed(3)
    for q in (1, 2, 1):
        ids = torch.randint(0, 260, (2 * q,), generator=g)
        want = own(ids, [own.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], own.state)
        got = paged(ids, [paged.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], paged.state)
        assert torch.equal(got, want)
        _same_state(paged.state, own.state)
    for buf, rec, conv in pages:  # only the views were written: every other element is still NaN
        inside = torch.zeros(buf.numel(), dtype=torch.bool)
        torch.as_strided(inside, rec.shape, rec.stride(), rec.storage_offset()).fill_(True)
        halves = torch.zeros(2 * buf.numel(), dtype=torch.bool)  # the conv view indexes bf16 halves
        torch.as_strided(halves, conv.shape, conv.stride(), conv.storage_offset()).fill_(True)
        inside |= halves.view(-1, 2).any(dim=1)
        assert torch.isnan(buf[~inside]).all() and not torch.isnan(buf[inside]).any()
    with pytest.raises(StateError, match=r"pools: layer \d+ conv must be a \[slots, 10, 384\] bfloat16 .* got \[5, 3, 384\]"):
        _executor(model, pools=({i: KDALayerState(st.rec, st.conv[:, :3]) for i, st in pools[0].items()}, pools[1]))
    # pools smaller than our slot rule: addressed only by their owner's metadata, never by segments
    small = _executor(model, pools=({i: KDALayerState(st.rec[:2], st.conv) for i, st in pools[0].items()}, pools[1]))
    for use in (small.state.allocate, lambda: small.state.segment(0, 0, 1, prefill=False)):
        with pytest.raises(StateError, match="their owner's metadata addresses them"):
            use()


def test_padding_rows_write_only_the_null_slot(model):
    """Three requests run in bucket 4: the padding request may write only slot 0 and block 0."""
    ex = _executor(model)
    slots = prefill(model, ex.state, [[5, 6, 7], [8, 9], [1, 2, 3, 4]])
    for st in ex.state.kda.values():  # poison the null slot: real rows must never read it
        st.rec[0].fill_(float("nan"))
        st.conv[0].fill_(float("nan"))
    for st in ex.state.mla.values():
        st.cache[0].fill_(float("nan"))
    owned_rec = {ex.state.rec_slot(r, 0) for r in slots}
    owned_blocks = set(ex.state.block_table[slots].flatten().tolist())
    before_rec = {i: st.rec.clone() for i, st in ex.state.kda.items()}
    before_cache = {i: st.cache.clone() for i, st in ex.state.mla.items()}
    segs = [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)]
    logits = ex(torch.tensor([4, 5, 6]), segs, ex.state)
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    for i, rec in before_rec.items():
        for s in range(1, rec.shape[0]):
            if s not in owned_rec:
                assert torch.equal(ex.state.kda[i].rec[s], rec[s]), f"layer {i} slot {s}"
    for i, cache in before_cache.items():
        for blk in range(1, cache.shape[0]):
            if blk not in owned_blocks:
                assert torch.equal(ex.state.mla[i].cache[blk], cache[blk]), f"layer {i} block {blk}"


# The ops one decode step records per layer, by kind (ReferenceOps' names; executor.py's step):
_LAYER_OPS = {
    "every": {"attn_res": 2},  # _forward: the AttnRes before the attention (u) and before the MLP (v)
    # _kda: in_proj, f_b, o_proj GEMMs; the recurrence
    "kda": {"linear": 3, "kda_core": 1},
    # _mla: fused_a, q_b, o_proj GEMMs; q_a_norm on q_c; cache write, absorb, attend, unabsorb
    "mla": {"linear": 3, "rms_norm": 1, "mla_cache_write": 1, "mla_absorb": 1, "mla_attend": 1,
            "mla_unabsorb": 1},
    # _moe: latent_down, shared gate_up + down (_gated_mlp_rank), router, latent_up GEMMs; the
    # shared SiTU; route and routed experts; latent_norm only where cfg.latent_moe_use_norm
    "moe": {"linear": 5, "situ_and_mul": 1, "moe_route": 1, "moe_experts": 1},
    "moe_latent_norm": {"rms_norm": 1},
    "dense": {"linear": 2, "situ_and_mul": 1},  # _dense -> _gated_mlp_rank: gate_up, down GEMMs; SiTU
}
# once per step (_forward): the embedding, the final AttnRes fused with the final norm, the LM head
_STEP_OPS = {"embed": 1, "attn_res": 1, "linear": 1}


def _expected_ops(cfg) -> Counter:
    want = Counter(_STEP_OPS)
    for i in range(cfg.num_hidden_layers):
        want.update(_LAYER_OPS["every"])
        want.update(_LAYER_OPS[cfg.layer_kind(i)])
        want.update(_LAYER_OPS[cfg.mlp_kind(i)])
        if cfg.mlp_kind(i) == "moe" and cfg.latent_moe_use_norm:
            want.update(_LAYER_OPS["moe_latent_norm"])
    return want


def test_every_op_is_recorded_and_only_glue_runs_outside_the_table(model):
    """The step's trace is exactly the per-layer inventory the config implies: an op that ran
    outside the table (unrecorded) or one too many shows up as a count off by one."""
    cfg = model.cfg
    ex = _executor(model)
    assert set(ex.moe) == {i for i in range(cfg.num_hidden_layers) if cfg.mlp_kind(i) == "moe"}
    kinds = {(cfg.layer_kind(i), cfg.mlp_kind(i)) for i in range(cfg.num_hidden_layers)}
    assert {("kda", "dense"), ("kda", "moe"), ("mla", "moe")} <= kinds  # the inventory is exercised
    slots = prefill(model, ex.state, [[1, 2, 3]])
    ex(torch.tensor([4]), [ex.state.segment(slots[0], 0, 1, prefill=False)], ex.state)
    trace = ex.kernels[(1, 1)]
    assert {op for op, impl in trace if impl != "reference"} <= set(GLUE)
    assert Counter(op for op, _ in trace) == _expected_ops(cfg)
    assert ex.launches((1, 1))[0] == "embed" and ex.launches((1, 1))[-1] == "linear"


def test_plan_declines_what_no_bucket_serves(model):
    ex = _executor(model)
    assert ex.plan(StepFacts(rows=3, tokens_per_request=1, max_context=10, pure_decode=True)) == (4, 1)
    assert ex.plan(StepFacts(rows=16, tokens_per_request=8, max_context=10, pure_decode=True)) == (16, 8)
    for facts in (StepFacts(rows=9, tokens_per_request=1, max_context=10, pure_decode=True),
                  StepFacts(rows=3, tokens_per_request=3, max_context=10, pure_decode=True),
                  StepFacts(rows=2, tokens_per_request=None, max_context=10, pure_decode=True),
                  StepFacts(rows=2, tokens_per_request=1, max_context=10, pure_decode=False),
                  StepFacts(rows=2, tokens_per_request=1, max_context=97, pure_decode=True)):
        assert ex.plan(facts) is None, facts
    with pytest.raises(ExecutorError, match="owns"):
        ex(torch.tensor([1]), [], model.new_state(max_requests=1, max_len=8))
    with pytest.raises(ExecutorError, match="rows a multiple of q"):
        SpecializedDecode(model, max_requests=1, max_len=8, buckets=[(3, 2)], graphs=False, log=lambda _: None)
    with pytest.raises(ExecutorError, match="whole 2-token requests"):
        StepMeta.padding(3, 2, 4, torch.device("cpu"))
    with pytest.raises(ExecutorError, match="overlap needs CUDA graphs"):
        SpecializedDecode(model, max_requests=1, max_len=8, buckets=[(1, 1)], graphs=False, overlap=True,
                          log=lambda _: None)


def test_a_step_the_state_cannot_have_produced_is_refused(model):
    """Too few ids (the missing rows would decode token 0), a request twice (its two rows would race
    one state), a segment taken before the last commit (it would rewrite a cached row), a padding
    or freed slot (written as if it were a request): each is refused by name, and the state is
    left as it was."""
    ex = _executor(model)
    slots = prefill(model, ex.state, [[1, 2, 3], [4, 5]])
    segs = [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)]
    before = list(ex.state.seq_lens)
    with pytest.raises(ExecutorError, match="1 token ids for a step of 2 rows"):
        ex(torch.tensor([7]), segs, ex.state)
    twice = [segs[0], ex.state.segment(slots[0], 1, 1, prefill=False)]
    with pytest.raises(ExecutorError, match=f"request {slots[0]} appears twice"):
        ex(torch.tensor([7, 8]), twice, ex.state)
    assert ex.state.seq_lens == before
    ex(torch.tensor([7, 8]), segs, ex.state)  # the step as the state holds it runs, and commits
    with pytest.raises(ExecutorError, match="take segments from state.segment"):
        ex(torch.tensor([7, 8]), segs, ex.state)
    # a padding segment, and a slot freed after its segment was taken: neither is a request
    segs = [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)]
    with pytest.raises(ExecutorError, match="segment request=-1 is not an allocated request slot"):
        ex(torch.tensor([7, 8]), [segs[0], dataclasses.replace(segs[1], request=-1)], ex.state)
    ex.state.free(slots[1])
    with pytest.raises(ExecutorError, match=f"segment request={slots[1]} is not an allocated request slot"):
        ex(torch.tensor([7, 8]), segs, ex.state)


def _no_cuda_streams(monkeypatch):
    def touched(*_a, **_k):
        raise AssertionError("lanes off must not touch CUDA streams or events")
    for name in ("Stream", "Event", "stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, touched)


class _FakeStreams:
    """torch.cuda's Stream / stream / current_stream / Event, recorded: what lanes.py does on a GPU,
    as a log (`side i waits current`, `enter side i`, ...) a CPU test can read."""

    class S:
        def __init__(self, name, log):
            self.name, self.log, self.device = name, log, torch.device("cuda", 0)

        def wait_stream(self, other):
            self.log.append(f"{self.name} waits {other.name}")

    def __init__(self, monkeypatch):
        self.log, self.sides = [], 0
        self.current = self.S("current", self.log)
        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: pytest.fail("lanes use no events"))

    def new_stream(self, device=None):
        self.sides += 1
        return self.S(f"side {self.sides - 1}", self.log)

    @contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        self.log.append(f"enter {s.name}")
        try:
            yield
        finally:
            self.current = prev
            self.log.append(f"exit {s.name}")


def test_lanes_off_run_on_the_current_stream_in_issue_order(model, monkeypatch):
    """Without graphs the lanes are off: `beside` runs its block at once, `join` does nothing and
    neither touches a CUDA stream, so an eager step issues the ops of a graphed one in the same
    order (a GPU test compares the two)."""
    ex = SpecializedDecode(model, max_requests=1, max_len=8, buckets=[(1, 1)], graphs=False, log=lambda _: None)
    _no_cuda_streams(monkeypatch)
    for lanes in (ex.lanes, Lanes(None)):
        assert not lanes.on
        order = []
        with lanes.beside(0):
            order.append("lane 0")
        order.append("current")
        lanes.join(0)
        with lanes.beside(1):
            order.append("lane 1")
        lanes.join(1)
        assert order == ["lane 0", "current", "lane 1"]


def test_lanes_on_fork_from_and_join_into_the_current_stream(monkeypatch):
    """Lanes on (fake CUDA streams, no GPU): `beside(i)` makes side stream i wait for the current
    stream and then runs its block on side i; `join(i)` makes the current stream wait for side i."""
    fake = _FakeStreams(monkeypatch)
    lanes = Lanes(torch.device("cuda", 0))
    assert lanes.on and [s.name for s in lanes.streams] == ["side 0", "side 1"]
    with lanes.beside(1):
        fake.log.append(f"work on {fake.current.name}")
    fake.log.append(f"work on {fake.current.name}")
    lanes.join(1)
    assert fake.log == ["side 1 waits current", "enter side 1", "work on side 1", "exit side 1",
                        "work on current", "current waits side 1"]


def test_the_step_forks_and_joins_its_lanes_where_the_executor_says(model, monkeypatch):
    """An eager step with its lanes switched on (fake streams): MLA's cache write runs on lane 0 and
    is joined before the attention; MoE's latent down-projection (lane 0) is joined before the
    routed experts and the shared MLP (lane 1) before the up-projection; all else stays current."""
    cfg = model.cfg
    fake = None

    class Logged(ReferenceOps):
        def _rec(self, op, impl=None):
            super()._rec(op, impl)
            if fake is not None:
                fake.log.append(f"{op} on {fake.current.name}")

    ex = _executor(model, Logged())
    slots = prefill(model, ex.state, [[1, 2, 3]])
    fake = _FakeStreams(monkeypatch)
    ex.lanes = Lanes(torch.device("cuda", 0))

    def on(lane, *ops):
        return [f"{op} on {lane}" for op in ops]

    def fork(i, *ops):
        return [f"side {i} waits current", f"enter side {i}", *on(f"side {i}", *ops), f"exit side {i}"]

    attn = {"kda": on("current", "linear", "linear", "kda_core", "linear"),
            "mla": [*on("current", "linear"), *fork(0, "mla_cache_write"),
                    *on("current", "rms_norm", "linear", "mla_absorb"), "current waits side 0",
                    *on("current", "mla_attend", "mla_unabsorb", "linear")]}
    mlp = {"dense": on("current", "linear", "situ_and_mul", "linear"),
           "moe": [*fork(0, "linear"), *fork(1, "linear", "situ_and_mul", "linear"),
                   *on("current", "linear", "moe_route"), "current waits side 0",
                   *on("current", "moe_experts", *(["rms_norm"] if cfg.latent_moe_use_norm else [])),
                   "current waits side 1", *on("current", "linear")]}
    want = on("current", "embed")
    for i in range(cfg.num_hidden_layers):
        want += [*on("current", "attn_res"), *attn[cfg.layer_kind(i)], *on("current", "attn_res"),
                 *mlp[cfg.mlp_kind(i)]]
    want += on("current", "attn_res", "linear")
    ex(torch.tensor([4]), [ex.state.segment(slots[0], 0, 1, prefill=False)], ex.state)
    assert fake.log == want


def test_engine_on_the_executor_state_matches_the_standard_engine(model):
    """Greedy generation through the executor (every decode step specialized) gives the standard tokens."""
    ex = _executor(model)
    reqs = [Request([10, 20, 30, 40], SamplingParams(max_tokens=12)),
            Request([7, 7, 7], SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3))]

    class Always:  # a dispatcher that admits every decode step
        def route(self, facts):
            return type("R", (), {"path": "specialized" if ex.plan(facts) else "standard"})()

    spec = Engine(model, dispatcher=Always(), specialized=ex, state=ex.state, max_requests=4, max_len=96)
    std = Engine(model, max_requests=4, max_len=96)
    got, want = spec.generate(reqs), std.generate(reqs)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert spec.stats.paths.get("specialized", 0) == 11 and not any(ex.state.in_use)


def test_compared_ops_trace_a_difference_to_its_op(model):
    """`ComparedOps` (the GPU triage tool) reports zero for equal tables (also where the test table
    pads the MoE weights: both tables then take the padded ones) and names a broken op."""
    from vllm.models.kimi_k3.nvidia.latency_specialized.op_parity import ComparedOps

    class BrokenNorm(ReferenceOps):
        def rms_norm(self, x, w, eps):
            return super().rms_norm(x, w, eps) * 1.01

    def broken_pool(name):
        class BrokenPool(ReferenceOps):
            def kda_core(self, z, g_raw, w, st, meta, cfg, shard):
                out = super().kda_core(z, g_raw, w, st, meta, cfg, shard)
                getattr(st, name)[1:] += 1  # the step's output is right; only a later step would read this
                return out
        return BrokenPool()

    for test, broken in ((ReferenceOps(), set()), (PaddedReferenceOps(), set()), (BrokenNorm(), {"rms_norm"}),
                         (broken_pool("rec"), {"kda_core.rec"}), (broken_pool("conv"), {"kda_core.conv"})):
        ops = ComparedOps(test, ReferenceOps())
        ex = SpecializedDecode(model, max_requests=2, max_len=32, buckets=[(2, 1)], ops=ops, graphs=False,
                               log=lambda _: None)
        assert {w.router.shape[0] for w in ex.moe.values()} == {32 if isinstance(test, PaddedReferenceOps) else 8}
        slots = prefill(model, ex.state, [[1, 2, 3], [4, 5]])
        ops.report.clear()
        ex(torch.tensor([6, 7]), [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)], ex.state)
        off = {op for op, _, err in ops.report if (err != 1.0 if op == "route.ids_equal" else err > 0)}
        assert off == broken, ops.report


def test_engine_counts_the_kernels_of_every_specialized_step(model):
    """The path counters list, per specialized step, each op the replayed bucket runs."""
    from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import SPECIALIZED, PathCounters, Route

    ex = _executor(model)

    class Admit:
        counters = PathCounters()

        def route(self, facts):
            r = Route(SPECIALIZED, "test", "env", ex.plan(facts))
            self.counters.record_route(r)
            return r

    d = Admit()
    Engine(model, dispatcher=d, specialized=ex, state=ex.state, max_requests=4, max_len=96).generate(
        [Request([1, 2, 3], SamplingParams(max_tokens=4))])
    per_step = ex.launches((1, 1))
    assert d.counters.steps[SPECIALIZED] == 3
    assert d.counters.kernels["attn_res"] == 3 * per_step.count("attn_res") > 0
    assert d.counters.kernels["kda_core"] == 3 * len(model.cfg.kda_layers)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_equal_the_reference_ranks(tp):
    """Each rank's executor, meeting its peers in the collectives, gives that rank's reference
    logits bit for bit: the executor reduces and gathers exactly where the reference does.
    (tests/test_distributed.py runs the same across gloo processes.)"""
    out = ThreadGroup.run(tp, lambda coll: executor_rank_steps(coll, tp))
    assert all(all(same) for same, _ in out), [same for same, _ in out]
    assert all(torch.equal(out[0][1], o[1]) for o in out[1:])  # every rank holds the full-vocab logits


def test_the_harness_on_the_executor_gives_the_standard_greedy_tokens_for_256_steps(model):
    """Issue 8's end-to-end item in its CPU form: the `mini` model through the harness as
    `k3-decode generate` builds it (dispatcher, `build_specialized`, `Engine`), greedy, two
    requests of 256 tokens. Every decode step is served by the executor (reference ops here; the
    kernels' form is the tiny model's on the H200, `test_features_cuda.py` and the evals) and the
    tokens equal the standard path's, all 256 of each."""
    steps, prompts = 256, [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
    max_len = max(map(len, prompts)) + steps
    reqs = [Request(p, SamplingParams(max_tokens=steps)) for p in prompts]
    d = Dispatcher(BackendOptions.parse({"decode_backend": "latency_specialized", "allow_unvalidated": True}),
                   Deployment.describe(gpu="H200", tp=1, max_model_len=max_len, expert_dtype="bfloat16"))
    ex = build_specialized(model, d, len(reqs), max_len, reference_on_cpu=True)
    assert ex is not None and d.executor is ex
    spec = Engine(model, dispatcher=d, specialized=ex, state=ex.state, max_requests=len(reqs), max_len=max_len)
    std = Engine(model, max_requests=len(reqs), max_len=max_len)
    got, want = spec.generate(reqs), std.generate(reqs)
    assert [len(c.output_ids) for c in got] == [steps, steps]
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert len(set(want[0].output_ids)) > 8  # not a constant stream, which any path would agree on
    assert spec.stats.prefill_steps == 1 and spec.stats.paths == {"standard": 1, "specialized": steps - 1}
    assert d.counters.as_dict()["steps"]["specialized"] == steps - 1
