"""Benchmark of the RMSNorm, AttnRes and embedding kernels against torch.

Every case runs three ways in the same process on the same inputs: our CuTe DSL kernel, the
reference function in torch eager (`reference/`), and `torch.compile` of that same function
(dynamic shapes, default mode). Each is timed as a CUDA graph of back-to-back launches (launch
gaps removed) with CUDA events, median over replays after warm-up; the launches of one graph
rotate over input sets whose total exceeds 3× the 60 MB L2 where that fits in 128 launches
(`cold_l2` says per case). The floor of a launch is its bytes (each input read once, each output
written once) over the device-to-device copy bandwidth measured in the same run; `launch_floor_us`
is an empty CuTe DSL kernel timed the same way (what a launch in a graph costs before any byte
moves). Each timed kernel is also checked against its reference.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_norms --out-dir $OUT

writes three evidence records (kind "kernel-bench", families "norm", "attn_res", "embedding")
and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import zlib
from typing import Any, Callable

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch

from ..kernels import attn_res, embedding, rms_norm
from ..latency_specialized.config import PRESETS
from ..latency_specialized.evidence import write_record
from ..reference.attn_res import attn_res_mix
from ..reference.collective import SingleRank
from ..reference.model import embed
from ..reference.ops import bf16_add
from ..reference.ops import rms_norm as rms_norm_ref
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda, time_graph

KERNELS = "vllm/models/kimi_k3/nvidia/kernels/"
SOURCES = {
    "norm": (KERNELS + "rms_norm.py", KERNELS + "rows.py"),
    "attn_res": (KERNELS + "rows.py", KERNELS + "attn_res.py"),
    "embedding": (KERNELS + "rows.py", KERNELS + "embedding.py"),
}
THIS = "vllm/models/kimi_k3/nvidia/benchmarks/bench_norms.py"
COLD_BYTES = 192 * 2**20
MAX_LAUNCHES = 128
ROWS = (1, 8, 64)
EPS = 1e-5
H = attn_res.HIDDEN
REL_ERR_BOUND = 4e-3  # as tests/test_norm_kernels.py: bf16 vs bf16, one rounding each
FLOOR_TARGET = 1.3  # issue 4: fused norm/AttnRes within 1.3x of the bytes-moved floor


@cute.kernel
def _empty_kernel():
    pass


@cute.jit
def _empty_host(stream: cuda.CUstream):
    _empty_kernel().launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def launch_floor_us() -> float:
    fn = cute.compile(_empty_host, cute.runtime.make_fake_stream())
    return time_graph([lambda: fn(cuda.CUstream(torch.cuda.current_stream().cuda_stream))] * 64)


@dataclasses.dataclass
class Case:
    """One benchmark case: input sets, our launch and the reference, both on one set."""

    family: str
    name: str
    shape: dict
    make_set: Callable[[torch.Generator], dict]  # fresh random inputs and preallocated outputs
    ours: Callable[[dict], torch.Tensor]  # launches our kernel; returns the output it wrote
    reference: Callable[[dict], torch.Tensor]  # the torch function (eager; compiled separately)
    nbytes: int  # bytes moved: every input read once, every output written once
    compiled_key: str  # cases sharing a key share one torch.compile object (the same reference function)
    tiling: Any = None  # an explicit AttnRes tiling: ours only, no baselines (a tiling sweep)


def _randn(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _weight(n: int, gen: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(n, generator=gen, device="cuda")).to(torch.bfloat16)


def rms_cases() -> list[Case]:
    cases = []
    for d in rms_norm.NORM_WIDTHS:
        for m in ROWS:
            def make(gen, m=m, d=d):
                return {"x": _randn((m, d), gen), "w": _weight(d, gen),
                        "out": torch.empty((m, d), dtype=torch.bfloat16, device="cuda")}
            cases.append(Case("norm", f"rms_norm D={d}", {"m": m, "d": d}, make,
                              lambda s: rms_norm.launch(s["x"], s["w"], EPS, s["out"]),
                              lambda s: rms_norm_ref(s["x"], s["w"], EPS),
                              2 * (2 * m * d + d), "rms_norm"))
    return cases


def _attn_res_set(gen: torch.Generator, m: int) -> dict:
    buf = torch.empty((m, 8, H), dtype=torch.bfloat16, device="cuda")
    for j in range(8):
        buf[:, j] = _randn((m, H), gen, 0.25 * (j + 1))
    return {"buf": buf, "blocks": buf.transpose(0, 1), "prefix": _randn((m, H), gen, 2.0),
            "addend": _randn((m, H), gen), "nw": _weight(H, gen),
            "pw": (0.02 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16), "ow": _weight(H, gen),
            "out": torch.empty((m, H), dtype=torch.bfloat16, device="cuda"),
            "mix": torch.empty((m, H), dtype=torch.bfloat16, device="cuda")}


def _pre_attention_ref(s: dict, n_blocks: int) -> torch.Tensor:
    """The fused op in torch: advance the prefix in place, then mix and normalize."""
    live = bf16_add(s["prefix"], s["addend"])
    s["prefix"].copy_(live)
    return attn_res_mix([s["blocks"][j] for j in range(n_blocks)] + [live], s["nw"], s["pw"], EPS, s["ow"], EPS)


def _final_ref(s: dict) -> torch.Tensor:
    """Final AttnRes (bf16 mixture) followed by the final norm."""
    live = bf16_add(s["prefix"], s["addend"])
    h = attn_res_mix([s["blocks"][j] for j in range(8)] + [live], s["nw"], s["pw"], EPS)
    return rms_norm_ref(h, s["ow"], EPS)


def attn_res_cases(sm_count: int) -> list[Case]:
    cases = []
    row_bytes = 2 * H
    for m in ROWS:
        tilings = [None] + [t for t in attn_res.TILINGS.values() if t != attn_res.choose_tiling(m, sm_count)]
        for n_blocks in (1, 8):
            for tiling in (tilings if n_blocks == 8 else [None]):
                def ours(s, n_blocks=n_blocks, tiling=tiling):
                    return attn_res.launch(s["blocks"], n_blocks, s["prefix"], s["nw"], s["pw"], EPS,
                                           addend=s["addend"], live_out=s["prefix"], out_w=s["ow"], out=s["out"],
                                           tiling=tiling)
                # reads: blocks, prefix, addend, 3 weight vectors; writes: prefix, out
                nbytes = (n_blocks + 2) * m * row_bytes + 3 * row_bytes + 2 * m * row_bytes
                cases.append(Case("attn_res", f"attn_res pre_attention S={n_blocks + 1}",
                                  {"m": m, "n_sources": n_blocks + 1, "h": H}, lambda g, m=m: _attn_res_set(g, m), ours,
                                  lambda s, n_blocks=n_blocks: _pre_attention_ref(s, n_blocks), nbytes,
                                  f"attn_res_pre_{n_blocks}", tiling))

        def ours_final(s):
            attn_res.launch(s["blocks"], 8, s["prefix"], s["nw"], s["pw"], EPS, addend=s["addend"], out_w=s["ow"],
                            mix_out=s["mix"], out=s["out"])
            return s["out"]
        nbytes = 10 * m * row_bytes + 3 * row_bytes + 2 * m * row_bytes
        cases.append(Case("attn_res", "attn_res final+norm S=9", {"m": m, "n_sources": 9, "h": H},
                          lambda g, m=m: _attn_res_set(g, m), ours_final, _final_ref, nbytes, "attn_res_final"))
    return cases


def embedding_cases() -> list[Case]:
    cfg = PRESETS["k3"]
    shard = cfg.shard(16, 3)
    table = _randn((shard.vocab, H), torch.Generator(device="cuda").manual_seed(7))
    cases = []
    for m in ROWS:
        def make(gen, m=m):
            ids = torch.randint(shard.vocab_start - shard.vocab // 2, shard.vocab_start + shard.vocab, (m,),
                                generator=gen, device="cuda")
            return {"ids": ids, "out": torch.empty((m, H), dtype=torch.bfloat16, device="cuda")}
        cases.append(Case("embedding", "embedding tp16", {"m": m, "h": H, "shard_rows": shard.vocab}, make,
                          lambda s: embedding.launch(s["ids"], table, shard.vocab_start, cfg.vocab_size, s["out"]),
                          lambda s: embed(s["ids"], table, shard, cfg.vocab_size, SingleRank(16, 3)),
                          2 * 2 * m * H + 8 * m, "embedding"))
    return cases


def _set_bytes(s: dict) -> int:
    return sum(t.numel() * t.element_size() for k, t in s.items() if isinstance(t, torch.Tensor) and k != "blocks")


def run_case(case: Case, copy_bw: float, launch_us: float, compiled: dict[str, Callable]) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.name.encode()) + case.shape["m"])
    first = case.make_set(gen)
    n_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / _set_bytes(first))))
    sets = [first] + [case.make_set(gen) for _ in range(n_sets - 1)]
    n_launch = max(20, n_sets)
    rotation = [sets[i % n_sets] for i in range(n_launch)]

    # check on a copy of the first set (the fused ops advance their prefix in place)
    probe = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    probe_ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    if "buf" in probe:
        probe["blocks"], probe_ref["blocks"] = probe["buf"].transpose(0, 1), probe_ref["buf"].transpose(0, 1)
    for key in ("out", "mix"):
        if key in probe:
            probe[key].fill_(float("nan"))
    got = case.ours(probe)
    ref = case.reference(probe_ref)
    torch.cuda.synchronize()
    got, ref = got.float().reshape(ref.shape), ref.float()
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = math.isfinite(rel) and rel < REL_ERR_BOUND and not torch.isnan(got).any()

    ours_us = time_graph([lambda s=s: case.ours(s) for s in rotation], replays=10, warmup=2)
    baselines = {}
    if case.tiling is None:
        baselines["torch_eager"] = time_graph([lambda s=s: case.reference(s) for s in rotation], replays=10, warmup=2)
        if case.compiled_key not in compiled:
            compiled[case.compiled_key] = torch.compile(case.reference, dynamic=True)
        fn = compiled[case.compiled_key]
        baselines["torch_compile"] = time_graph([lambda s=s: fn(s) for s in rotation], replays=10, warmup=2)
    floor_us = case.nbytes / (copy_bw * 1e12) * 1e6
    tiling = case.tiling or (attn_res.choose_tiling(case.shape["m"], torch.cuda.get_device_properties(0)
                                                    .multi_processor_count) if case.family == "attn_res" else None)
    return {
        "name": f"{case.name} M={case.shape['m']}" + (f" split={case.tiling.split}" if case.tiling else ""),
        "shape": case.shape, "status": "pass" if ok else "fail", "rel_err": rel,
        "time_us": ours_us, "floor_us": floor_us, "launch_floor_us": launch_us, "bytes": case.nbytes,
        "x_floor": ours_us / floor_us, "x_launch_or_bytes_floor": ours_us / max(floor_us, launch_us),
        **({"baseline_us": baselines, "speedup_vs_compile": baselines["torch_compile"] / ours_us,
            "speedup_vs_eager": baselines["torch_eager"] / ours_us} if baselines else {}),
        "TBps": case.nbytes / (ours_us * 1e-6) / 1e12, "cold_l2": n_sets * _set_bytes(first) >= COLD_BYTES,
        "launches_per_graph": n_launch, "input_sets": n_sets, "heuristic": case.tiling is None,
        **({"tiling": dataclasses.asdict(tiling)} if tiling is not None else {}),
    }


def targets_of(family: str, results: list[dict]) -> list[dict]:
    """Issue 4's targets over the heuristic (default-tiling) cases; the worst case decides."""
    timed = [r for r in results if r["heuristic"]]
    if not timed:
        return []
    floor_worst = max(timed, key=lambda r: r["x_floor"])
    comp_worst = min(timed, key=lambda r: r["speedup_vs_compile"])
    out = [{"name": "time / bytes-moved floor", "target": f"<= {FLOOR_TARGET}", "value": floor_worst["x_floor"],
            "met": floor_worst["x_floor"] <= FLOOR_TARGET, "worst_case": floor_worst["name"],
            "cases_met": sum(r["x_floor"] <= FLOOR_TARGET for r in timed), "cases": len(timed)},
           {"name": "speedup vs torch.compile of the reference", "target": "> 1.0",
            "value": comp_worst["speedup_vs_compile"], "met": comp_worst["speedup_vs_compile"] > 1.0,
            "worst_case": comp_worst["name"], "cases_met": sum(r["speedup_vs_compile"] > 1.0 for r in timed),
            "cases": len(timed)}]
    launch_worst = max(timed, key=lambda r: r["x_launch_or_bytes_floor"])
    out.append({"name": "time / max(bytes floor, empty-kernel launch)", "target": f"<= {FLOOR_TARGET}",
                "value": launch_worst["x_launch_or_bytes_floor"],
                "met": launch_worst["x_launch_or_bytes_floor"] <= FLOOR_TARGET, "worst_case": launch_worst["name"],
                "cases_met": sum(r["x_launch_or_bytes_floor"] <= FLOOR_TARGET for r in timed), "cases": len(timed),
                "informative": True})  # not issue 4's target: how far above the latency of a launch
    if family == "embedding":  # not a fused norm: the issue sets no floor target, report it only
        out[0]["informative"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=None, help="directory for the evidence JSON files")
    p.add_argument("--only", nargs="*", default=None, help="families to run (norm attn_res embedding)")
    args = p.parse_args(argv)
    require_cuda(p)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_bw = copy_bandwidth_TBps()
    launch_us = launch_floor_us()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    families = {"attn_res": lambda: attn_res_cases(sm_count), "norm": rms_cases,
                "embedding": embedding_cases}
    compiled: dict[str, Callable] = {}
    results: dict[str, list[dict]] = {}
    command = "python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_norms " + " ".join(
        argv if argv is not None else sys.argv[1:])
    for family, make_cases in families.items():
        if args.only is not None and family not in args.only:
            continue
        rows = results[family] = [run_case(c, copy_bw, launch_us, compiled) for c in make_cases()]
        torch.cuda.empty_cache()
        if args.out_dir:  # one record per family as soon as it is done
            write_record(os.path.join(args.out_dir, f"{family}_bench.json"), "kernel-bench", family, command,
                         SOURCES[family] + (THIS,), rows, targets_of(family, rows), copy_bandwidth_TBps=copy_bw,
                         extra={"timing": "CUDA graph of back-to-back launches over rotating input sets, median of "
                                          "10 replays after 2; torch.compile(dynamic=True) of the reference",
                                "launch_floor_us": launch_us, "wall_s": time.time() - t0})
    print(f"copy bandwidth {copy_bw:.2f} TB/s; empty-kernel launch in a graph {launch_us:.2f} us; "
          f"{sum(map(len, results.values()))} cases in {time.time() - t0:.0f} s")
    print(f"{'case':34s} {'M':>3s} {'ours':>7s} {'eager':>7s} {'compile':>7s} {'floor':>6s} {'x floor':>7s} "
          f"{'x comp':>6s} {'relerr':>8s}")
    nan = float("nan")
    for rows in results.values():
        for r in rows:
            base = r.get("baseline_us", {})
            print(f"{r['name'].rsplit(' M=', 1)[0] + (' s' + str(r['tiling']['split']) if 'tiling' in r else ''):34s} "
                  f"{r['shape']['m']:3d} {r['time_us']:7.2f} {base.get('torch_eager', nan):7.2f} "
                  f"{base.get('torch_compile', nan):7.2f} {r['floor_us']:6.2f} {r['x_floor']:7.2f} "
                  f"{r.get('speedup_vs_compile', nan):6.2f} {r['rel_err']:8.1e}{'' if r['status'] == 'pass' else ' FAIL'}")
    for family, rows in results.items():
        for t in targets_of(family, rows):
            print(f"target {family}: {t['name']} {t['target']}: worst {t['value']:.2f} "
                  f"({'met' if t['met'] else 'MISSED'}; {t['cases_met']}/{t['cases']} cases; worst {t['worst_case']})")
    return 0 if all(r["status"] == "pass" for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
