"""benchmarks/bench_moe.py's verdicts on the CPU: each target is judged on its worst case, and
the TP8 M = 64 target on the speedup over the graphed standard form (not the eager reference)."""

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.benchmarks.bench_moe import targets_of  # noqa: E402


def _case(tp, m, time_us, floor_us, graphed_us, eager_us, all_experts_us):
    return {"name": f"routed_experts@tp{tp} M={m}", "shape": {"tp": tp, "m": m}, "time_us": time_us,
            "floor_us": floor_us, "all_experts_floor_us": all_experts_us,
            "speedup_vs_standard_graphed": graphed_us / time_us, "speedup_vs_reference_eager": eager_us / time_us}


def test_targets_take_the_worst_case_and_the_graphed_baseline():
    results = [_case(16, 1, 40.0, 20.0, 300.0, 6000.0, 1162.0),
               _case(16, 8, 200.0, 160.0, 900.0, 40000.0, 1162.0),
               _case(16, 64, 1500.0, 800.0, 3000.0, 200000.0, 1162.0),
               _case(8, 64, 2000.0, 1190.0, 2400.0, 180000.0, 1744.0),
               {"name": "router M=1", "shape": {"m": 1}, "time_us": 6.0}]
    by_name = {t["name"].split(":")[0]: t for t in targets_of(results)}
    small = by_name["TP16, M<=8"]
    assert small["value"] == 2.0 and not small["met"] and small["worst_case"] == "routed_experts@tp16 M=1"
    tp8 = by_name["TP8, M=64"]
    assert tp8["value"] == 1.2 and not tp8["met"], "judged on the graphed baseline, not the eager one (90x)"
    floor = by_name["every case"]
    assert not floor["met"] and floor["worst_case"] == "routed_experts@tp16 M=64"
