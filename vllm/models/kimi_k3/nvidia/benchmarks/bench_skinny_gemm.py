"""Benchmark of the skinny GEMM against cuBLAS (torch.mm) on every K3 projection shape.

For each shape of `kernels/shapes.py` and each M, both run in the same process on the same
inputs, each timed as a CUDA graph of back-to-back launches (launch gaps removed) with CUDA
events, median over many replays after warm-up. The L2 (60 MB on the H200) is kept cold: the
launches of one graph rotate over enough weight copies that a replay touches more than 3× the
L2. The floor of a launch is its bytes (W + x + y) over the device-to-device copy bandwidth
measured in the same run. Each timed result is also checked against reference/ops.linear.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_skinny_gemm --out $OUT/bench.json

writes an evidence record (kind "kernel-bench", family "gemm") and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from typing import Callable

import torch

from ..kernels import skinny_gemm
from ..kernels.device import facts
from ..kernels.shapes import GemmShape, k3_gemm_shapes
from ..latency_specialized.evidence import write_record
from ..reference.ops import linear

SOURCES = (
    "vllm/models/kimi_k3/nvidia/kernels/skinny_gemm.py",
    "vllm/models/kimi_k3/nvidia/kernels/skinny_gemm_wgmma.py",
    "vllm/models/kimi_k3/nvidia/kernels/gemm_store.py",
    "vllm/models/kimi_k3/nvidia/kernels/shapes.py",
    "vllm/models/kimi_k3/nvidia/benchmarks/bench_skinny_gemm.py",
)
BENCH_ROWS = (1, 2, 4, 8, 16, 32, 64)
COLD_BYTES = 192 * 2**20  # weights one graph replay touches: > 3× the H200's L2
REL_ERR_BOUND = 1e-2  # bf16 output rounding is ~2e-3 relative; fp32 output ~1e-6


def require_cuda(ap: argparse.ArgumentParser) -> None:
    """Stop with a usage error (exit status 2) when no CUDA device is present. Every GPU benchmark,
    sweep and runner checks this right after its arguments, so that a CPU host gets one line,
    not torch's assertion from inside the first timing loop, and a runner never reports tests
    that were all skipped as passed."""
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: it runs and times kernels on the GPU (on the lent H200 through "
                 ".ci/h200_call.sh: kernels/README.md, 'Running everything on the GPU in one call')")


def copy_bandwidth_TBps(nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (METHOD.md)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e12


def time_graph(launches: list[Callable[[], object]], replays: int = 15, warmup: int = 3) -> float:
    """Median µs per launch of a CUDA graph holding `launches` back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in launches[:2]:  # compile / pick cuBLAS algorithms outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    times = []
    for i in range(warmup + replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3 / len(launches))
    del graph
    return statistics.median(times)


def _cublas(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    if out.dtype == torch.float32:  # the router: bf16 operands, fp32 logits, as the stock path
        try:
            torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
            return lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError):  # a torch without mm(out_dtype=): bf16 logits, same weight bytes
            out = torch.empty(out.shape, dtype=torch.bfloat16, device=out.device)
    return lambda: torch.mm(x, w.t(), out=out)


class ShapeInputs:
    """Weight copies for a cold L2 (one graph replay touches > COLD_BYTES) and the launch count."""

    def __init__(self, shape: GemmShape, seed: int = 0) -> None:
        self.shape = shape
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        copies = max(1, math.ceil(COLD_BYTES / shape.weight_bytes))
        self.n_launch = min(max(20, copies), 2000)
        self.ws = [torch.randn(shape.n, shape.k, device="cuda", dtype=torch.bfloat16, generator=self.gen)
                   for _ in range(min(copies, self.n_launch))]

    def weight(self, i: int) -> torch.Tensor:
        return self.ws[i % len(self.ws)]


def describe(tiling: skinny_gemm.Tiling | skinny_gemm.WgmmaTiling) -> dict:
    """A tiling as JSON, with the kernel it selects."""
    return {"kernel": "wgmma" if isinstance(tiling, skinny_gemm.WgmmaTiling) else "warp",
            **dataclasses.asdict(tiling)}


def bench_case(inp: ShapeInputs, m: int, copy_bw: float,
               tiling: skinny_gemm.Tiling | skinny_gemm.WgmmaTiling | None = None, baseline: bool = True) -> dict:
    """Time ours (and cuBLAS) on one shape and M; check ours against the fp32 reference."""
    shape = inp.shape
    x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16, generator=inp.gen)
    out = torch.full((m, shape.n), float("nan"), device="cuda", dtype=shape.out_dtype)
    skinny_gemm.launch(x, inp.weight(0), out, out_dtype=shape.out_dtype, tiling=tiling)
    ref = linear(x, inp.weight(0), torch.float32)
    rel = float((out.float() - ref).norm() / ref.norm())
    ours = time_graph([
        (lambda w=inp.weight(i): skinny_gemm.launch(x, w, out, out_dtype=shape.out_dtype, tiling=tiling))
        for i in range(inp.n_launch)])
    nbytes = shape.weight_bytes + x.numel() * 2 + out.numel() * out.element_size()
    floor_us = nbytes / (copy_bw * 1e12) * 1e6
    dev = facts(x.device)
    res = {
        "name": f"{shape.name} M={m}",
        "shape": {"n": shape.n, "k": shape.k, "m": m, "out_dtype": str(shape.out_dtype).removeprefix("torch.")},
        "status": "pass" if rel < REL_ERR_BOUND and math.isfinite(rel) else "fail",
        "rel_err": rel,
        "time_us": ours,
        "floor_us": floor_us,
        "TBps": nbytes / (ours * 1e-6) / 1e12,
        "frac_of_copy_bw": floor_us / ours,
        "tiling": describe(tiling or skinny_gemm.pick_tiling(dev.arch, shape.n, shape.k, -(-m // 8), dev.sm_count)),
    }
    if baseline:
        res["baseline_us"] = {"cublas": time_graph([_cublas(x, inp.weight(i), out) for i in range(inp.n_launch)])}
        res["speedup_vs_cublas"] = res["baseline_us"]["cublas"] / ours
    return res


def targets_of(results: list[dict]) -> list[dict]:
    """The issue's targets, each over the cases it covers (the worst case decides)."""
    def worst(name, target, cases, key, better_high=True, bound=None):
        if not cases:
            return None
        vals = [c[key] for c in cases]
        v = min(vals) if better_high else max(vals)
        return {"name": name, "target": target, "value": v, "met": v >= bound,
                "cases": len(cases), "worst_case": cases[vals.index(v)]["name"]}

    big_small_m = [r for r in results if r["shape"]["m"] <= 8 and r["shape"]["n"] * r["shape"]["k"] * 2 >= 8e6]
    small = [r for r in results if r["shape"]["n"] * r["shape"]["k"] * 2 < 8e6 and "speedup_vs_cublas" in r]
    timed = [r for r in results if "speedup_vs_cublas" in r]
    m64 = [r for r in timed if r["shape"]["m"] == 64]
    out = [
        worst("M<=8, weights >= 8 MB: fraction of copy bandwidth", ">= 0.85", big_small_m, "frac_of_copy_bw", bound=0.85),
        worst("every shape and M: speedup vs cuBLAS", ">= 1.0", timed, "speedup_vs_cublas", bound=1.0),
        worst("weights < 8 MB: speedup vs cuBLAS", ">= 1.3", small, "speedup_vs_cublas", bound=1.3),
        worst("M=64: speedup vs cuBLAS", ">= 1.0", m64, "speedup_vs_cublas", bound=1.0),
    ]
    return [t for t in out if t is not None]


def unique_shapes(tps: tuple[int, ...]) -> list[GemmShape]:
    """One shape per (N, K, dtype): replicated projections repeat across TP sizes."""
    seen, out = set(), []
    for s in k3_gemm_shapes(tps):
        key = (s.n, s.k, s.out_dtype)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tps", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--rows", type=int, nargs="+", default=list(BENCH_ROWS))
    p.add_argument("--only", nargs="*", default=None, help="shape names (e.g. lm_head@tp8) to run")
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
    require_cuda(p)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_bw = copy_bandwidth_TBps()
    shapes = [s for s in unique_shapes(tuple(args.tps)) if args.only is None or s.name in args.only]
    results = []
    for s in shapes:
        inp = ShapeInputs(s)
        for m in args.rows:
            results.append(bench_case(inp, m, copy_bw))
        del inp
        torch.cuda.empty_cache()
    targets = targets_of(results)
    if args.out:
        write_record(args.out, "kernel-bench", "gemm", "python -m vllm.models.kimi_k3.nvidia.benchmarks."
                     "bench_skinny_gemm " + " ".join(argv if argv is not None else sys.argv[1:]),
                     SOURCES, results, targets, copy_bandwidth_TBps=copy_bw,
                     extra={"timing": "CUDA graph of back-to-back launches over rotating weight copies "
                                      f"(> {COLD_BYTES >> 20} MiB per replay), median of 15 replays",
                            "wall_s": time.time() - t0})
    print(f"copy bandwidth {copy_bw:.2f} TB/s; {len(results)} cases in {time.time() - t0:.0f} s")
    print(f"{'shape':22s} {'M':>3s} {'ours us':>8s} {'cuBLAS':>8s} {'floor':>7s} {'TB/s':>5s} {'%bw':>4s} {'x cuBLAS':>8s} {'relerr':>8s}")
    for r in results:
        print(f"{r['name'].split(' ')[0]:22s} {r['shape']['m']:3d} {r['time_us']:8.2f} "
              f"{r.get('baseline_us', {}).get('cublas', float('nan')):8.2f} {r['floor_us']:7.2f} "
              f"{r['TBps']:5.2f} {100 * r['frac_of_copy_bw']:4.0f} {r.get('speedup_vs_cublas', float('nan')):8.2f} "
              f"{r['rel_err']:8.1e}{'' if r['status'] == 'pass' else ' FAIL'}")
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'}; worst {t['worst_case']})")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
