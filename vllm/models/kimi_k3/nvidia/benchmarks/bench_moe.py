"""Benchmark of the MoE kernels: routed experts (kernels/moe_experts.py) at K3's TP16 and TP8
shapes, and the router epilogue (kernels/moe_router.py).

Per TP size (896 experts, H_lat 3584, the rank's intermediate as vLLM stores it: TP16's 192 real
columns zero-padded to 256, of which the kernels read the 192) and rows M in
{1, 2, 4, 8, 16, 32, 64}: the kernels timed as a CUDA graph of back-to-back launches with CUDA
events (median of replays after warm-up), each launch on its own routing (uniform random
distinct experts per row) and its own x_lat, so consecutive launches read different experts
and the L2 stays cold (one launch at M = 1 already reads 16 experts, 88 MB at TP16). The floor
of a launch is the bytes it must move, the real weights of the experts its rows selected, each once,
plus x_lat, the routing and y, over the device-to-device copy bandwidth measured in the same
run; the all-experts floor (the whole w13 + w2) is printed beside it. A time below that floor
shows that not every expert was read; above it, as at TP16 M = 64, it shows nothing either
way, and tests/test_moe_unread_experts.py is the proof.

Baselines on the same inputs: reference/moe.py's gather loop in eager mode (timed per call
with events: its torch.unique / tolist sync the host, so it can neither be graphed nor
compiled without a recompile per expert), and the standard path's own capturable form of the
same math (`torch_ops.TorchOps.routed_experts`: batched GEMVs over gathered experts for few
rows, every expert on every row beyond that) in the same kind of CUDA graph as ours, the
strongest torch baseline built here and the one the TP8 M = 64 target is held to; with
`--compile`, that form under torch.compile too (one static graph a case, in the same kind of
CUDA graph, its output checked against the reference), the baseline the issue names, to which
the TP16 M <= 8 and TP8 M = 64 speedup targets are then held. Each case is also checked against
the reference. The router epilogue (fp32 logits [M, 896] -> top-16 ids and
weights) is timed the same way against reference/moe.py's `route`, both graphed, and its ids
checked for equality.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_moe --out $OUT/moe_bench.json

writes an evidence record (kind "kernel-bench", family "moe") and prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from ..kernels import moe_experts, moe_router
from ..latency_specialized.config import PRESETS
from ..latency_specialized.evidence import write_record
from ..latency_specialized.torch_ops import TorchOps
from ..reference.dense_mlp import activation_clips
from ..reference.moe import _routed_latent, route
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda, time_graph

SOURCES = (
    "vllm/models/kimi_k3/nvidia/kernels/moe_experts.py",
    "vllm/models/kimi_k3/nvidia/kernels/moe_router.py",
    "vllm/models/kimi_k3/nvidia/benchmarks/bench_moe.py",
)
BENCH_ROWS = (1, 2, 4, 8, 16, 32, 64)
ROUTING_SETS = 24  # launches per graph, each with its own routing and x_lat
REL_ERR_BOUND = 1e-2
K3 = PRESETS["k3"]


def uniform_routing(m: int, n_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """ids [m, top_k] int32: each row `top_k` distinct experts drawn uniformly (a router's shape)."""
    ids = torch.rand(m, n_experts, generator=gen, device="cuda").argsort(dim=1)[:, :top_k]
    return ids.to(torch.int32).contiguous()


def expert_weights(tp: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """w13 [E, 2·I, H_lat] and w2 [E, H_lat, I] bf16 of K3's rank at `tp`, scaled for O(1) outputs,
    laid out as vLLM stores them (TP16: 192 real columns zero-padded to 256), and the real width."""
    s = K3.shard(tp, 0)
    h, i_pad, inter = K3.routed_expert_hidden_size, s.moe_inter, s.moe_inter_real
    w13 = torch.randn(K3.num_experts, 2 * i_pad, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(K3.num_experts, h, i_pad, generator=gen, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    w13[:, inter:i_pad] = 0
    w13[:, i_pad + inter:] = 0
    w2[:, :, inter:] = 0
    return w13, w2, inter


def standard_experts(w13: torch.Tensor, w2: torch.Tensor):
    """The standard path's capturable routed experts (`TorchOps.routed_experts`) over these
    weights, as a function of the step's tensors alone (x_lat, ids, weights): what torch.compile
    is given. The stored, padded intermediate is multiplied whole, as vLLM does."""
    standard = TorchOps()
    expert_w, shard = SimpleNamespace(w13=w13, w2=w2), SimpleNamespace(moe_inter=w2.shape[2])

    def run(x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return standard.routed_experts(x_lat, ids, weights, expert_w, K3, shard)
    return run


def _reference_call(w13: torch.Tensor, w2: torch.Tensor):
    inter = w2.shape[2]

    def run(x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _routed_latent(SimpleNamespace(w13=w13, w2=w2), K3, SimpleNamespace(moe_inter=inter),
                              x_lat, weights, ids.long())
    return run


def median_us(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median µs of one call fn(i), CUDA events around it (the call may sync the host)."""
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_case(tp: int, w13: torch.Tensor, w2: torch.Tensor, inter: int, m: int, copy_bw: float,
               gen: torch.Generator, compiled: bool = False) -> dict:
    """The kernels read `inter` real columns of each slice; the standard path (reference, graphed
    torch) multiplies the stored, padded slice, as it does in vLLM. The floor counts real bytes."""
    n_experts, _, h = w13.shape
    i_pad = w2.shape[2]
    top_k = K3.num_experts_per_token
    beta, linear_beta = activation_clips(K3)
    expert_bytes = 3 * h * inter * 2
    sets = []
    for _ in range(ROUTING_SETS):
        ids = uniform_routing(m, n_experts, top_k, gen)
        weights = torch.rand(m, top_k, generator=gen, device="cuda") + 0.05
        weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
        x_lat = torch.randn(m, h, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")
        sets.append((x_lat, ids, weights, out))
    reference = _reference_call(w13, w2)

    def ours(i: int) -> None:
        x_lat, ids, weights, out = sets[i % len(sets)]
        moe_experts.launch(x_lat, ids, weights, w13, w2, out, inter=inter, beta=beta, linear_beta=linear_beta)

    ours(0)
    x0, ids0, wts0, out0 = sets[0]
    ref = reference(x0, ids0, wts0).float()
    rel = float(((out0.float() - ref).norm(dim=1) / ref.norm(dim=1)).max())
    t_ours = time_graph([lambda i=i: ours(i) for i in range(len(sets))])
    t_ref = median_us(lambda i: reference(*sets[i % len(sets)][:3]))
    standard = standard_experts(w13, w2)
    baselines = {"reference_eager": t_ref,
                 "standard_graphed": time_graph([lambda s=s: standard(*s[:3]) for s in sets])}
    baseline_rel_err = {}
    if compiled:
        torch._dynamo.reset()  # a graph per case, never the recompile limit's eager fallback
        standard_compiled = torch.compile(standard, dynamic=False)
        baselines["standard_compiled"] = time_graph([lambda s=s: standard_compiled(*s[:3]) for s in sets])
        got = standard_compiled(x0, ids0, wts0).float()
        baseline_rel_err["standard_compiled"] = float(((got - ref).norm(dim=1) / ref.norm(dim=1)).max())

    unique = statistics.mean(int(torch.unique(s[1]).numel()) for s in sets)
    nbytes = unique * expert_bytes + m * h * 2 * 2 + m * top_k * 8
    floor_us = nbytes / (copy_bw * 1e12) * 1e6
    all_experts_floor_us = n_experts * expert_bytes / (copy_bw * 1e12) * 1e6
    return {
        "name": f"routed_experts@tp{tp} M={m}",
        "shape": {"tp": tp, "m": m, "experts": n_experts, "inter": inter, "inter_stored": i_pad, "h_lat": h,
                  "top_k": top_k},
        "status": "pass" if rel < REL_ERR_BOUND else "fail",
        "rel_err_max_row": rel,
        "time_us": t_ours,
        "floor_us": floor_us,
        "frac_of_floor": floor_us / t_ours,
        "TBps": nbytes / (t_ours * 1e-6) / 1e12,
        "selected_experts_mean": unique,
        "all_experts_floor_us": all_experts_floor_us,
        "below_all_experts_floor": t_ours < all_experts_floor_us,
        "baseline_us": baselines,
        **{f"speedup_vs_{name}": us / t_ours for name, us in baselines.items()},
        **({"baseline_rel_err": baseline_rel_err} if baseline_rel_err else {}),
    }


def bench_router(m: int, gen: torch.Generator) -> dict:
    """The router epilogue at K3's 896 experts, top-16, against `route`, both as CUDA graphs."""
    n_experts, top_k = K3.num_experts, K3.num_experts_per_token
    inputs = [(torch.randn(m, n_experts, generator=gen, device="cuda") * 2,
               torch.randn(n_experts, generator=gen, device="cuda") * 0.1) for _ in range(ROUTING_SETS)]
    outs = [(torch.empty(m, top_k, device="cuda"), torch.empty(m, top_k, dtype=torch.int32, device="cuda"))
            for _ in inputs]

    def ours(i: int) -> None:
        moe_router.launch(*inputs[i], top_k, renormalize=K3.moe_renormalize,
                          routed_scaling_factor=K3.routed_scaling_factor, weights_out=outs[i][0], ids_out=outs[i][1])

    ours(0)
    ref_w, ref_ids = route(*inputs[0], K3)
    ids_equal = bool(torch.equal(outs[0][1].long(), ref_ids))
    w_err = float((outs[0][0] - ref_w).abs().max())
    t_ours = time_graph([lambda i=i: ours(i) for i in range(len(inputs))])
    t_ref = time_graph([lambda i=i: route(*inputs[i], K3) for i in range(len(inputs))])
    return {"name": f"router M={m}", "shape": {"m": m, "experts": n_experts, "top_k": top_k},
            "status": "pass" if ids_equal and w_err < 1e-5 else "fail", "ids_equal": ids_equal,
            "max_abs_weight_err": w_err, "time_us": t_ours, "baseline_us": {"reference_graphed": t_ref},
            "speedup_vs_reference": t_ref / t_ours}


def targets_of(results: list[dict]) -> list[dict]:
    """The issue's targets that this op alone can be held to (the worst case decides)."""
    def worst(name, target, cases, key, bound, better_high=True):
        if not cases:
            return None
        vals = [c[key] for c in cases]
        v = min(vals) if better_high else max(vals)
        return {"name": name, "target": target, "value": v,
                "met": v >= bound if better_high else v <= bound,
                "cases": len(cases), "worst_case": cases[vals.index(v)]["name"]}

    experts = [r for r in results if "tp" in r["shape"]]
    tp16_small = [r for r in experts if r["shape"]["tp"] == 16 and r["shape"]["m"] <= 8]
    tp8_64 = [r for r in experts if r["shape"]["tp"] == 8 and r["shape"]["m"] == 64]

    def compiled(cases):  # where the compiled baseline ran and computed the reference's result
        return [r for r in cases if "speedup_vs_standard_compiled" in r
                and r["baseline_rel_err"]["standard_compiled"] < REL_ERR_BOUND]
    out = [
        worst("TP16, M<=8: time over the selected-expert floor (routed experts only)", "<= 1.3",
              [dict(r, over_floor=r["time_us"] / r["floor_us"]) for r in tp16_small], "over_floor", 1.3,
              better_high=False),
        # the issue names torch.compile of the reference, whose host syncs rule it out: its
        # capturable standard form stands in, compiled where --compile ran, else graphed
        worst("TP16, M<=8: speedup vs the standard path's capturable form under torch.compile", ">= 1.5",
              compiled(tp16_small), "speedup_vs_standard_compiled", 1.5),
        worst("TP8, M=64: speedup vs the standard path's capturable form under torch.compile", ">= 1.3",
              compiled(tp8_64), "speedup_vs_standard_compiled", 1.3)
        if compiled(tp8_64) else
        worst("TP8, M=64: speedup vs the standard path's capturable form in a CUDA graph", ">= 1.3",
              tp8_64, "speedup_vs_standard_graphed", 1.3),
        worst("every case: faster than reading every expert once (a time above it proves nothing either way)",
              "time < all-experts floor", [dict(r, margin=r["all_experts_floor_us"] / r["time_us"])
                                           for r in experts], "margin", 1.0),
    ]
    return [t for t in out if t is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tps", type=int, nargs="+", default=[16, 8])
    p.add_argument("--rows", type=int, nargs="+", default=list(BENCH_ROWS))
    p.add_argument("--compile", action="store_true",
                   help="also time the standard form under torch.compile (a compile a case: minutes)")
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
    require_cuda(p)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_bw = copy_bandwidth_TBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for tp in args.tps:
        w13, w2, inter = expert_weights(tp, gen)
        for m in args.rows:
            results.append(bench_case(tp, w13, w2, inter, m, copy_bw, gen, args.compile))
        del w13, w2
        torch.cuda.empty_cache()
    router = [bench_router(m, gen) for m in args.rows]
    results += router
    targets = targets_of(results)
    if args.out:
        write_record(args.out, "kernel-bench", "moe", "python -m vllm.models.kimi_k3.nvidia.benchmarks."
                     "bench_moe " + " ".join(argv if argv is not None else sys.argv[1:]),
                     SOURCES, results, targets, copy_bandwidth_TBps=copy_bw,
                     extra={"timing": f"CUDA graph of {ROUTING_SETS} back-to-back launches, each on its own "
                                      "routing and x_lat (cold L2 by construction), median of 15 replays; "
                                      "standard graphed: the same graph of TorchOps.routed_experts; "
                                      "standard compiled (--compile): the same graph of it under torch.compile; "
                                      "reference: eager, per call, median of 10",
                            "wall_s": time.time() - t0})
    print(f"copy bandwidth {copy_bw:.2f} TB/s; {len(results)} cases in {time.time() - t0:.0f} s")
    print(f"{'case':26s} {'ours us':>8s} {'floor':>7s} {'%floor':>6s} {'TB/s':>5s} {'ref us':>8s} "
          f"{'x ref':>6s} {'graphed':>8s} {'x gr':>5s} {'compiled':>8s} {'all-exp':>8s} {'relerr':>8s}")
    for r in results[:len(results) - len(router)]:
        print(f"{r['name']:26s} {r['time_us']:8.2f} {r['floor_us']:7.2f} {100 * r['frac_of_floor']:6.0f} "
              f"{r['TBps']:5.2f} {r['baseline_us']['reference_eager']:8.1f} {r['speedup_vs_reference_eager']:6.1f} "
              f"{r['baseline_us']['standard_graphed']:8.1f} {r['speedup_vs_standard_graphed']:5.2f} "
              f"{r['baseline_us'].get('standard_compiled', float('nan')):8.1f} {r['all_experts_floor_us']:8.0f} {r['rel_err_max_row']:8.1e}{'' if r['status'] == 'pass' else ' FAIL'}")
    for r in router:
        print(f"{r['name']:26s} {r['time_us']:8.2f} reference {r['baseline_us']['reference_graphed']:8.2f} "
              f"x{r['speedup_vs_reference']:5.1f} ids equal {r['ids_equal']}{'' if r['status'] == 'pass' else ' FAIL'}")
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'}; "
              f"worst {t['worst_case']})")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
