"""Where one MLA decode launch spends its time, per CTA: %globaltimer readings from a timeline plan.

A diagnostic for issue 7's fixed cost (one request at 32K: 23.5 µs on the H200 against an 8.9 µs
floor). Each case runs `bench_mla_decode`'s graph of back-to-back launches (cold L2) twice: the
default plan, the same plan with `defer_table=True` (the block table read a chunk before its use;
its output compared with the default's), then the default with `timeline=True`, whose CTAs' thread 0 record
`mla_decode.STAMPS` readings: entry, work unit located, PDL wait over, first chunk landed, last
chunk done, output written. From the last replay, per launch (the first of the graph dropped),
medians over the working CTAs of each phase, and across launches the kernel's span (first entry
to last write) and what follows it until the next launch's PDL wait ends (the combine and the
launch gap). The times of both plans are printed, so the readings' own cost shows.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.mla_timeline --out $OUT/mla_timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from ..kernels import mla_decode
from ..kernels.device import facts
from .bench_mla_decode import BLOCK_SIZE, LATENT, Case, units_of
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda, time_graph

PHASES = ("locate", "pdl_wait", "first_chunk", "chunks", "epilogue")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(stamps: list[torch.Tensor], units: list[mla_decode.WorkUnit]) -> dict:
    """Per-phase medians (µs) over the working CTAs of every launch but the first, the per-chunk
    loop time, the kernel span and the time from its last write to the next launch's wait end."""
    work = [u.slot for u in units]
    chunks = {u.slot: u.chunk_end - u.chunk_begin for u in units}
    per_launch = []
    for i, s in enumerate(stamps):
        t = s.view(-1, mla_decode.STAMPS)[work].double().cpu() / 1e3  # ns -> µs
        t0 = float(t[:, 0].min())
        row = {"entry_spread": float(t[:, 0].max()) - t0, "span": float(t[:, 5].max()) - t0, "t0": t0,
               "end": float(t[:, 5].max()), "wait_end_first": float(t[:, 2].min())}
        for k, name in enumerate(PHASES):
            row[name] = _median([float(x) for x in t[:, k + 1] - t[:, k]])
        loops = [float(t[j, 4] - t[j, 3]) / max(chunks[slot] - 1, 1) for j, slot in enumerate(work)
                 if chunks[slot] > 1]
        row["per_chunk"] = _median(loops)
        row["last_end_minus_first_end"] = float(t[:, 5].max() - t[:, 5].min())
        per_launch.append(row)
    out = {k: _median([r[k] for r in per_launch[1:]]) for k in per_launch[0] if k not in ("t0", "end",
                                                                                          "wait_end_first")}
    gaps = [per_launch[i + 1]["wait_end_first"] - per_launch[i]["end"] for i in range(1, len(per_launch) - 1)]
    periods = [per_launch[i + 1]["t0"] - per_launch[i]["t0"] for i in range(1, len(per_launch) - 1)]
    out["after_end_to_next_wait"] = _median(gaps)
    out["period"] = _median(periods)
    return out


def run_case(heads: int, q: int, requests: int, context: int, copy_bw: float, gen: torch.Generator) -> dict:
    case = Case(heads, q, requests, context, gen)
    sm_count = facts(case.cache.device).sm_count
    arch = facts(case.cache.device).arch
    plan = mla_decode.choose_plan(heads, q, BLOCK_SIZE, arch)
    out = torch.full((requests * q, heads, LATENT), float("nan"), device="cuda", dtype=torch.bfloat16)
    plain_us = time_graph(case.launches(out, plan), replays=10)
    judge = out.clone()
    variants = {"defer_table": {"defer_table": True}, "combine_pdl": {"combine_pdl": True}}
    if plan.mma == "wgmma":
        variants |= {"copies_under_qk": {"copies_under_qk": True},
                     "both": {"defer_table": True, "copies_under_qk": True}}
    else:
        variants |= {"fan_in_4": {"fan_in": 4}, "fan_in_8": {"fan_in": 8}, "fan_in_16": {"fan_in": 16}}
    var_us, var_err = {}, {}
    for name, kw in variants.items():
        out.fill_(float("nan"))
        var_us[name] = time_graph(case.launches(out, replace(plan, **kw)), replays=10)
        var_err[name] = float((out.float() - judge.float()).norm() / judge.float().norm())
    units = units_of(case, plan, sm_count)
    slots = mla_decode.grid_size(plan, requests, mla_decode.default_target(sm_count, plan))
    res = {"name": case.name, "floor_us": case.cache_bytes / (copy_bw * 1e12) * 1e6, "time_us": plain_us,
           "variants_us": var_us, "variants_rel_err_vs_default": var_err, "work_units": len(units),
           "chunks_per_unit": _median([u.chunk_end - u.chunk_begin for u in units])}
    res.update(_timeline(case, replace(plan, timeline=True), out, units, slots))
    if plan.mma == "sync":  # where the in-kernel combine's tree spends its time (its last stamp follows the root)
        res["fan_in_8"] = _timeline(case, replace(plan, timeline=True, fan_in=8), out, units, slots)
    return res


def _timeline(case: Case, timed: mla_decode.DecodePlan, out: torch.Tensor, units: list, slots: int) -> dict:
    launches, stamps = [], []
    for i in range(max(4, case.sets)):
        st = torch.zeros(slots * mla_decode.STAMPS, dtype=torch.int64, device="cuda")
        stamps.append(st)
        table = case.tables[i % case.sets]
        launches.append(lambda table=table, st=st: mla_decode.launch(
            case.q_lat, case.cache, table, case.seq_lens, case.query_start, case.q, out, plan=timed, stamps=st))
    return {"timeline_plan_us": time_graph(launches, replays=10), **analyse(stamps, units)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["6,1,1,4096", "6,1,1,32768", "6,1,1,131072", "6,1,8,32768",
                                                  "12,8,1,32768", "6,8,1,32768", "6,8,8,131072", "12,8,8,131072",
                                                  "6,1,64,32768", "6,8,1,1048576"],
                   help="heads,q,requests,context")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    require_cuda(p)
    copy_bw = copy_bandwidth_TBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for spec in args.cases:
        heads, q, requests, context = (int(x) for x in spec.split(","))
        results.append(run_case(heads, q, requests, context, copy_bw, gen))
        print(f"[mla_timeline] {results[-1]['name']} done", file=sys.stderr, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": copy_bw, "results": results}, f,
                      indent=1)
    cols = ("time_us", "timeline_plan_us", "floor_us", "period", "span", "entry_spread", *PHASES, "per_chunk",
            "last_end_minus_first_end", "after_end_to_next_wait")
    print("case | " + " | ".join(cols) + " | chunks/unit")
    for r in results:
        print(r["name"] + " | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {r['chunks_per_unit']}")
        if "fan_in_8" in r:
            print("  fan_in 8 | - | " + " | ".join(f"{r['fan_in_8'][c]:.2f}" for c in cols[1:]))
    print("case | default µs | variant µs (rel err vs default) ...")
    for r in results:
        print(r["name"] + f" | {r['time_us']:.2f} | " + " | ".join(
            f"{v} {us:.2f} ({r['variants_rel_err_vs_default'][v]:.1e})" for v, us in r["variants_us"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
