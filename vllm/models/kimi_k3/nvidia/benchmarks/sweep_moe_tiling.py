"""Tiling sweep of the routed experts' two GEMV passes (kernels/moe_experts.py) on the GPU.

`choose_tiling` was set from the skinny GEMM's measurements, not from the experts' own. This
times every launchable `ExpertTiling` of a pass (gate/up with SiTU, or down) beside the pick, at
K3's per-rank shapes and rows M, so that `choose_tiling` can follow measurements:

    python -m vllm.models.kimi_k3.nvidia.benchmarks.sweep_moe_tiling --out $OUT/moe_tiling_sweep.json

Per (TP, M, pass): ROUTING_SETS uniform routings of K3's top-16 over its 896 experts, each
candidate compiled and run as one CUDA graph of a launch per routing, back to back (consecutive
launches read different experts, so the L2 stays cold, as in bench_moe.py); its output must
equal the pick's within the kernel test's bound (warps_k reorders the fp32 sums). Prints per
(TP, M, pass) the pick's time, the fastest candidate's and its tiling; the JSON holds every
candidate. A tuning tool, not evidence: it writes no record. Compiles are serial and take
seconds each, so `--budget-s` stops early and says what it skipped. `--replay SWEEP.json` needs
no GPU: it judges this tree's `choose_tiling` by a finished sweep's timed candidates
(`sweeps.replay`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import cuda.bindings.driver as cuda
import torch
from cutlass import BFloat16, Int32

from ..kernels import moe_experts
from ..kernels.device import facts
from ..kernels.moe_experts import ExpertTiling
from ..kernels.rows import gmem_ptr
from ..latency_specialized.config import PRESETS
from ..reference.dense_mlp import activation_clips
from .bench_moe import expert_weights, uniform_routing
from .bench_skinny_gemm import require_cuda, time_graph
from .sweeps import finish, load, print_replay, replay

K3 = PRESETS["k3"]
ROUTING_SETS = 16
REL_ERR_BOUND = 1e-2  # tests/test_moe_kernels.py's
SMEM_BYTES = 200 * 1024  # leaves room for the grouping arrays under the H200's 227 KB


def candidates(gate_up: bool, n_out: int, k: int, m_atoms: int) -> list[ExpertTiling]:
    """Every tiling the kernel can launch for this pass: CTAs tile the output exactly, every warp
    along K has a chunk, 2–8 warps (the grouping needs 64 threads), partial sums fit in shared
    memory. Register pressure is not filtered: a tiling that spills shows as slow."""
    out = []
    for row_tiles in (1, 2):
        for chunk_atoms, x_atoms in ((8, 4), (4, 2)):
            if k % (16 * chunk_atoms):
                continue
            chunks = k // (16 * chunk_atoms)
            for warps_k in range(1, 9):
                for warps_n in (1, 2, 4, 8):
                    if warps_k > chunks or not 2 <= warps_n * warps_k <= 8:
                        continue
                    t = ExpertTiling(row_tiles, chunk_atoms, x_atoms, warps_n, warps_k)
                    block_w = 16 * row_tiles * warps_n
                    if n_out % t.block_out(gate_up) or warps_k * 8 * m_atoms * (block_w + 4) * 4 > SMEM_BYTES:
                        continue
                    out.append(t)
    return out


def sweep_pass(tp: int, gate_up: bool, m: int, w: torch.Tensor, xs: list[torch.Tensor], ids: list[torch.Tensor],
               inter: int, deadline: float) -> dict:
    """Time each candidate of one pass over `inter` intermediate columns (read width) of the
    stored slices; the pick first (its output is the comparison)."""
    n_experts, w_rows, ld = w.shape
    top_k = ids[0].shape[1]
    n_out, k = (inter, ld) if gate_up else (w_rows, inter)
    m_atoms = -(-m // 8)
    beta, linear_beta = activation_clips(K3) if gate_up else (None, None)
    pick = moe_experts.choose_tiling(gate_up, n_out, k, m_atoms, min(m * top_k, n_experts),
                                     facts(w.device).sm_count)
    outs = [torch.empty((m * top_k, n_out), dtype=torch.bfloat16, device="cuda") for _ in ids]
    reference = None
    rows = []
    for tiling in [pick] + [t for t in candidates(gate_up, n_out, k, m_atoms) if t != pick]:
        if time.monotonic() > deadline:
            rows.append({"tiling": asdict(tiling), "skipped": "budget"})
            continue
        fn = moe_experts.compile_expert_gemv(gate_up, n_experts, top_k, n_out, k, m_atoms, beta, linear_beta,
                                             tiling, facts(w.device).arch, w_rows=w_rows, ld=ld)

        # the stream is read at each launch: time_graph captures on its own stream, and a launch
        # on a stream fixed before it would stay out of the graph (the first run timed empty graphs)
        def launch(i: int, fn=fn) -> None:
            fn(gmem_ptr(BFloat16, w.data_ptr()), gmem_ptr(BFloat16, xs[i].data_ptr()),
               gmem_ptr(Int32, ids[i].data_ptr(), 4), gmem_ptr(BFloat16, outs[i].data_ptr()), m,
               cuda.CUstream(torch.cuda.current_stream().cuda_stream))

        for o in outs:  # NaN before each candidate: a row it leaves unwritten shows
            o.fill_(float("nan"))
        t_us = time_graph([lambda i=i: launch(i) for i in range(len(ids))])
        got = torch.cat([o.float() for o in outs])
        if reference is None:
            reference = got.clone()
        rel = float(((got - reference).norm(dim=1) / reference.norm(dim=1).clamp_min(1e-30)).max())
        rows.append({"tiling": asdict(tiling), "time_us": t_us, "rel_err_vs_pick": rel,
                     "ok": rel < REL_ERR_BOUND and bool(torch.isfinite(got).all())})
    timed = [r for r in rows if r.get("ok")]
    best = min(timed, key=lambda r: r["time_us"]) if timed else None
    return {"tp": tp, "m": m, "pass": "gate_up" if gate_up else "down", "n_out": n_out, "k": k,
            "pick": rows[0], "best": best, "candidates": rows}


def replay_picks(sweep: dict, sm_count: int) -> list[dict]:
    """`sweeps.replay` with this tree's `choose_tiling`, for the step's selected experts as
    `sweep_pass` asks it."""
    def pick_of(r: dict) -> dict:
        experts = min(r["m"] * K3.num_experts_per_token, K3.num_experts)
        return asdict(moe_experts.choose_tiling(r["pass"] == "gate_up", r["n_out"], r["k"], -(-r["m"] // 8), experts,
                                                sm_count))
    return replay(sweep["results"], pick_of)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # ~30 candidates per pass at a few seconds each: the defaults fit one ten-minute GPU call
    ap.add_argument("--tps", type=int, nargs="+", default=[16])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop compiling new candidates after this")
    ap.add_argument("--out", help="JSON file for every candidate's time")
    ap.add_argument("--replay", metavar="SWEEP_JSON",
                    help="no GPU: judge this tree's picks by a finished sweep's timed candidates")
    args = ap.parse_args(argv)
    if args.replay:
        sweep = load(args.replay)
        print_replay(replay_picks(sweep, sweep["sm_count"]), lambda r: f"TP{r['tp']} M={r['m']} {r['pass']}",
                     lambda t: "R{row_tiles} A{chunk_atoms} {warps_n}x{warps_k}".format(**t))
        return 0
    require_cuda(ap)
    deadline = time.monotonic() + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, top_k, n_experts = K3.routed_expert_hidden_size, K3.num_experts_per_token, K3.num_experts
    results = []
    for tp in args.tps:
        w13, w2, real = expert_weights(tp, gen)
        inter = moe_experts.read_width(real)
        for m in args.rows:
            ids = [uniform_routing(m, n_experts, top_k, gen) for _ in range(ROUTING_SETS)]
            x_lat = [torch.randn(m, h, generator=gen, device="cuda").to(torch.bfloat16) for _ in ids]
            hidden = [torch.randn(m * top_k, inter, generator=gen, device="cuda").to(torch.bfloat16) for _ in ids]
            for gate_up, w, xs in ((True, w13, x_lat), (False, w2, hidden)):
                r = sweep_pass(tp, gate_up, m, w, xs, ids, inter, deadline)
                results.append(r)
                best = r["best"]
                print(f"TP{tp:<3} M={m:<3} {r['pass']:<8} pick {r['pick'].get('time_us', float('nan')):8.1f} us "
                      f"{r['pick']['tiling']}  best {best['time_us'] if best else float('nan'):8.1f} us "
                      f"{best['tiling'] if best else '-'}  ({len(r['candidates'])} candidates)", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    finish(results, args.budget_s, args.out, sm_count=facts(torch.device("cuda")).sm_count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
