"""Benchmark of MLA decode attention (kernels/mla_decode.py + mla_combine.py) per MLA layer.

Cases: TP16 / TP8 heads per rank (6 / 12), q = 1 and 8 tokens per request, 1 / 8 / 64 requests
(rows = requests · q <= 64), contexts 4K / 32K / 128K, and 1M for one request. Each case is
timed as a CUDA graph of back-to-back launches with CUDA events, the median of the replays after
warm-up; the L2 (60 MB) stays cold because the launches of a graph rotate over block tables
that point at disjoint parts of the cache pool, more than 3× the L2 per replay. The floor is the
latent cache bytes read (context · 1152 B per request) over the device-to-device copy bandwidth
measured in the same run. Baselines on the same paged problem in the same run: the reference
core in eager torch, request by request as the reference runs it (gather the request's cache rows,
then `reference/mla.py::attend_latent`: FP32 scores, causal softmax and weighted sum) and `torch.nn.functional.scaled_dot_product_attention` on bf16 (the absorbed problem:
576-wide keys, the 512-wide latent as values, the causal mask of the verify rows); with
`--baselines ... compile`, the same core vmapped over every request at once, gather included, under
torch.compile (one graph a case: a loop over requests would be unrolled and compiled once per
block table). Each kernel result is checked against the eager core.

`--sweep` also times every variant of `mla_decode.sweep_plans` per case in the same run (each
with its own split policy, its output checked like the default's and the row saying against
what) and names the fastest; a failing variant is listed in the case (`sweep_failed`) and fails
the run's exit status, while the case's status stays the default kernel's. `--kernels` adds, per
case, the GPU time of each kernel the default runs (the split kernel and the combine) from the
torch profiler: what of the time above the floor is the combine's, and what is the split
kernel's own. Write such runs to a file of their own (`--out .../mla_decode_sweep.json`): the
evidence record `mla_decode_bench.json` is the plain command's.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_mla_decode --out $OUT/mla_bench.json

writes an evidence record (kind "kernel-bench", family "mla") and prints a table last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ..kernels import mla_decode
from ..kernels.device import facts
from ..latency_specialized.evidence import write_record
from ..reference.mla import attend_latent
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda, time_graph
from .profile_step import kernel_table

SOURCES = (
    "vllm/models/kimi_k3/nvidia/kernels/mla_decode.py",
    "vllm/models/kimi_k3/nvidia/kernels/mla_decode_wgmma.py",
    "vllm/models/kimi_k3/nvidia/kernels/mla_combine.py",
    "vllm/models/kimi_k3/nvidia/benchmarks/bench_mla_decode.py",
)
ROW, LATENT = 576, 512
ROW_BYTES = 2 * ROW
BLOCK_SIZE = 64
COLD_BYTES = 192 * 2**20  # cache bytes one graph replay touches at least: > 3× the H200's L2
BASELINE_MAX_BYTES = 3 * 2**30  # the torch baselines gather the cache: skip them beyond this
REL_ERR_BOUND = 5e-3  # as tests/test_mla_decode_kernel.py
TAU = 1.0 / math.sqrt(192.0)


def gathered_core(q_lat: torch.Tensor, flat: torch.Tensor, slot_rows: torch.Tensor, out: torch.Tensor) -> None:
    """The reference's latent core (`reference/mla.py::attend_latent`) over every request at once
    into out [R·n, h, 512]: q_lat [R·n, h, 576], each request's cache rows flat[slot_rows] ([R, L]
    row indices), the gather inside (what torch.compile sees)."""
    requests = slot_rows.shape[0]
    batched = torch.vmap(attend_latent, in_dims=(0, 0, None, None))
    out.copy_(batched(q_lat.view(requests, -1, *q_lat.shape[1:]), flat[slot_rows], LATENT, TAU).flatten(0, 1))


class Case:
    """`requests` requests of `context` cached positions (this step's q tokens included), their
    queries, and `sets` block tables over disjoint blocks of one pool (cold-L2 rotation)."""

    def __init__(self, heads: int, q: int, requests: int, context: int, gen: torch.Generator):
        self.heads, self.q, self.requests, self.context = heads, q, requests, context
        blocks = -(-context // BLOCK_SIZE)
        self.cache_bytes = requests * context * ROW_BYTES
        self.sets = max(1, min(64, math.ceil(COLD_BYTES / self.cache_bytes)))
        self.cache = torch.randn(1 + self.sets * requests * blocks, BLOCK_SIZE, ROW, device="cuda",
                                 dtype=torch.bfloat16, generator=gen)
        base = 1 + torch.arange(self.sets * requests * blocks, device="cuda", dtype=torch.int32)
        self.tables = list(base.view(self.sets, requests, blocks))
        self.seq_lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
        self.query_start = torch.arange(0, requests * q + 1, q, dtype=torch.int32, device="cuda")
        self.q_lat = torch.randn(requests * q, heads, ROW, device="cuda", dtype=torch.bfloat16, generator=gen)
        pos = torch.arange(context, device="cuda")
        # cache row index (block · block_size + offset) of every position, per set and request
        self.slots = [[(t.long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE) for t in table]
                      for table in self.tables]
        self.slot_rows = [torch.stack(per_request) for per_request in self.slots]  # [requests, L] per set
        self.flat = self.cache.view(-1, ROW)
        self.causal = (torch.arange(context, device="cuda")[None, :]
                       > torch.arange(context - q, context, device="cuda")[:, None])  # [q, L] masked

    @property
    def name(self) -> str:
        return f"h={self.heads} q={self.q} requests={self.requests} context={self.context}"

    def kernel(self, out: torch.Tensor, s: int, plan: mla_decode.DecodePlan | None = None) -> Callable[[], object]:
        table = self.tables[s]
        return lambda: mla_decode.launch(self.q_lat, self.cache, table, self.seq_lens, self.query_start, self.q, out,
                                         plan=plan)

    def launches(self, out: torch.Tensor, plan: mla_decode.DecodePlan | None = None) -> list[Callable[[], object]]:
        """What one graph replay holds: launches rotating over the block-table sets."""
        return [self.kernel(out, i % self.sets, plan) for i in range(max(4, self.sets))]

    def eager(self, out: torch.Tensor, s: int) -> Callable[[], object]:
        """The reference core per request: gather, FP32 scores, masked softmax, weighted latents."""
        def run():
            for r in range(self.requests):
                rows = slice(r * self.q, (r + 1) * self.q)
                out[rows] = attend_latent(self.q_lat[rows], self.flat[self.slots[s][r]], LATENT, TAU)
        return run

    def compiled(self, out: torch.Tensor, s: int, core: Callable[..., None]) -> Callable[[], object]:
        """`core` (torch.compile of `gathered_core`) over every request of block-table set s."""
        return lambda: core(self.q_lat, self.flat, self.slot_rows[s], out)

    def sdpa(self, out: torch.Tensor, s: int) -> Callable[[], object]:
        """scaled_dot_product_attention on the same absorbed problem (bf16, one KV head shared)."""
        mask = ~self.causal

        def run():
            for r in range(self.requests):
                kv = self.flat[self.slots[s][r]]
                q = self.q_lat[r * self.q:(r + 1) * self.q].transpose(0, 1).unsqueeze(0)  # [1, h, q, 576]
                k = kv.view(1, 1, -1, ROW).expand(1, self.heads, -1, ROW)
                v = kv[:, :LATENT].view(1, 1, -1, LATENT).expand(1, self.heads, -1, LATENT)
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=TAU)
                out[r * self.q:(r + 1) * self.q] = o[0].transpose(0, 1)
        return run


def plan_label(plan: mla_decode.DecodePlan) -> str:
    flags = "".join(f" {name}" for name in ("defer_table", "copies_under_qk", "combine_pdl") if getattr(plan, name))
    return (f"{plan.warps}w {plan.chunk}tok {plan.stages}st {plan.m_tiles}mt waves={plan.waves} "
            f"min={plan.min_chunks}" + (f" {plan.mma}" if plan.mma != "sync" else "") + flags
            + (f" fan_in={plan.fan_in}" if plan.fan_in else ""))


def units_of(case: Case, plan: mla_decode.DecodePlan, sm_count: int) -> list[mla_decode.WorkUnit]:
    return mla_decode.schedule([case.context] * case.requests, case.query_start.tolist(), case.requests * case.q,
                               case.tables[0].shape[1] * BLOCK_SIZE, plan, mla_decode.default_target(sm_count, plan),
                               plan.min_chunks)


def time_plans(case: Case, copy_bw: float, sm_count: int, plans: list[mla_decode.DecodePlan],
               judge: torch.Tensor | None) -> list[dict]:
    """Each plan timed in turn on the same case, its set-0 output compared with `judge` (the eager
    core where it ran, else the default plan's output; a NaN anywhere fails it)."""
    floor_us = case.cache_bytes / (copy_bw * 1e12) * 1e6
    against = "eager" if judge is not None else "default plan (the default's own row judges nothing)"
    rows = []
    for plan in plans:
        out = torch.full((case.requests * case.q, case.heads, LATENT), float("nan"), device="cuda",
                         dtype=torch.bfloat16)
        time_us = time_graph(case.launches(out, plan), replays=10)
        out.fill_(float("nan"))
        case.kernel(out, 0, plan)()
        if judge is None:
            judge = out.clone()  # the default plan, first: the others are compared with it
        rel_err, status = judged(out, judge)
        rows.append({"plan": plan_label(plan), "time_us": time_us, "frac_of_copy_bw": floor_us / time_us,
                     "work_units": len(units_of(case, plan, sm_count)), "smem_ctas_per_sm": plan.smem_ctas,
                     "rel_err": rel_err, "judged_against": against, "status": status})
    return rows


def judged(out: torch.Tensor, judge: torch.Tensor) -> tuple[float, str]:
    """(‖out − judge‖ / ‖judge‖, "pass" or "fail"): a NaN anywhere or an error at the bound fails."""
    rel_err = float((out.float() - judge.float()).norm() / judge.float().norm())
    return rel_err, "pass" if rel_err < REL_ERR_BOUND and not bool(torch.isnan(out).any()) else "fail"


def fastest(sweep: list[dict]) -> dict | None:
    """The fastest variant of a sweep that passed."""
    passed = [r for r in sweep if r["status"] == "pass"]
    return min(passed, key=lambda r: r["time_us"]) if passed else None


def kernel_times(case: Case, reps: int = 5) -> dict[str, float]:
    """GPU µs per launch of each kernel the default plan runs (the split kernel, the combine),
    from the torch profiler over eager launches: where a case's time goes beside its floor. Says
    so on stderr when the profile holds anything but those two kernels once a launch."""
    out = torch.empty((case.requests * case.q, case.heads, LATENT), device="cuda", dtype=torch.bfloat16)
    launches = case.launches(out)
    for f in launches:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for f in launches:
                f()
        torch.cuda.synchronize()
    table = kernel_table(prof.events(), reps * len(launches))
    if len(table) != 2 or any(abs(r["launches_per_step"] - 1.0) > 1e-9 for r in table):
        # the split kernel and the combine, once per launch: anything else is a profile to distrust
        print(f"[bench_mla_decode] {case.name}: the profiler saw "
              f"{[(r['kernel'], r['launches_per_step']) for r in table]}, not the two kernels once a launch",
              file=sys.stderr)
    return {r["kernel"]: r["us_per_step"] for r in table}


def bench_case(case: Case, copy_bw: float, baselines: tuple[str, ...], sm_count: int, sweep: bool = False,
               kernels: bool = False) -> dict:
    out = torch.full((case.requests * case.q, case.heads, LATENT), float("nan"), device="cuda", dtype=torch.bfloat16)
    case.kernel(out, 0)()
    res: dict = {"name": case.name, "shape": {"heads": case.heads, "q": case.q, "requests": case.requests,
                                              "rows": case.requests * case.q, "context": case.context,
                                              "block_size": BLOCK_SIZE}}
    res["time_us"] = time_graph(case.launches(out), replays=10)
    res["floor_us"] = case.cache_bytes / (copy_bw * 1e12) * 1e6
    res["TBps"] = case.cache_bytes / (res["time_us"] * 1e-6) / 1e12
    res["frac_of_copy_bw"] = res["floor_us"] / res["time_us"]
    units = units_of(case, mla_decode.choose_plan(case.heads, case.q, BLOCK_SIZE, facts(out.device).arch), sm_count)
    res["work_units"] = len(units)
    res["splits_per_request"] = units[0].splits
    res["status"] = "pass"
    ref = None
    if case.cache_bytes <= BASELINE_MAX_BYTES:
        ref = torch.empty_like(out)
        case.kernel(out, 0)()
        case.eager(ref, 0)()
        res["rel_err"], res["status"] = judged(out, ref)
        res["baseline_us"] = {}
        reps = max(1, min(4, case.sets))
        scratch = torch.empty_like(out)
        for name in baselines:
            if name == "compile":
                torch._dynamo.reset()  # a graph per case, never the recompile limit's eager fallback
                core = torch.compile(gathered_core, dynamic=False)
                fns = [case.compiled(scratch, i, core) for i in range(reps)]
            else:
                fns = [(case.eager if name == "eager" else case.sdpa)(scratch, i) for i in range(reps)]
            res["baseline_us"][name] = time_graph(fns, replays=5, warmup=2)
            fns[0]()  # set 0, as `ref`: a baseline that computes something else is not a baseline
            res.setdefault("baseline_rel_err", {})[name] = float((scratch.float() - ref.float()).norm()
                                                                 / ref.float().norm())
        for name, us in res["baseline_us"].items():
            res[f"speedup_vs_{name}"] = us / res["time_us"]
    elif bool(torch.isnan(out).any()):
        res["status"] = "fail"
    if sweep:
        res["sweep"] = time_plans(case, copy_bw, sm_count, mla_decode.sweep_plans(case.heads, case.q, BLOCK_SIZE,
                                                                          facts(out.device).arch), ref)
        best = fastest(res["sweep"])
        res["best_plan"] = best["plan"] if best else None
        # the case's status stays the default kernel's (the record's targets read it); a variant
        # that fails is listed here and fails the run's exit status
        res["sweep_failed"] = [r["plan"] for r in res["sweep"] if r["status"] != "pass"]
    if kernels:
        res["kernel_us"] = kernel_times(case)
    return res


def targets_of(results: list[dict], sm_count: int) -> list[dict]:
    """The issue's targets, each over the cases it covers (the worst case decides)."""
    def worst(name, target, cases, key, bound):
        if not cases:
            return None
        vals = [c[key] for c in cases]
        v = min(vals)
        return {"name": name, "target": target, "value": v, "met": v >= bound, "cases": len(cases),
                "worst_case": cases[vals.index(v)]["name"]}

    long_ctx = [r for r in results if r["shape"]["context"] >= 32768]
    vs_sdpa = [r for r in long_ctx if "speedup_vs_sdpa" in r]
    one_m = [r for r in results if r["shape"]["requests"] == 1 and r["shape"]["context"] >= 1 << 20]
    out = [
        worst("contexts >= 32K: fraction of copy bandwidth on the cache read", ">= 0.80", long_ctx,
              "frac_of_copy_bw", 0.80),
        worst("contexts >= 32K: speedup vs SDPA on the absorbed problem", ">= 1.0", vs_sdpa, "speedup_vs_sdpa", 1.0),
        worst("one request at 1M: fraction of copy bandwidth (every SM busy)", ">= 0.80", one_m,
              "frac_of_copy_bw", 0.80),
    ]
    if one_m:
        out.append({"name": "one request at 1M: work units per SM", "target": f">= 1 ({sm_count} SMs)",
                    "value": min(r["work_units"] for r in one_m) / sm_count,
                    "met": all(r["work_units"] >= sm_count for r in one_m)})
    return [t for t in out if t is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[6, 12], help="heads per rank (TP16: 6, TP8: 12)")
    p.add_argument("--q", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--long", type=int, default=1 << 20, help="context of the one-request case (0: skip)")
    p.add_argument("--baselines", nargs="*", default=["eager", "sdpa"], choices=["eager", "sdpa", "compile"])
    p.add_argument("--sweep", action="store_true",
                   help="also time every variant of mla_decode.sweep_plans per case, each checked like the default")
    p.add_argument("--kernels", action="store_true",
                   help="also profile the default's kernels per case (split kernel vs combine, torch profiler)")
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
    require_cuda(p)
    if args.kernels:
        # later cases capture CUDA graphs after a profiler session, and torch's CUPTI teardown at
        # a session's end has been reported to break later captures: keep it off
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_bw = copy_bandwidth_TBps()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(h, q, r, n) for h in args.heads for q in args.q for r in args.requests for n in args.contexts
              if r * q <= 64]
    if args.long:
        shapes += [(h, q, 1, args.long) for h in args.heads for q in args.q]
    results = []
    for shape in shapes:
        case = Case(*shape, gen)
        results.append(bench_case(case, copy_bw, tuple(args.baselines), sm_count, args.sweep, args.kernels))
        del case
        torch.cuda.empty_cache()
    targets = targets_of(results, sm_count)
    if args.out:
        write_record(args.out, "kernel-bench", "mla", "python -m vllm.models.kimi_k3.nvidia.benchmarks."
                     "bench_mla_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
                     SOURCES, results, targets, copy_bandwidth_TBps=copy_bw,
                     extra={"timing": "CUDA graph of back-to-back launches over block tables of disjoint "
                                      f"cache regions (> {COLD_BYTES >> 20} MiB per replay), median of 10 replays",
                            "floor": "latent cache bytes (context x 1152 B per request) / copy bandwidth",
                            "wall_s": time.time() - t0})
    print(f"copy bandwidth {copy_bw:.2f} TB/s; {len(results)} cases in {time.time() - t0:.0f} s")
    print(f"{'case':42s} {'ours us':>9s} {'floor':>8s} {'%bw':>4s} {'eager':>9s} {'sdpa':>9s} {'compile':>9s} "
          f"{'x sdpa':>6s} {'units':>5s} {'relerr':>8s}")
    for r in results:
        b = r.get("baseline_us", {})
        print(f"{r['name']:42s} {r['time_us']:9.1f} {r['floor_us']:8.1f} {100 * r['frac_of_copy_bw']:4.0f} "
              f"{b.get('eager', float('nan')):9.1f} {b.get('sdpa', float('nan')):9.1f} {b.get('compile', float('nan')):9.1f} "
              f"{r.get('speedup_vs_sdpa', float('nan')):6.2f} {r['work_units']:5d} "
              f"{r.get('rel_err', float('nan')):8.1e}{'' if r['status'] == 'pass' else ' FAIL'}")
    if args.kernels:
        print(f"{'case':42s} {'graph us':>9s}  kernels (GPU us per launch, eager)")
        for r in results:
            print(f"{r['name']:42s} {r['time_us']:9.1f}  "
                  + ", ".join(f"{name} {us:.1f}" for name, us in r["kernel_us"].items()))
    if args.sweep:
        # the default is timed twice (first pass, then first of the sweep): their gap is the noise
        print(f"{'case':42s} {'default':>9s} {'again':>9s} {'best':>9s} {'gain':>5s}  best plan")
        for r in results:
            best = fastest(r["sweep"]) or {"time_us": math.nan, "plan": "none passed"}
            print(f"{r['name']:42s} {r['time_us']:9.1f} {r['sweep'][0]['time_us']:9.1f} {best['time_us']:9.1f} "
                  f"{r['sweep'][0]['time_us'] / best['time_us']:5.2f}  {best['plan']}"
                  + (f"  FAILED: {'; '.join(r['sweep_failed'])}" if r["sweep_failed"] else ""))
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'}"
              f"{'; worst ' + t['worst_case'] if 'worst_case' in t else ''})")
    return 0 if all(r["status"] == "pass" and not r.get("sweep_failed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
