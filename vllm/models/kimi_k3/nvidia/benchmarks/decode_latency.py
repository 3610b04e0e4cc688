"""Decode-step latency on one GPU: the specialized path against the standard path and the HBM floor.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.decode_latency --out DIR [--quick] [--tp 16 8]
                                                                   [--rows 1 2 8 64] [--q 1 8] [--contexts 4096]

**Per-rank compute on one GPU; collectives are not timed.** Each point builds one rank's shard
of K3 at TP16 or TP8 shapes (seeded random weights drawn on the GPU, `ShardRandomSource`) as
one AttnRes block of 12 consecutive layers with K3's KDA/MLA pattern (9 KDA, 3 MLA, a dense
layer 0 and 11 latent-MoE layers with all 896 experts, bf16: a whole bf16 shard does not fit
one H200, K3_MATH.md §5). The cross-rank sums are identities (`SingleRank`), so the all-reduces
and the LM-head all-gather of a real deployment are left out, as are the other 81 layers: the
93-layer figure printed beside each time is the 12-layer time × 93/12, a linear scaling.

In one process, per (TP, rows, tokens per request q, context):

| path | what runs |
| --- | --- |
| specialized | `SpecializedDecode` with `KernelOps`: the CUDA-graph replay of the bucket's CuTe DSL kernels, independent ops of a layer on side lanes (`lanes.py`) |
| specialized, one stream (`--one-stream`) | the same kernels in graphs without lanes (`overlap=False`), to measure what the lanes gain |
| standard eager | `ReferenceModel.forward` + LM head on CUDA (cuBLAS GEMMs, torch ops, per-request loops) |
| standard graphed | `SpecializedDecode` with `TorchOps`: plain PyTorch on cuBLAS, captured in the same kind of CUDA graph, lanes included |
| standard compiled (`--compile`) | the same step under torch.compile (inductor), then captured in the same kind of CUDA graph, on one stream (`compiled_standard.py`): standard compiled with CUDA graphs; a compile per bucket, minutes per record |

Times are medians of CUDA-event-timed steps after warm-up (the eager standard step's: of the
parity run's own eager steps, each between two device syncs, the first left out); the floor is the bytes the step must
touch (every dense weight of the block, the experts its rows selected, once each; the KDA
states read and written; the MLA cache read over the context; embedding rows and the LM-head
shard) over the copy bandwidth measured in the same run. Before timing, each path's logits are
compared with the standard eager path's on the same states and inputs, all paths in lockstep
behind one eager standard run (`parity_lockstep`: the eager steps dominate a point's time).
Verify steps (q > 1) use synthetic acceptance: every draft is kept.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ..latency_specialized.decode_ops import GLUE, KernelOps
from ..latency_specialized.evidence import write_record
from ..latency_specialized.executor import SpecializedDecode
from ..latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from ..reference.model import ReferenceModel
from ..reference.params import KDAWeights, MoEWeights
from .bench_moe import median_us
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda
from .compiled_standard import CompiledStandard, compile_stats
from .block_parity import (BLOCK_LAYERS, FULL_LAYERS, PARITY_MIN_TOKENS, PARITY_SOURCES, BlockDoesNotFit,
                           fill_state, k3_block, parity_lockstep, parity_status, parity_steps_at, segments)

# everything a step's figures depend on: what block parity depends on, and the timing
SOURCES = (*PARITY_SOURCES, *(f"vllm/models/kimi_k3/nvidia/benchmarks/{f}.py" for f in (
    "decode_latency", "bench_moe", "bench_skinny_gemm", "compiled_standard")))
# parity steps beyond the first that time the eager standard step in place of a timing run of its own
EAGER_TIMED_STEPS_MIN = 5
CACHE_BUDGET = 40e9  # the most bytes of MLA cache the states of one context may hold together
# and at most this share of the memory free beside the block: the executors' graphs and buffers
# and the eager paths' transients need the rest. On 2026-12-05 the H100 (85.0e9 bytes, about 28e9
# free beside the TP16 block's 56.8e9) ran out at 128K with 8 requests, 14.5e9 of caches (0.52 of
# free); at 0.45 that point is skipped there, and the H200's TP16 block (about 92e9 free) keeps the
# 40 GB cap every recorded H200 point ran under
CACHE_FREE_SHARE = 0.45
YARDSTICK = "standard_rounding_noise"


def _rollback(state, slots: list[int], q: int) -> None:
    """Undo a step's commit on the host (the cache rows it wrote are rewritten by the next step)."""
    for r in slots:
        state.seq_lens[r] -= q
        state.accepted[r] = 1


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    return median_us(lambda i: fn(), reps, warmup) * 1e-3


def floor_bytes(model: ReferenceModel, ex: SpecializedDecode, key: tuple[int, int], requests: int,
                context: int) -> int:
    """Bytes one step must move: dense weights, selected experts, states, cache, embedding rows."""
    w, rows = model.w, key[0]
    dense = w.lm_head.numel() * 2 + rows * w.embed.shape[1] * 2
    expert = 0
    routed = iter(ex.routed[key])
    for lw in w.layers:
        for t in (*lw.attn_res.tensors().values(), *lw.attn.tensors().values()):
            dense += t.numel() * t.element_size()
        if isinstance(lw.mlp, MoEWeights):
            for name, t in lw.mlp.tensors().items():
                if name not in ("w13", "w2"):
                    dense += t.numel() * t.element_size()
            ids = next(routed)[:requests * key[1]].flatten()
            # the checkpoint's columns, not the padded slice (TP16: 192 of 256; the kernels skip the rest)
            per_expert = 3 * lw.mlp.w13.shape[2] * model.shard.moe_inter_real * 2
            expert += int(torch.unique(ids).numel()) * per_expert
        else:
            dense += sum(t.numel() * t.element_size() for t in lw.mlp.tensors().values())
    state = 0
    for i, lw in enumerate(w.layers):
        if isinstance(lw.attn, KDAWeights):
            per = ex.state.kda[i].rec[0].numel() * 4
            state += requests * per * (1 + key[1])  # read one state, write one per token
        else:
            state += requests * (context + key[1]) * ex.state.mla[i].cache.shape[-1] * 2
    return dense + expert + state


def run_point(model, executors: dict, std_state, tp: int, rows: int, q: int, context: int, reps: int,
              parity_steps: int, copy_bw: float, gen: torch.Generator, untimed: dict | None = None,
              lost: dict[str, str] | None = None) -> list[dict]:
    """One (rows, q, context) point: parity of every executor (and of the `untimed` ones, e.g. the
    yardstick), then the timed replays of `executors` and the eager standard step. An executor
    dropped here is added to `lost` (why, and where), so later points of the context know it is gone."""
    requests = rows // q
    out = []
    spec = executors["specialized"]
    key = (rows, q)
    untimed = {} if untimed is None else untimed
    every = {**executors, **untimed}
    for st in (std_state, *(e.state for e in every.values())):
        for r in range(st.max_requests):
            st.free(r)
    slots = fill_state(spec.state, requests, context, gen)
    base = {"tp": tp, "rows": rows, "q": q, "context": context, "requests": requests}
    eager_ms: list[float] = []
    par, dropped = parity_lockstep(model, every, std_state, slots, q, parity_steps_at(rows, parity_steps), gen,
                                   required="specialized", eager_ms=eager_ms)
    lost = {} if lost is None else lost
    for name, why in dropped.items():
        print(f"[decode_latency] {name} dropped: {why}", file=sys.stderr)
        executors.pop(name, None)
        untimed.pop(name, None)
        lost[name] = f"{why} (dropped at rows {rows} q {q} ctx {context})"
    for ex in executors.values():  # parity advanced every state; restart the timed ones from the same one
        _rollback_to(ex.state, slots, context)
    _rollback_to(std_state, slots, context)
    ids = torch.randint(0, model.w.lm_head.shape[0], (requests * q,), generator=gen, device=model.w.embed.device)
    times = {}
    for name, ex in executors.items():  # one call fills the bucket's metadata; then time the replay alone
        ex(ids, segments(ex.state, slots, q), ex.state)
        _rollback(ex.state, slots, q)
        times[name] = median_ms(lambda ex=ex: ex.replay(key), reps)
    segs = segments(std_state, slots, q)

    def std_step():
        model.logits(model.forward(ids, segs, std_state))
        _rollback(std_state, slots, q)
    times["standard_eager"] = eager_step_ms(eager_ms, lambda: median_ms(std_step, max(3, reps // 4)))
    fb = floor_bytes(model, spec, key, requests, context)
    floor_ms = fb / (copy_bw * 1e12) * 1e3
    t_spec = times["specialized"]
    fastest = min((k for k in ("standard_graphed", "standard_compiled") if k in times), key=times.get, default=None)
    res = {**base, "name": f"tp{tp} rows{rows} q{q} ctx{context}", "time_us": t_spec * 1e3,
           "baseline_us": {k: v * 1e3 for k, v in times.items() if k != "specialized"},
           "floor_us": floor_ms * 1e3, "floor_bytes": fb, "x_floor": t_spec / floor_ms,
           "speedup_vs_eager": times["standard_eager"] / t_spec,
           "speedup_vs_graphed": times["standard_graphed"] / t_spec if "standard_graphed" in times else None,
           "speedup_vs_compiled": times["standard_compiled"] / t_spec if "standard_compiled" in times else None,
           # the targets' standard step: the faster of those timed here (compiled only with --compile)
           "standard_baseline": fastest, "speedup_vs_standard": times[fastest] / t_spec if fastest else None,
           "tokens_per_s_per_request": q / (t_spec * 1e-3 * FULL_LAYERS / BLOCK_LAYERS),
           "tokens_per_s_per_gpu": rows / (t_spec * 1e-3 * FULL_LAYERS / BLOCK_LAYERS),
           "step_93_layers_est_us": t_spec * 1e3 * FULL_LAYERS / BLOCK_LAYERS, "parity": par}
    res["status"] = parity_status(par)
    if YARDSTICK in lost:  # the rule's own yardstick is gone: no verdict, so no pass
        res["unjudged"] = f"the rounding-noise yardstick is missing: {lost[YARDSTICK]}"
        res["status"] = "fail"
    out.append(res)
    return out


def eager_step_ms(parity_ms: list[float], time_again: Callable[[], float]) -> float:
    """The eager standard step's time: the median of the parity run's own eager steps after the
    first (its warm-up), where there are enough of them, else `time_again()`. Timing it apart cost
    10 eager steps a point, up to 2.8 s each at 64 rows: a quarter of the decode records' device
    time (2026-12-04)."""
    return statistics.median(parity_ms[1:]) if len(parity_ms) > EAGER_TIMED_STEPS_MIN else time_again()


def _rollback_to(state, slots: list[int], context: int) -> None:
    for r in slots:
        state.seq_lens[r] = context - 1
        state.accepted[r] = 1


def _baselines(points: list[dict]) -> str:
    """Which standard steps the points' fastest baseline came from, e.g. 'standard_compiled'."""
    return ", ".join(sorted({r["standard_baseline"] for r in points}))


def targets_of(results: list[dict]) -> list[dict]:
    def pick(**kw):
        return [r for r in results if all(r[k] == v for k, v in kw.items())]
    out = []
    small = [r for r in pick(tp=16, q=1, context=4096) if r["rows"] in (1, 2)]
    if small and all(r["speedup_vs_standard"] for r in small):
        worst = min(r["speedup_vs_standard"] for r in small)
        out.append({"name": "rows 1-2, TP16, q 1, ctx 4K: specialized vs the fastest standard step timed "
                    f"({_baselines(small)})", "target": ">= 2.0x", "value": round(worst, 3), "met": worst >= 2.0})
    if small:
        worst = max(r["x_floor"] for r in small)
        out.append({"name": "rows 1-2, TP16, q 1, ctx 4K: time over HBM floor", "target": "<= 1.25x",
                    "value": round(worst, 3), "met": worst <= 1.25})
    big = pick(tp=8, rows=64, q=1)
    if big and all(r["speedup_vs_standard"] for r in big):
        worst = min(r["speedup_vs_standard"] for r in big)
        out.append({"name": f"rows 64, TP8: specialized vs the fastest standard step timed ({_baselines(big)})",
                    "target": ">= 1.4x", "value": round(worst, 3), "met": worst >= 1.4})
    for tp in (16, 8):
        one, verify = pick(tp=tp, rows=1, q=1), pick(tp=tp, rows=8, q=8)
        if one and verify:
            ratio = verify[0]["time_us"] / one[0]["time_us"]
            out.append({"name": f"TP{tp} verify q 8 (one request) over q 1 rows 1", "target": "<= 1.5x",
                        "value": round(ratio, 3), "met": ratio <= 1.5})
    return out


def cache_budget(free_bytes: int) -> float:
    """The bytes of MLA cache one context's states may hold on this card (CACHE_FREE_SHARE)."""
    return min(CACHE_BUDGET, CACHE_FREE_SHARE * free_bytes)


def points_that_fit(rows: list[int], qs: list[int], ctx: int, states: int, n_mla: int,
                    budget: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (rows, q) points whose `states` MLA caches of `ctx` tokens fit `budget` bytes, and
    those that do not; a point needs q to divide rows (rows // q requests of q tokens)."""
    every = sorted({(r, q) for r in rows for q in qs if r % q == 0})
    fits = [(r, q) for r, q in every if states * (r // q) * (ctx + 8) * 576 * 2 * n_mla <= budget]
    return fits, [p for p in every if p not in fits]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for NAME.json and NAME.md")
    ap.add_argument("--name", default="decode_bench", help="file stem of the record and table (default decode_bench)")
    ap.add_argument("--tp", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--q", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--parity-steps", type=int, default=16,
                    help=f"steps of the parity run at each point, raised to {PARITY_MIN_TOKENS} tokens where a step has fewer")
    ap.add_argument("--no-graphed-standard", action="store_true", help="skip the TorchOps graphed baseline")
    ap.add_argument("--one-stream", action="store_true",
                    help="also time the specialized graphs without side lanes (overlap=False; baseline "
                         "'specialized_one_stream'), to measure what the lanes gain")
    ap.add_argument("--compile", action="store_true",
                    help="also time the graphed standard step under torch.compile (baseline 'standard_compiled'; "
                         "a compile per bucket: minutes per record)")
    ap.add_argument("--quick", action="store_true", help="TP16 rows 1, 2, 8 (q 1) and one q 8 request, ctx 4K")
    args = ap.parse_args(argv)
    require_cuda(ap)
    if args.quick:
        args.tp, args.rows, args.q, args.contexts = [16], [1, 2, 8], [1, 8], [4096]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("per-rank compute on one GPU; collectives not timed; 12-layer block, 93-layer figures scaled x93/12",
          file=sys.stderr)
    copy_bw = copy_bandwidth_TBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: list[dict] = []
    not_run: list[str] = []  # what this card could not hold, said here and in the record

    def skip(why: str) -> None:
        not_run.append(why)
        print(f"[decode_latency] skipping {why}", file=sys.stderr)

    for tp in args.tp:
        t0 = time.perf_counter()
        try:
            model = k3_block(tp)
        except BlockDoesNotFit as e:
            skip(f"TP{tp}: {e}")
            continue
        print(f"[decode_latency] TP{tp} block built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        n_mla = len(model.cfg.full_attn_layers)
        for ctx in args.contexts:
            # four states (specialized, graphed standard, yardstick, eager standard) hold the MLA cache
            # each, one more for each extra executor (one stream, compiled standard)
            states = 4 + args.one_stream + args.compile
            gc.collect()  # the previous context's executors, states and graphs count as used until freed
            torch.cuda.empty_cache()
            budget = cache_budget(torch.cuda.mem_get_info()[0])
            keys, skipped = points_that_fit(args.rows, args.q, ctx, states, n_mla, budget)
            if skipped:
                skip(f"TP{tp} ctx {ctx} (rows, q) {skipped}: their caches exceed {budget / 1e9:.1f} GB (the "
                     f"least of {CACHE_BUDGET / 1e9:.0f} GB and {CACHE_FREE_SHARE} of the free memory)")
            if not keys:
                continue
            results += run_context(model, tp, keys, ctx, args, copy_bw, gen)
        del model
        torch.cuda.empty_cache()
    if not results:
        print(f"[decode_latency] nothing measured on this GPU, so no record: {'; '.join(not_run)}", file=sys.stderr)
        return 2
    targets = targets_of([r for r in results if "time_us" in r])
    cmd = "python -m vllm.models.kimi_k3.nvidia.benchmarks.decode_latency " + " ".join(sys.argv[1:])
    write_record(out / f"{args.name}.json", "decode-bench", "executor", cmd, SOURCES, results, targets,
                 copy_bandwidth_TBps=copy_bw,
                 extra={"scope": "per-rank compute on one GPU, collectives not timed (SingleRank identity); one "
                                 "AttnRes block of 12 layers (K3 pattern, 896 bf16 experts); 93-layer figures are "
                                 "the 12-layer time x 93/12", "not_run": not_run})
    table = markdown(results, targets, copy_bw, torch.cuda.get_device_name(), not_run)
    (out / f"{args.name}.md").write_text(table)
    print(table)
    return 0 if all(r["status"] == "pass" for r in results) else 1


def run_context(model: ReferenceModel, tp: int, keys: list[tuple[int, int]], ctx: int, args, copy_bw: float,
                gen: torch.Generator) -> list[dict]:
    max_req, max_q = max(r // q for r, q in keys), max(q for _, q in keys)
    # parity runs up to that many steps past the context (parity_steps_at: at most PARITY_MIN_TOKENS)
    max_len = ctx + (max(args.parity_steps, PARITY_MIN_TOKENS) + 1) * max_q
    executors = {"specialized": SpecializedDecode(model, max_requests=max_req, max_len=max_len, buckets=keys,
                                                  ops=KernelOps())}
    spec = executors["specialized"]
    bad = sorted({op for key in keys for op, impl in spec.kernels[key] if impl != "cute" and op not in GLUE})
    if bad:
        raise RuntimeError(f"ops outside the kernel table in the specialized graphs: {bad}")
    notes = []
    if args.one_stream:
        executors["specialized_one_stream"] = SpecializedDecode(model, max_requests=max_req, max_len=max_len,
                                                                buckets=keys, ops=KernelOps(), overlap=False)
    if not args.no_graphed_standard:
        try:  # a broken baseline must not cost the specialized figures: say so and go on without it
            executors["standard_graphed"] = SpecializedDecode(model, max_requests=max_req, max_len=max_len,
                                                              buckets=keys, ops=TorchOps())
        except Exception as e:  # noqa: BLE001
            notes.append(f"graphed standard baseline unavailable: {type(e).__name__}: {e}")
            print(f"[decode_latency] {notes[-1]}", file=sys.stderr)
    if args.compile:
        compiled_before = compile_stats()
        try:  # as the graphed baseline: a compile that fails is said, not fatal
            executors["standard_compiled"] = CompiledStandard(model, max_requests=max_req, max_len=max_len,
                                                              buckets=keys)
        except Exception as e:  # noqa: BLE001
            notes.append(f"compiled standard baseline unavailable: {type(e).__name__}: {e}")
            print(f"[decode_latency] {notes[-1]}", file=sys.stderr)
    # the parity yardstick runs eagerly (its noise is drawn per call) and is not timed
    untimed = {YARDSTICK: SpecializedDecode(model, max_requests=max_req, max_len=max_len,
                                                            buckets=keys, ops=RoundingNoiseOps(), graphs=False)}
    std_state = model.new_state(max_requests=max_req, max_len=max_len, max_q=max_q)
    results, lost = [], {}
    for rows, q in keys:
        for r in run_point(model, executors, std_state, tp, rows, q, ctx, args.reps, args.parity_steps, copy_bw,
                           gen, untimed, lost):
            results.append(r)
            g = r["baseline_us"].get("standard_graphed")
            one = r["baseline_us"].get("specialized_one_stream")
            c = r["baseline_us"].get("standard_compiled")
            print(f"TP{tp:<3} rows {rows:>3} q {q} ctx {ctx:>6}: spec {r['time_us']:9.1f} us  "
                  f"{'' if one is None else f'one stream {one:9.1f}  '}eager "
                  f"{r['baseline_us']['standard_eager']:9.1f}  graphed {g if g is None else round(g, 1)}  "
                  f"{'' if c is None else f'compiled {c:9.1f}  '}"
                  f"floor {r['floor_us']:8.1f} ({r['x_floor']:.2f}x)  parity "
                  f"{r['parity']['specialized']['rel_err_median']:.1e} {r['status']}", file=sys.stderr, flush=True)
    results.append({"name": f"tp{tp} ctx{ctx} build", "status": "pass", "notes": notes,
                    "build": {k: {"seconds": round(e.report.seconds, 1),
                                  "graph_MiB": round(e.report.graph_bytes / 2**20, 1)} for k, e in executors.items()},
                    "launches_per_step": {f"{r},{q}": spec.launches((r, q)) for r, q in keys[:1]},
                    **({"compile": compile_stats(compiled_before)} if args.compile else {})})
    del executors, untimed, std_state
    torch.cuda.empty_cache()
    return results


def _yardstick(r: dict) -> str:
    y = r["parity"].get(YARDSTICK)
    return "—" if y is None else f"{y['rel_err_median']:.1e}"


def _verdict(r: dict) -> str:
    return "unjudged (no yardstick)" if r.get("unjudged") else r["status"]


def markdown(results: list[dict], targets: list[dict], copy_bw: float, gpu: str,
             not_run: list[str] | None = None) -> str:
    lines = [f"Per-rank compute on one {gpu}, collectives not timed; one 12-layer AttnRes block of K3 "
             f"(93-layer = x93/12); copy bandwidth {copy_bw:.2f} TB/s.", "",
             "| TP | rows | q | ctx | specialized µs | graphed std µs | compiled std µs | eager std µs | floor µs | "
             "x floor | vs graphed | vs compiled | vs eager | parity rel err (median) | yardstick's | parity |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "time_us" not in r:
            continue
        g, c = r["baseline_us"].get("standard_graphed"), r["baseline_us"].get("standard_compiled")
        vs_g = f"{r['speedup_vs_graphed']:.2f}x" if r["speedup_vs_graphed"] else "—"
        vs_c = f"{r['speedup_vs_compiled']:.2f}x" if r.get("speedup_vs_compiled") else "—"
        lines.append(f"| {r['tp']} | {r['rows']} | {r['q']} | {r['context']} | {r['time_us']:.1f} | "
                     f"{'—' if g is None else f'{g:.1f}'} | {'—' if c is None else f'{c:.1f}'} | "
                     f"{r['baseline_us']['standard_eager']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['x_floor']:.2f} | {vs_g} | {vs_c} | {r['speedup_vs_eager']:.2f}x | "
                     f"{r['parity']['specialized']['rel_err_median']:.1e} | {_yardstick(r)} | {_verdict(r)} |")
    if not_run:
        lines += ["", *(f"Not run on this GPU: {why}" for why in not_run)]
    lines += ["", "| target | wanted | measured | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['name']} | {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in targets]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
