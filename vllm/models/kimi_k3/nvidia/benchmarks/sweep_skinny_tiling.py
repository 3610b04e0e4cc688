"""Tiling sweep of the skinny GEMM (kernels/skinny_gemm.py) on the GPU, shape by shape.

`pick_tiling` picks the kernel and `choose_tiling` the warp kernel's tiling by class of shape;
its M <= 16 rules come from this sweep's run of 2026-12-04 (kernels/README.md), its M > 16 rules
from sweeps of 2026-12-03 (beyond 16 rows sm_90a takes the wgmma kernel, whose tiling
`choose_wgmma_tiling` ranks by a cost model fitted to this sweep's 22 cases of 2026-12-05). This
times the launchable tilings of each K3 per-rank shape beside the pick, so that the heuristic can
follow measurements:

    python -m vllm.models.kimi_k3.nvidia.benchmarks.sweep_skinny_tiling --out $OUT/skinny_tiling_sweep.json

Two stages per (shape, M), since the split count mostly trades against the CTA shape: first
every CTA shape (row tiles, chunk width, warps along N and K) at the split count that fills the
resident CTAs, then the best few of those at every other split count worth a try. On sm_90a, from
9 rows on, the TMA + wgmma kernel's candidates (`wgmma_variants`) are timed too. Each candidate
runs through `bench_skinny_gemm.bench_case` (cold L2, CUDA graph of back-to-back launches, NaN-
filled output checked against the fp32 reference), so its time is comparable with the bench
record. A tuning tool, not evidence: it writes no record. `--budget-s` stops early and says what
it skipped; cases run largest weights first, since those carry most of a step.

`--replay SWEEP.json` needs no GPU: it asks this tree's `pick_tiling` for each case of a sweep
already run and reads that pick's time among the candidates the sweep timed, so a changed rule
is judged against the measurements before any device time (picks the sweep never timed are
counted apart, not guessed).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from ..kernels.device import facts
from ..kernels.skinny_gemm import MAX_ROWS, WGMMA_ARCHS, Tiling, WgmmaTiling, pick_tiling
from ..kernels.skinny_gemm_wgmma import TILE_K, stages_for
from .bench_skinny_gemm import ShapeInputs, bench_case, copy_bandwidth_TBps, describe, require_cuda, unique_shapes
from .sweeps import finish, load, print_replay, replay

REGS_PER_SM = 65536
SHAPES_OF_CTA = ((1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1), (1, 16), (2, 8), (4, 4))
FINALISTS = 3  # CTA shapes of stage one whose split counts stage two varies


def fits(t: Tiling, k: int, m_atoms: int) -> bool:
    """Launchable and worth timing: every warp along K has a chunk in each split, and a lane's
    double-buffered W chunk leaves 64 of the registers a thread of this CTA size may have for the
    rest (with fewer it would spill, which only shows as slow). The warps_k reduction buffer then stays under
    150 KB of shared memory for every candidate (16 warps along K of 32 rows, at 64 rows of x)."""
    chunks = -(-k // t.chunk_k)
    threads = 32 * t.warps_n * t.warps_k
    w_regs = 8 * t.chunk_atoms * t.row_tiles
    return t.warps_k * t.splits <= chunks and w_regs <= min(255, REGS_PER_SM // threads) - 64


def filling_split(t: Tiling, n: int, k: int, sm_count: int, per_sm: int) -> int:
    """The split count that puts `per_sm` CTAs on each SM, rounded down (never a second, mostly
    empty wave), at least 1 and at most one chunk per warp along K."""
    chunks = -(-k // t.chunk_k)
    return max(1, min(per_sm * sm_count // t.tiles_n(n), chunks // t.warps_k))


def cta_shapes(n: int, k: int, m_atoms: int, sm_count: int) -> list[Tiling]:
    """Stage one: every CTA shape that fits, each at the split count filling 2 CTAs per SM."""
    out = []
    for row_tiles in (1, 2):
        for chunk_atoms, x_atoms in ((4, 2), (8, 4), (16, 4)):
            for warps_n, warps_k in SHAPES_OF_CTA:
                base = Tiling(row_tiles, chunk_atoms, x_atoms, warps_n, warps_k, 1)
                t = replace(base, splits=filling_split(base, n, k, sm_count, 2))
                if fits(t, k, m_atoms):
                    out.append(t)
    return out


def split_variants(t: Tiling, n: int, k: int, m_atoms: int, sm_count: int) -> list[Tiling]:
    """Stage two: the same CTA shape unsplit and at the split counts filling 1 and 4 CTAs per SM."""
    counts = {1, *(filling_split(t, n, k, sm_count, per_sm) for per_sm in (1, 4))}
    return [v for v in (replace(t, splits=s) for s in sorted(counts)) if v != t and fits(v, k, m_atoms)]


def wgmma_variants(n: int, k: int, m_atoms: int, sm_count: int) -> list[WgmmaTiling]:
    """The TMA + wgmma kernel's candidates: 64- and 128-row CTAs, each with the stages that fit
    two CTAs an SM, at 1-4 splits and at the split counts filling 1, 2 and 4 CTAs an SM (at least
    two K tiles a split, none empty). The small counts are there for wave tails: where N alone
    gives more CTAs than SMs, no fill count splits at all, yet on the H200 (2026-12-05)
    lm_head@tp8 ran 1.24x faster at 3 splits, its 160 CTAs of 128 rows a second, 28-CTA wave
    unsplit (kernels/MEASURED.md)."""
    k_tiles = -(-k // TILE_K)
    out: list[WgmmaTiling] = []
    for block_w in (64, 128):
        tiles_n = -(-n // block_w)
        fills = (per_sm * sm_count // tiles_n for per_sm in (1, 2, 4))
        for want in sorted({1, 2, 3, 4, *fills}):
            per_split = -(-k_tiles // max(1, min(want, k_tiles // 2)))
            t = WgmmaTiling(block_w, stages_for(block_w, m_atoms), -(-k_tiles // per_split))
            if t not in out:
                out.append(t)
    return out


def sweep_case(inp: ShapeInputs, m: int, copy_bw: float, arch: str, sm_count: int, deadline: float,
               wgmma_only: bool = False) -> dict:
    shape, m_atoms = inp.shape, -(-m // 8)
    pick = pick_tiling(arch, shape.n, shape.k, m_atoms, sm_count)
    rows: dict[Tiling | WgmmaTiling, dict] = {}

    def run(t: Tiling | WgmmaTiling) -> None:
        if t in rows:
            return
        if time.monotonic() > deadline:
            rows[t] = {"tiling": describe(t), "skipped": "budget"}
            return
        r = bench_case(inp, m, copy_bw, tiling=t, baseline=False)
        rows[t] = {"tiling": describe(t), "time_us": r["time_us"], "frac_of_copy_bw": r["frac_of_copy_bw"],
                   "rel_err": r["rel_err"], "ok": r["status"] == "pass"}

    run(pick)
    if arch in WGMMA_ARCHS and m_atoms > 1:
        for t in wgmma_variants(shape.n, shape.k, m_atoms, sm_count):
            run(t)
    for t in [] if wgmma_only else cta_shapes(shape.n, shape.k, m_atoms, sm_count):
        run(t)
    ranked = sorted((t for t, r in rows.items() if r.get("ok") and isinstance(t, Tiling)),
                    key=lambda t: rows[t]["time_us"])
    for t in ranked[:FINALISTS]:
        for v in split_variants(t, shape.n, shape.k, m_atoms, sm_count):
            run(v)
    timed = [r for r in rows.values() if r.get("ok")]
    best = min(timed, key=lambda r: r["time_us"]) if timed else None
    return {"shape": shape.name, "n": shape.n, "k": shape.k, "m": m, "pick": rows[pick], "best": best,
            "failed": [r for r in rows.values() if r.get("ok") is False], "candidates": list(rows.values())}


def label(t: dict) -> str:
    """A `describe`d tiling in a few characters."""
    if t["kernel"] == "wgmma":
        return f"wgmma W{t['block_w']} S{t['stages']} s{t['splits']}"
    return f"R{t['row_tiles']} A{t['chunk_atoms']} {t['warps_n']}x{t['warps_k']} s{t['splits']}"


def replay_picks(sweep: dict, arch: str, sm_count: int) -> list[dict]:
    """`sweeps.replay` with this tree's `pick_tiling`; a candidate that differs from the pick only in
    the wgmma kernel's stage count (the pick clamps stages to a split's K tiles) stands in for it."""
    return replay(sweep["results"], lambda r: describe(pick_tiling(arch, r["n"], r["k"], -(-r["m"] // 8), sm_count)),
                  lambda c, pick: {**c, "stages": 0} == {**pick, "stages": 0})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tps", type=int, nargs="+", default=[16])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--only", nargs="*", default=None, help="shape names (e.g. kda_in_proj@tp16)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop timing new candidates after this")
    ap.add_argument("--out", help="JSON file for every candidate's time")
    ap.add_argument("--wgmma-only", action="store_true",
                    help="time the pick and the wgmma kernel's candidates only: a few seconds a case, where the "
                         "warp kernel's ~50 compiles take ~40 s")
    ap.add_argument("--replay", metavar="SWEEP_JSON",
                    help="no GPU: judge this tree's picks by a sweep's timed candidates (see above)")
    args = ap.parse_args(argv)
    if args.replay:
        sweep = load(args.replay)
        print_replay(replay_picks(sweep, sweep["arch"], sweep["sm_count"]), lambda r: f"{r['shape']} M={r['m']}", label)
        return 0
    require_cuda(ap)
    if not all(1 <= m <= MAX_ROWS for m in args.rows):
        ap.error(f"--rows must lie in 1..{MAX_ROWS}, got {args.rows}")
    deadline = time.monotonic() + args.budget_s
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth_TBps()
    dev = facts(torch.device("cuda"))
    shapes = sorted((s for s in unique_shapes(tuple(args.tps)) if args.only is None or s.name in args.only),
                    key=lambda s: -s.weight_bytes)
    if args.only is not None and not shapes:
        ap.error(f"--only matched no shape of TP {args.tps}: names look like kda_in_proj@tp16")
    results = []
    for s in shapes:
        inp = ShapeInputs(s)
        for m in args.rows:
            r = sweep_case(inp, m, copy_bw, dev.arch, dev.sm_count, deadline, args.wgmma_only)
            results.append(r)
            pick, best = r["pick"], r["best"]
            print(f"{s.name:22s} M={m:<3d} pick {pick.get('time_us', float('nan')):7.2f} us  "
                  f"best {best['time_us'] if best else float('nan'):7.2f} us {best['tiling'] if best else '-'}  "
                  f"({len(r['candidates'])} timed or skipped, {len(r['failed'])} failed)", flush=True)
        del inp
        torch.cuda.empty_cache()
    finish(results, args.budget_s, args.out, copy_bandwidth_TBps=copy_bw, arch=dev.arch, sm_count=dev.sm_count)
    print(f"{'shape':22s} {'M':>3s} {'pick us':>8s} {'best us':>8s} {'gain':>5s} {'best %bw':>8s}  best tiling")
    for r in results:
        pick, best = r["pick"].get("time_us"), r["best"]
        if pick is None or best is None:
            continue
        print(f"{r['shape']:22s} {r['m']:3d} {pick:8.2f} {best['time_us']:8.2f} {pick / best['time_us']:5.2f} "
              f"{100 * best['frac_of_copy_bw']:8.0f}  {label(best['tiling'])}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
