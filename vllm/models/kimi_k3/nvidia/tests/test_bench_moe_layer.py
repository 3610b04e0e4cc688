"""benchmarks/bench_moe_layer.py on the CPU: the floor counts every weight of the layer once and
the selected experts, routing agreement compares expert sets, and each target is judged on its
worst case, the speedups against the compiled standard layer where --compile ran, else the
graphed one (named so), never the eager reference."""

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

import torch  # noqa: E402

from vllm.models.kimi_k3.nvidia.benchmarks.bench_moe_layer import (layer_bytes, routing_agreement,  # noqa: E402
                                                                    targets_of)
from vllm.models.kimi_k3.nvidia.evals.tiny import config_named  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import RandomSource, load_rank  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.params import MoEWeights  # noqa: E402


def test_the_floor_counts_each_dense_weight_once_and_the_selected_experts():
    cfg = config_named("tiny")
    w = next(lw.mlp for lw in load_rank(RandomSource(cfg, seed=0), cfg, tp=1, rank=0).layers
             if isinstance(lw.mlp, MoEWeights))
    dense = sum(t.numel() * t.element_size() for t in (w.router, w.bias, w.latent_down, w.latent_norm,
                                                        w.latent_up, w.shared_gate_up, w.shared_down))
    assert w.bias.dtype == torch.float32 and dense > 0
    assert layer_bytes(w, 0, 1000, 2, cfg.hidden_size) == dense + 2 * 2 * cfg.hidden_size * 2
    assert layer_bytes(w, 3.5, 1000, 2, cfg.hidden_size) - layer_bytes(w, 0, 1000, 2, cfg.hidden_size) == 3500


def test_routing_agreement_compares_the_experts_picked_not_their_order():
    ours = torch.tensor([[3, 1, 2], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    ref = torch.tensor([[1, 2, 3], [4, 5, 7], [9, 8, 7]])
    assert routing_agreement(ours, ref).tolist() == [True, False, True]


def _case(tp, m, time_us, floor_us, graphed_us, compiled_us=None, compiled_err=0.0):
    r = {"name": f"moe_layer@tp{tp} M={m}", "shape": {"tp": tp, "m": m}, "time_us": time_us, "floor_us": floor_us,
         "speedup_vs_standard_graphed": graphed_us / time_us, "speedup_vs_reference_eager": 100.0,
         "baseline_rel_err": {"standard_graphed": 0.0}, "baseline_routing_agreement": {"standard_graphed": 1.0}}
    if compiled_us is not None:
        r["speedup_vs_standard_compiled"] = compiled_us / time_us
        r["baseline_rel_err"]["standard_compiled"] = compiled_err
        r["baseline_routing_agreement"]["standard_compiled"] = 1.0
    return r


def test_targets_take_the_worst_case_and_say_which_baseline():
    graphed = [_case(16, 1, 60.0, 40.0, 300.0), _case(16, 8, 200.0, 180.0, 250.0), _case(16, 64, 900.0, 700.0, 2000.0),
               _case(8, 64, 1500.0, 1300.0, 1800.0)]
    floor = next(t for t in targets_of(graphed) if t["name"].endswith("over its HBM floor"))
    assert floor["value"] == 1.5 and not floor["met"] and floor["worst_case"] == "moe_layer@tp16 M=1"
    speed = next(t for t in targets_of(graphed) if t["name"].startswith("TP16, M<=8: speedup"))
    assert "in a CUDA graph (--compile not run)" in speed["name"] and speed["value"] == 1.25 and not speed["met"]
    tp8 = next(t for t in targets_of(graphed) if t["name"].startswith("TP8, M=64"))
    assert tp8["value"] == 1.2 and not tp8["met"], "judged on the graphed baseline, not the eager one (100x)"
    compiled = [_case(16, 1, 60.0, 40.0, 300.0, 120.0), _case(16, 8, 200.0, 180.0, 250.0, 400.0)]
    speed = next(t for t in targets_of(compiled) if t["name"].startswith("TP16, M<=8: speedup"))
    assert "under torch.compile" in speed["name"] and speed["value"] == 2.0 and speed["met"]
    # a compiled form that did not compute the reference's result judges nothing
    wrong = [_case(16, 1, 60.0, 40.0, 300.0, 500.0, compiled_err=0.3), _case(16, 8, 200.0, 180.0, 250.0, 400.0)]
    speed = next(t for t in targets_of(wrong) if t["name"].startswith("TP16, M<=8: speedup"))
    assert speed["cases"] == 1 and speed["value"] == 2.0 and speed["worst_case"] == "moe_layer@tp16 M=8"
    assert all(not t["name"].startswith("TP16, M<=8: speedup")
               for t in targets_of([_case(16, 1, 60.0, 40.0, 300.0, 500.0, compiled_err=float("nan"))]))


@pytest.fixture(scope="module")
def model():
    """The tiny model on random weights, on the CPU: its MoE layers stand in for K3's."""
    from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel

    cfg = config_named("tiny")
    return ReferenceModel(cfg, load_rank(RandomSource(cfg, seed=0), cfg, tp=1, rank=0))


def test_the_check_runs_the_executors_moe_layer_against_the_reference(model):
    """`Layer.check` on the CPU, with the reference ops in the executor's `_moe`: every row routed
    alike and the layer's output the reference's; the tiny model's MoE layers stand in for K3's."""
    from vllm.models.kimi_k3.nvidia.benchmarks.bench_moe_layer import Layer
    from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
    from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode

    cfg = model.cfg
    ex = SpecializedDecode(model, max_requests=1, max_len=16, buckets=[(1, 1)], ops=ReferenceOps(), graphs=False,
                           log=lambda _: None)
    layer = Layer(model, ex, ex)
    assert layer.layers and layer.tp == 1
    runs = layer.inputs(3, torch.Generator().manual_seed(0))
    assert len(runs) == 4 * len(layer.layers) and all(v.shape == (3, cfg.hidden_size) for _, v in runs)
    assert set(layer.paths()) == {"ours", "standard_graphed"}
    f, ops = layer.paths()["ours"]
    agree, worst = layer.check(runs, f, ops)
    assert agree == 1.0 and worst < 1e-6
    # a NaN row fails the check (max(0.0, nan) is 0.0 in Python)
    agree, worst = layer.check(runs, lambda i, v: f(i, v) * float("nan"), ops)
    assert agree == 1.0 and worst == float("inf")
    # the variant with the shared experts forked after the routing: the same layer, the executor's
    # own form untouched
    late = Layer(model, ex, ex, variant=True)
    g, _ = late.paths()["ours_shared_after_routing"]
    for i, v in runs[:len(layer.layers)]:
        ops.reset()
        got = g(i, v)
        order = [op for op, _ in ops.trace]
        assert order.index("situ_and_mul") > order.index("moe_route"), order  # shared after the routing
        assert ex.shared_after_routing is False and torch.equal(got, f(i, v))


def test_a_case_reports_the_variant_apart_and_fails_when_it_is_wrong(model, monkeypatch):
    """`Layer.case` with the timing stubbed (it needs a GPU): the variant's time and errors are
    its own fields, not a baseline's nor mixed into ours, and a wrong variant fails the case."""
    from vllm.models.kimi_k3.nvidia.benchmarks import bench_moe_layer as bench
    from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
    from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode

    timed = iter([10.0, 20.0, 12.0, 10.0, 20.0, 12.0])  # ours, standard graphed, the variant; twice
    monkeypatch.setattr(bench, "time_graph", lambda fns: next(timed))
    monkeypatch.setattr(bench, "median_us", lambda f: 100.0)
    ex = SpecializedDecode(model, max_requests=1, max_len=16, buckets=[(1, 1)], ops=ReferenceOps(), graphs=False,
                           log=lambda _: None)
    layer = bench.Layer(model, ex, ex, variant=True)
    r = layer.case(2, 4.0, torch.Generator().manual_seed(0))
    assert r["status"] == "pass" and r["time_us"] == 10.0 and r["variant_us"] == {bench.VARIANT: 12.0}
    assert set(r["baseline_us"]) == {"standard_graphed", "reference_eager"}
    assert r["variant_rel_err"][bench.VARIANT] < 1e-6 and r["variant_routing_agreement"][bench.VARIANT] == 1.0

    wrong = ex._moe
    monkeypatch.setattr(ex, "_moe", lambda w, v, shared_after_routing=None: wrong(w, v) * (
        2.0 if shared_after_routing else 1.0))
    r = layer.case(2, 4.0, torch.Generator().manual_seed(0))
    assert r["status"] == "fail" and r["variant_rel_err"][bench.VARIANT] > 0.5
    assert r["rel_err_max_row"] < 1e-6  # ours is still right, and says so


def test_the_compiled_baseline_compiles_once_per_row_count_and_is_the_reference(model):
    """`compiled_moe` over every MoE layer of the tiny model at three row counts: one dynamo frame
    per row count (the ops' growing trace, a guard, would recompile every call and, past the
    limit, run eager under the name "compiled"), and the reference's output."""
    from torch._dynamo.testing import CompileCounter

    from vllm.models.kimi_k3.nvidia.benchmarks.bench_moe_layer import compiled_moe
    from vllm.models.kimi_k3.nvidia.reference.moe import moe as reference_moe

    cfg = model.cfg
    counter = CompileCounter()
    f = compiled_moe(model, backend=counter, max_requests=1, max_len=16, buckets=[(1, 1)], log=lambda _: None)
    layers = [i for i, layer in enumerate(model.w.layers) if isinstance(layer.mlp, MoEWeights)]
    assert len(layers) > 1
    gen = torch.Generator().manual_seed(1)
    for m in (1, 2, 8):
        for i in layers:
            v = torch.randn(m, cfg.hidden_size, generator=gen).to(torch.bfloat16)
            ref = reference_moe(model.w.layers[i].mlp, cfg, model.shard, v, model.coll).float()
            assert torch.equal(f(i, v).float(), ref), (m, i)
            assert f.ops.routed, "the compiled call leaves the experts it picked"
    assert counter.frame_count == 3
