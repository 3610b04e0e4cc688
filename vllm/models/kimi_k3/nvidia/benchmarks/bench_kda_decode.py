"""Benchmark of the KDA decode kernel against the reference math in torch, eager and torch.compile.

Cases: one KDA layer's core (after the in_proj and f_b GEMMs, before o_proj) per rank at TP16 (6
heads) and TP8 (12 heads): plain decode, q = 1 at rows 1..64, and verify steps, q = 8 at rows
8..64 (R = rows / q requests, every request live, accepted = 1). Ours runs at every split (CTAs
per (request, head)); the heuristic's split is the headline figure. The baseline is `torch_step`
below: reference/kda.py's own functions (decay_log_alpha, _l2_normalize,
gated_delta_rule_recurrent with the requests folded into the head axis, _gated_rms_norm) batched
over requests, with the conv and the slot gathers / scatters written as batched torch ops (the
reference layer loops over requests in Python, which neither a CUDA graph nor torch.compile
would keep), in eager and under torch.compile(dynamic=True), compiled afresh for each (heads, q,
one request or more). Each is timed as a CUDA graph of back-to-back launches with CUDA events,
median of 10 replays after 2; the launches of one graph rotate over disjoint slot sets of one
state pool, so a replay touches more than 3× the 60 MB L2 where that fits in 512 launches
(`cold_l2` per case). The floor of a launch is its bytes (state read once and written once per
token, conv taps read and the new window written, z's q|k|v|g_out|β columns, g_raw, the output,
the parameters) over the device-to-device copy bandwidth measured in the same run;
`launch_floor_us` is an empty CuTe DSL kernel timed the same way. Ours is checked against
torch_step on one slot set (outputs and states).

    python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_kda_decode --out $OUT/kda_decode_bench.json

writes an evidence record (kind "kernel-bench", family "kda") and prints a table last. Most of
the wall time is torch.compile (a few compiles of up to a minute each); `--no-compile` skips it,
and `--heads` / `--q` run a subset.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from ..kernels import kda_decode
from ..kernels.kda_decode import HEAD_DIM, SPLITS
from ..latency_specialized.evidence import write_record
from ..reference.kda import _gated_rms_norm, _l2_normalize, decay_log_alpha, gated_delta_rule_recurrent
from .bench_norms import launch_floor_us
from .bench_skinny_gemm import copy_bandwidth_TBps, require_cuda, time_graph

SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/kda_decode.py",
           "vllm/models/kimi_k3/nvidia/kernels/rows.py",
           "vllm/models/kimi_k3/nvidia/benchmarks/bench_kda_decode.py")
HEADS = {"tp16": 6, "tp8": 12}
ROWS = {1: (1, 2, 4, 8, 16, 32, 64), 8: (8, 16, 32, 64)}
LB = -5.0
COLD_BYTES = 192 * 2**20
MAX_LAUNCHES = 512
BASELINE_LAUNCHES = 16  # the baselines are far above the floor: a warm L2 barely moves them
OUT_REL_ERR_BOUND = 4e-3  # as tests/test_kda_decode_kernel.py
STATE_REL_ERR_BOUND = 2e-4
FLOOR_TARGET = 1.3  # issue 6: the core within 1.3x of its bytes floor at rows 1-8
COMPILE_TARGET = 2.0  # and >= 2x faster than torch.compile of the reference
VERIFY_TARGET = 1.5  # a q = 8 verify of one request costs <= 1.5x a q = 1 step


def torch_step(z: torch.Tensor, g_raw: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, o_norm: torch.Tensor, rec: torch.Tensor, conv: torch.Tensor,
               conv_slot: torch.Tensor, rec_read_slot: torch.Tensor, rec_slots: torch.Tensor,
               accepted: torch.Tensor) -> torch.Tensor:
    """The kernel's step in batched torch for all-live requests (int64 slot tensors): the baseline."""
    h = A_log.shape[0]
    d = HEAD_DIM
    p = h * d
    requests, q = rec_slots.shape
    x = z[:, :3 * p].reshape(requests, q, 3 * p)
    taps = (accepted - 1)[:, None] + torch.arange(3, device=z.device)[None]
    window = conv[conv_slot].gather(1, taps[:, :, None].expand(requests, 3, 3 * p))
    seq = torch.cat([window, x], 1).float()
    acc = conv_weight[:, 0] * seq[:, 0:q]
    for j in range(1, 4):
        acc = acc + conv_weight[:, j] * seq[:, j:j + q]
    y = torch.nn.functional.silu(acc).to(torch.bfloat16).float().reshape(requests, q, 3, h, d)
    qh = _l2_normalize(y[:, :, 0]) * d ** -0.5
    kh = _l2_normalize(y[:, :, 1])
    v = y[:, :, 2]
    beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h].float()).reshape(requests, q, h)
    log_alpha = decay_log_alpha(g_raw.reshape(requests * q, h, d), A_log, dt_bias, LB).reshape(requests, q, h, d)
    s = rec[rec_read_slot].reshape(requests * h, d, d)
    o = []
    for t in range(q):
        qt, kt, vt, lat, bt = (a[:, t].reshape(1, requests * h, *a.shape[3:]) for a in (qh, kh, v, log_alpha, beta))
        o_t, s = gated_delta_rule_recurrent(qt, kt, vt, lat, bt, s)  # the requests folded into the heads
        o.append(o_t.reshape(requests, h, d))
        rec.index_copy_(0, rec_slots[:, t], s.reshape(requests, h, d, d))
    core = torch.stack(o, 1).to(torch.bfloat16).reshape(requests * q, h, d)
    positions = torch.arange(2 + q, device=z.device)[None].expand(requests, 2 + q)
    conv.index_put_((conv_slot[:, None].expand(requests, 2 + q), positions), torch.cat([window[:, 1:], x], 1))
    return _gated_rms_norm(core, z[:, 3 * p:4 * p].reshape(requests * q, h, d), o_norm).reshape(requests * q, p)


class KdaCase:
    """One shape: layer parameters, a state pool with `sets` disjoint slot sets (set i, request r owns
    rec slots 1 + (i·R + r)·q + j and conv slot 1 + i·R + r) and the step inputs."""

    def __init__(self, heads: int, q: int, requests: int, gen: torch.Generator):
        self.heads, self.q, self.requests = heads, q, requests
        p = self.p = heads * HEAD_DIM
        dev = {"generator": gen, "device": "cuda"}
        self.params = (torch.randn(3 * p, 4, **dev) * 0.5, torch.log(1 + 15 * torch.rand(heads, **dev)),
                       torch.randn(p, **dev) * 0.5, (1 + 0.2 * torch.randn(HEAD_DIM, **dev)).to(torch.bfloat16))
        rows = requests * q
        width = -(-(4 * p + HEAD_DIM + heads) // 16) * 16
        self.z = torch.randn(rows, width, **dev).to(torch.bfloat16)
        self.g_raw = (2 * torch.randn(rows, p, **dev)).to(torch.bfloat16)
        self.sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / self.touched_bytes())))
        n_req = self.sets * requests
        self.rec = torch.randn(1 + n_req * q, heads, HEAD_DIM, HEAD_DIM, **dev) * 0.5
        self.conv = torch.randn(1 + n_req, 2 + q, 3 * p, **dev).to(torch.bfloat16)
        self.slot_sets = []
        for i in range(self.sets):
            reqs = torch.arange(i * requests, (i + 1) * requests, device="cuda")
            own = 1 + reqs[:, None] * q + torch.arange(q, device="cuda")[None]
            long = (1 + reqs, own[:, 0].contiguous(), own, torch.ones(requests, dtype=torch.long, device="cuda"))
            self.slot_sets.append((tuple(t.to(torch.int32).contiguous() for t in long), long))
        self.out = torch.empty(rows, p, dtype=torch.bfloat16, device="cuda")

    def state_bytes(self) -> int:
        """State traffic of one launch: the read slot once, then one slot written per token."""
        return self.requests * (1 + self.q) * self.heads * HEAD_DIM * HEAD_DIM * 4

    def touched_bytes(self) -> int:
        """Distinct state bytes one launch touches (it reads the slot its first token writes)."""
        return self.requests * self.q * self.heads * HEAD_DIM * HEAD_DIM * 4

    def floor_bytes(self) -> int:
        p, rows = self.p, self.requests * self.q
        conv = self.requests * (3 + 2 + self.q) * 3 * p * 2
        acts = rows * (4 * p + self.heads) * 2 + rows * p * 2 + rows * p * 2  # z columns read, g_raw, out
        params = 3 * p * 16 + p * 4 + self.heads * 4 + HEAD_DIM * 2
        return self.state_bytes() + conv + acts + params

    def ours(self, i: int, split: int | None, rec=None, conv=None) -> Callable[[], torch.Tensor]:
        slots = self.slot_sets[i % self.sets][0]
        rec, conv = (self.rec if rec is None else rec), (self.conv if conv is None else conv)
        return lambda: kda_decode.launch(self.z, self.g_raw, *self.params, rec, conv, *slots, LB, self.out,
                                         split=split)

    def baseline(self, fn: Callable, i: int, rec=None, conv=None) -> Callable[[], torch.Tensor]:
        slots = self.slot_sets[i % self.sets][1]
        rec, conv = (self.rec if rec is None else rec), (self.conv if conv is None else conv)
        return lambda: fn(self.z, self.g_raw, *self.params, rec, conv, *slots)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def run_case(case: KdaCase, copy_bw: float, launch_us: float, compiled: Callable | None) -> dict:
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    heuristic = kda_decode.choose_split(case.requests, case.heads, sm_count)
    # correctness on set 0, on copies of the pools
    k_rec, k_conv, r_rec, r_conv = case.rec.clone(), case.conv.clone(), case.rec.clone(), case.conv.clone()
    got = case.ours(0, heuristic, k_rec, k_conv)().clone()
    want = case.baseline(torch_step, 0, r_rec, r_conv)()
    torch.cuda.synchronize()
    written = case.slot_sets[0][1][2].flatten()
    rel, state_rel = _rel_err(got, want), _rel_err(k_rec[written], r_rec[written])
    ok = (rel < OUT_REL_ERR_BOUND and state_rel < STATE_REL_ERR_BOUND and torch.equal(k_conv, r_conv)
          and not torch.isnan(got).any())
    del k_rec, k_conv, r_rec, r_conv

    n_launch = max(20, case.sets)
    by_split = {s: time_graph([case.ours(i, s) for i in range(n_launch)], replays=10, warmup=2) for s in SPLITS}
    n_base = min(n_launch, BASELINE_LAUNCHES)
    baselines = {"torch_eager": time_graph([case.baseline(torch_step, i) for i in range(n_base)], replays=10, warmup=2)}
    if compiled is not None:
        baselines["torch_compile"] = time_graph([case.baseline(compiled, i) for i in range(n_base)], replays=10,
                                                warmup=2)
    ours = by_split[heuristic]
    nbytes = case.floor_bytes()
    floor_us = nbytes / (copy_bw * 1e12) * 1e6
    rows = case.requests * case.q
    return {
        "name": f"h={case.heads} q={case.q} rows={rows}", "status": "pass" if ok else "fail",
        "shape": {"heads": case.heads, "q": case.q, "requests": case.requests, "rows": rows},
        "rel_err": rel, "state_rel_err": state_rel, "time_us": ours, "split": heuristic,
        "time_us_by_split": {str(s): t for s, t in by_split.items()}, "best_split": min(by_split, key=by_split.get),
        "floor_us": floor_us, "launch_floor_us": launch_us, "bytes": nbytes, "x_floor": ours / floor_us,
        "TBps": nbytes / (ours * 1e-6) / 1e12, "baseline_us": baselines,
        **{f"speedup_vs_{k.removeprefix('torch_')}": v / ours for k, v in baselines.items()},
        "cold_l2": case.sets * case.touched_bytes() >= COLD_BYTES,  # a replay visits every slot set
        "launches_per_graph": n_launch, "slot_sets": case.sets,
    }


def targets_of(results: list[dict]) -> list[dict]:
    """Issue 6's targets; the worst case decides."""
    out = []
    small = [r for r in results if r["shape"]["rows"] <= 8 and r["shape"]["q"] == 1]
    if small:
        worst = max(small, key=lambda r: r["x_floor"])
        out.append({"name": "q=1, rows 1-8: time / bytes floor", "target": f"<= {FLOOR_TARGET}",
                    "value": worst["x_floor"], "met": worst["x_floor"] <= FLOOR_TARGET, "worst_case": worst["name"],
                    "cases_met": sum(r["x_floor"] <= FLOOR_TARGET for r in small), "cases": len(small)})
    timed = [r for r in results if "speedup_vs_compile" in r]
    if timed:
        worst = min(timed, key=lambda r: r["speedup_vs_compile"])
        out.append({"name": "speedup vs torch.compile of the reference", "target": f">= {COMPILE_TARGET}",
                    "value": worst["speedup_vs_compile"], "met": worst["speedup_vs_compile"] >= COMPILE_TARGET,
                    "worst_case": worst["name"], "cases": len(timed),
                    "cases_met": sum(r["speedup_vs_compile"] >= COMPILE_TARGET for r in timed)})
    for heads in sorted({r["shape"]["heads"] for r in results}):
        one = {r["shape"]["q"]: r for r in results if r["shape"]["heads"] == heads and r["shape"]["requests"] == 1}
        if 1 in one and 8 in one:
            ratio = one[8]["time_us"] / one[1]["time_us"]
            out.append({"name": f"h={heads}: q=8 verify / q=1 step, one request", "target": f"<= {VERIFY_TARGET}",
                        "value": ratio, "met": ratio <= VERIFY_TARGET, "worst_case": one[8]["name"]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--q", type=int, nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
    require_cuda(p)
    t0 = time.time()
    copy_bw = copy_bandwidth_TBps()
    launch_us = launch_floor_us()
    gen = torch.Generator(device="cuda").manual_seed(6900)
    results, compiled, compiled_for = [], None, None
    for tp in args.heads:
        for q in args.q:
            for rows in ROWS[q]:
                case = KdaCase(HEADS[tp], q, rows // q, gen)
                # Compiled afresh whenever a recompile would come (torch specializes a batch of one
                # request; heads and q are loop bounds): on the H200 (torch 2.11) a dynamic recompile
                # of this function failed to build its guards ("sources must not be empty for symbol").
                if not args.no_compile and compiled_for != (tp, q, case.requests == 1):
                    torch._dynamo.reset()
                    compiled, compiled_for = torch.compile(torch_step, dynamic=True), (tp, q, case.requests == 1)
                results.append(run_case(case, copy_bw, launch_us, compiled))
                del case
                torch.cuda.empty_cache()
    targets = targets_of(results)
    if args.out:
        write_record(args.out, "kernel-bench", "kda", "python -m vllm.models.kimi_k3.nvidia.benchmarks."
                     "bench_kda_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
                     SOURCES, results, targets, copy_bandwidth_TBps=copy_bw,
                     extra={"timing": "CUDA graph of back-to-back launches over disjoint slot sets of one pool, "
                                      "median of 10 replays after 2; torch.compile(dynamic=True) of torch_step, "
                                      "compiled afresh per (heads, q, one request or more)",
                            "launch_floor_us": launch_us, "wall_s": time.time() - t0})
    nan = float("nan")
    print(f"copy bandwidth {copy_bw:.2f} TB/s; empty-kernel launch in a graph {launch_us:.2f} us; "
          f"{len(results)} cases in {time.time() - t0:.0f} s")
    print(f"{'case':22s} {'split':>5s} {'ours':>7s} {'s2':>7s} {'s4':>7s} {'s8':>7s} {'eager':>8s} {'compile':>8s} "
          f"{'floor':>6s} {'x floor':>7s} {'TB/s':>5s} {'relerr':>8s}")
    for r in results:
        s, b = r["time_us_by_split"], r["baseline_us"]
        print(f"{r['name']:22s} {r['split']:5d} {r['time_us']:7.2f} {s['2']:7.2f} {s['4']:7.2f} {s['8']:7.2f} "
              f"{b['torch_eager']:8.2f} {b.get('torch_compile', nan):8.2f} {r['floor_us']:6.2f} {r['x_floor']:7.2f} "
              f"{r['TBps']:5.2f} {r['rel_err']:8.1e}{'' if r['status'] == 'pass' else ' FAIL'}")
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.2f} ({'met' if t['met'] else 'MISSED'}; "
              f"worst {t['worst_case']})")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
