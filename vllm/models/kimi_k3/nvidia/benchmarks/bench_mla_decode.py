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

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_mla_decode --out $OUT/mla_bench.json

writes an evidence record (kind "kernel-bench", family "mla") and prints a table last.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from ..kernels import mla_decode
from ..latency_specialized.evidence import write_record
from ..reference.mla import attend_latent
from .bench_skinny_gemm import copy_bandwidth_TBps, time_graph

SOURCES = (
    "vllm/models/kimi_k3/nvidia/kernels/mla_decode.py",
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

    def kernel(self, out: torch.Tensor, s: int) -> Callable[[], object]:
        table = self.tables[s]
        return lambda: mla_decode.launch(self.q_lat, self.cache, table, self.seq_lens, self.query_start, self.q, out)

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


def bench_case(case: Case, copy_bw: float, baselines: tuple[str, ...], sm_count: int) -> dict:
    out = torch.full((case.requests * case.q, case.heads, LATENT), float("nan"), device="cuda", dtype=torch.bfloat16)
    case.kernel(out, 0)()
    res: dict = {"name": case.name, "shape": {"heads": case.heads, "q": case.q, "requests": case.requests,
                                              "rows": case.requests * case.q, "context": case.context,
                                              "block_size": BLOCK_SIZE}}
    launches = max(4, case.sets)
    res["time_us"] = time_graph([case.kernel(out, i % case.sets) for i in range(launches)], replays=10)
    res["floor_us"] = case.cache_bytes / (copy_bw * 1e12) * 1e6
    res["TBps"] = case.cache_bytes / (res["time_us"] * 1e-6) / 1e12
    res["frac_of_copy_bw"] = res["floor_us"] / res["time_us"]
    plan = mla_decode.choose_plan(case.heads, case.q, BLOCK_SIZE)
    units = mla_decode.schedule([case.context] * case.requests, case.query_start.tolist(), case.requests * case.q,
                                case.tables[0].shape[1] * BLOCK_SIZE, plan, mla_decode.default_target(sm_count),
                                mla_decode.MIN_CHUNKS)
    res["work_units"] = len(units)
    res["splits_per_request"] = units[0].splits
    res["status"] = "pass"
    if case.cache_bytes <= BASELINE_MAX_BYTES:
        ref = torch.empty_like(out)
        case.kernel(out, 0)()
        case.eager(ref, 0)()
        res["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        res["status"] = "pass" if res["rel_err"] < REL_ERR_BOUND else "fail"
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
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
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
        results.append(bench_case(case, copy_bw, tuple(args.baselines), sm_count))
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
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'}"
              f"{'; worst ' + t['worst_case'] if 'worst_case' in t else ''})")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
