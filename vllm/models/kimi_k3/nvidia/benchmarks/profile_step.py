"""Where a specialized decode step's time goes: its CUDA-graph replay, kernel by kernel.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.profile_step [--tp 16] [--rows 1 8] [--q 1]
                                                                 [--context 4096] [--out FILE.json]

Builds the same per-rank 12-layer K3 block as `decode_latency.py` (seeded random weights,
one GPU, collectives not timed), captures the bucket's graph, replays it `--steps` times
under `torch.profiler` and sums the GPU time of every kernel per step. Under PDL a kernel
starts while the previous one runs (the skinny GEMM prefetches weights, then waits), so those
sums overlap; each instant of GPU time is therefore also charged to the oldest kernel running
then, the one the others wait on (`critical_us`: these add up to the GPU's busy time, nothing
counted twice). Prints the kernels by that share (name, launches per step, own µs, critical
µs, share) and, beside the busy time, the span of one replay measured with CUDA events: their
difference is the time the GPU sat between kernels (launch gaps and tails). A diagnostic, not
evidence: it tells which kernel to work on next; `decode_latency.py` measures the figures that
are recorded.
"""

from __future__ import annotations

import argparse
import heapq
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..latency_specialized.decode_ops import KernelOps
from ..latency_specialized.executor import SpecializedDecode
from .bench_skinny_gemm import require_cuda
from .block_parity import fill_state, k3_block, segments
from .decode_latency import median_ms


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and compiler-mangled tails."""
    name = re.sub(r"<.*>", "", kernel)
    name = re.sub(r"_[0-9a-f]{8,}.*$", "", name)  # CuTe DSL appends a hash of the compiled variant
    return name[:90]


def critical_us(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the µs in which a kernel of that name was the oldest one running, over
    (start, end, name) intervals: the busy time split among the kernels with nothing counted
    twice (their sum is the union of the intervals)."""
    spans = sorted(spans)
    bounds = sorted({t for start, end, _ in spans for t in (start, end)})
    out: dict[str, float] = defaultdict(float)
    running: list[tuple[float, float, str]] = []  # a heap: the oldest start on top
    i = 0
    for a, b in zip(bounds, bounds[1:]):
        while i < len(spans) and spans[i][0] <= a:
            heapq.heappush(running, spans[i])
            i += 1
        while running and running[0][1] <= a:  # ended: dropped once it is the oldest
            heapq.heappop(running)
        if running:
            out[running[0][2]] += b - a
    return out


def kernel_table(events, steps: int) -> list[dict]:
    """Per kernel name: launches, own GPU µs and critical µs per step, largest critical first."""
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    spans = []
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = short_name(e.name)
            calls[name] += 1
            total[name] += e.device_time
            spans.append((e.time_range.start, e.time_range.end, name))
    critical = critical_us(spans)
    rows = [{"kernel": k, "launches_per_step": calls[k] / steps, "us_per_step": total[k] / steps,
             "critical_us_per_step": critical[k] / steps} for k in total]
    rows.sort(key=lambda r: -r["critical_us_per_step"])
    busy = sum(r["critical_us_per_step"] for r in rows)
    for r in rows:
        r["share"] = r["critical_us_per_step"] / busy if busy else 0.0
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20, help="profiled replays")
    ap.add_argument("--top", type=int, default=25, help="kernels printed")
    ap.add_argument("--out", help="JSON file for the table")
    args = ap.parse_args(argv)
    require_cuda(ap)
    bad = [r for r in args.rows if r % args.q]
    if bad:
        print(f"error: --rows {bad} are not multiples of --q {args.q}", file=sys.stderr)
        return 2
    model = k3_block(args.tp)
    keys = [(r, args.q) for r in sorted(set(args.rows))]
    requests = max(r for r, _ in keys) // args.q
    ex = SpecializedDecode(model, max_requests=requests, max_len=args.context + args.q, buckets=keys, ops=KernelOps())
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = []
    for key in keys:
        report.append(profile_bucket(ex, model, key, args, gen))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def profile_bucket(ex: SpecializedDecode, model, key: tuple[int, int], args, gen: torch.Generator) -> dict:
    rows, q = key
    for r in range(ex.state.max_requests):
        ex.state.free(r)
    slots = fill_state(ex.state, rows // q, args.context, gen)
    ids = torch.randint(0, model.w.lm_head.shape[0], (rows,), generator=gen, device="cuda")
    ex(ids, segments(ex.state, slots, q), ex.state)  # fills the bucket's metadata
    span_us = median_ms(lambda: ex.replay(key), 50) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.replay(key)
        torch.cuda.synchronize()
    table = kernel_table(prof.events(), args.steps)
    busy = sum(r["critical_us_per_step"] for r in table)
    own = sum(r["us_per_step"] for r in table)
    print(f"TP{args.tp} rows {rows} q {q} ctx {args.context}: replay {span_us:.1f} us, GPU busy {busy:.1f} us "
          f"({sum(r['launches_per_step'] for r in table):.0f} launches), idle {span_us - busy:.1f} us; "
          f"kernels' own times {own:.1f} us, {own - busy:.1f} of them overlapped (PDL)")
    print(f"{'kernel':90s} {'n':>5s} {'own us':>8s} {'crit us':>8s} {'share':>6s}")
    for r in table[:args.top]:
        print(f"{r['kernel']:90s} {r['launches_per_step']:5.0f} {r['us_per_step']:8.1f} "
              f"{r['critical_us_per_step']:8.1f} {r['share']:6.1%}")
    return {"tp": args.tp, "rows": rows, "q": q, "context": args.context, "replay_us": span_us, "busy_us": busy,
            "own_us": own, "kernels": table}


if __name__ == "__main__":
    sys.exit(main())
