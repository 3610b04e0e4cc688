"""The decode step of a real TP group, timed: what the collectives add to each rank's step.

Every other decode figure here is one rank's compute on one GPU with identity exchanges
(`SingleRank`). Under torchrun, one process per GPU, this times each rank's CUDA-graph replay of
K3's first `--layers` layers over the same weights in two forms: `alone` (identity exchanges,
as decode_latency times it) and `group` (`TorchDistributed` over NCCL: every exchange an
all-gather of the partials and a rank-order fp32 sum, distributed.py). group − alone is what a
step's exchanges cost; divided by their count (`exchanges_per_step`) it is the price of one,
which is what a layout trading compute for exchanges (K3_MATH.md §5.1, REVIEW.md §4) must beat.
One all-reduce of the step's hidden rows is also timed alone, in a graph. Under vLLM the same
gather-and-sum goes through vLLM's group (`VllmCollective`) on its device communicator, so these
figures are torch.distributed's NCCL, the closest stand-in outside vLLM, not vLLM's own.

    torchrun --nproc-per-node 8 -m vllm.models.kimi_k3.nvidia.benchmarks.decode_tp --rows 1 2 8 --out $OUT/decode_tp.json

Per row count the forms run A B B A, each run after a barrier so that the ranks replay
together; a run is the median µs of `--reps` replays. Rank 0 reports each form's mean of its
two runs per rank and at the slowest rank (a step of the group ends when its slowest rank does).
Every rank holds rank 0's shard of K3's random weights (`k3_block`): every rank's shapes, bytes
and exchanges, not its values. So there is no parity against the standard step here; each case's
check is that every rank's logits of the group's first step are bit-identical (the rank-order
sums make them so), and the sums themselves are checked against `ThreadGroup` by
tests/test_distributed.py, on the CPU and on GPUs.
TP is the group's size. A 12-layer TP8 shard (85.1 GB of weights) does not fit an 80 GB card:
pass fewer `--layers` there (a step's time grows with its layers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..latency_specialized.decode_ops import KernelOps
from ..latency_specialized.distributed import LaunchError, init_from_env
from ..latency_specialized.evidence import write_record
from ..latency_specialized.executor import SpecializedDecode
from ..reference.model import ReferenceModel
from ..reference.params import MoEWeights
from .bench_skinny_gemm import require_cuda, time_graph
from .block_parity import BLOCK_LAYERS, PARITY_SOURCES, BlockDoesNotFit, fill_state, k3_block, segments
from .decode_latency import _rollback, median_ms

SOURCES = (*PARITY_SOURCES, "vllm/models/kimi_k3/nvidia/latency_specialized/distributed.py",
           *(f"vllm/models/kimi_k3/nvidia/benchmarks/{f}.py" for f in ("decode_tp", "decode_latency", "bench_moe")))
ORDER = ("alone", "group", "group", "alone")
CONTEXT = 4096


def exchanges_per_step(model: ReferenceModel) -> int:
    """The collectives one decode step of `SpecializedDecode` makes: the embedding's all-reduce,
    one a layer after its attention's output projection, one after a dense MLP or two after a
    MoE layer (its routed and its shared experts' sums), and the LM head's all-gather."""
    return 2 + sum(1 + (2 if isinstance(lw.mlp, MoEWeights) else 1) for lw in model.w.layers)


def summarize(per_rank: list[dict[str, list[float]]], rows: int, exchanges: int, exchange_us: list[float],
              ranks_agree: bool) -> dict:
    """One row count's result from every rank's runs ({form: [µs of each run]}, in rank order):
    each form's mean of its runs per rank, the slowest rank's, and what the exchanges cost."""
    mean = {form: [statistics.fmean(r[form]) for r in per_rank] for form in ("alone", "group")}
    slowest = {form: max(times) for form, times in mean.items()}
    cost = slowest["group"] - slowest["alone"]
    return {"name": f"tp{len(per_rank)} rows{rows} q1 ctx{CONTEXT}", "status": "pass" if ranks_agree else "fail",
            "ranks_agree": ranks_agree, "rows": rows,
            "time_us": slowest["group"], "alone_us": slowest["alone"],
            "per_rank_us": mean, "exchanges_per_step": exchanges,
            "exchanges_us": cost, "per_exchange_us": cost / exchanges,
            "one_all_reduce_us": max(exchange_us), "one_all_reduce_per_rank_us": exchange_us}


def time_forms(executors: dict[str, SpecializedDecode], rows: int, reps: int,
               seed: int) -> tuple[dict[str, list[float]], torch.Tensor]:
    """Each form's step at `rows` requests of CONTEXT tokens, ORDER's runs after a barrier each;
    and the group's logits of its first step."""
    key = (rows, 1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = {}
    for name, ex in executors.items():
        for r in range(ex.state.max_requests):
            ex.state.free(r)
        slots = fill_state(ex.state, rows, CONTEXT, gen)
        ids = torch.randint(0, ex.w.lm_head.shape[0], (rows,), generator=gen, device="cuda")
        logits[name] = ex(ids, segments(ex.state, slots, 1), ex.state).clone()  # fills the metadata once
        _rollback(ex.state, slots, 1)
    runs: dict[str, list[float]] = {"alone": [], "group": []}
    for form in ORDER:
        torch.cuda.synchronize()
        dist.barrier()
        runs[form].append(median_ms(lambda ex=executors[form]: ex.replay(key), reps) * 1e3)
    return runs, logits["group"]


def one_all_reduce_us(coll, rows: int, hidden: int, reps: int) -> float:
    """Median µs of one all-reduce of `rows` hidden rows, captured alone in a CUDA graph (its first
    run, outside the capture, starts the communicator's use there)."""
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    dist.barrier()
    return time_graph([lambda: coll.all_reduce(x)], replays=reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8], help="requests a step (q = 1)")
    p.add_argument("--layers", type=int, default=BLOCK_LAYERS, help="K3's first layers each rank holds")
    p.add_argument("--reps", type=int, default=50, help="graph replays a timed run")
    p.add_argument("--out", default=None, help="evidence JSON path (rank 0 writes it)")
    args = p.parse_args(argv)
    require_cuda(p)
    if min(args.rows) < 1 or args.layers < 1 or args.reps < 1:
        p.error(f"--rows, --layers and --reps must be at least 1 (got {args.rows}, {args.layers}, {args.reps})")
    try:
        coll = init_from_env("nccl")
    except LaunchError as e:
        p.error(f"{e} (here: torchrun --nproc-per-node N -m vllm.models.kimi_k3.nvidia.benchmarks.decode_tp)")
    t0 = time.time()
    try:
        try:
            alone = k3_block(coll.tp, layers=args.layers, device="cuda")
        except BlockDoesNotFit as e:
            p.error(f"{e}; pass fewer --layers")
        group = ReferenceModel(alone.cfg, alone.w, coll=coll)
        row_counts = sorted(set(args.rows))
        buckets = [(r, 1) for r in row_counts]
        max_len = CONTEXT + 8
        log = print if coll.rank == 0 else (lambda _: None)
        executors = {"alone": SpecializedDecode(alone, max_requests=row_counts[-1], max_len=max_len, buckets=buckets,
                                                ops=KernelOps(), log=log)}
        try:  # the first run of torch.distributed's NCCL inside a CUDA-graph capture here: say so if it fails
            executors["group"] = SpecializedDecode(group, max_requests=row_counts[-1], max_len=max_len,
                                                   buckets=buckets, ops=KernelOps(), log=log)
        except Exception as e:
            raise RuntimeError(f"rank {coll.rank}: the group's executor did not build (its NCCL all-gathers are "
                               f"captured in the step's CUDA graphs): {type(e).__name__}: {e}") from e
        exchanges = exchanges_per_step(group)
        results = []
        for rows in row_counts:
            runs, logits = time_forms(executors, rows, args.reps, seed=rows)
            every_logits = coll.all_gather(logits.unsqueeze(0), dim=0)
            agree = all(torch.equal(x, every_logits[0]) for x in every_logits)
            one = one_all_reduce_us(coll, rows, alone.cfg.hidden_size, args.reps)
            every = coll.all_gather_object((runs, one))
            results.append(summarize([r for r, _ in every], rows, exchanges, [o for _, o in every], agree))
            if coll.rank == 0:
                r = results[-1]
                print(f"[decode_tp] rows {rows}: alone {r['alone_us']:.1f} us, group {r['time_us']:.1f} us "
                      f"(slowest rank), {exchanges} exchanges cost {r['exchanges_us']:.1f} us, "
                      f"{r['per_exchange_us']:.2f} us each; one all-reduce alone {r['one_all_reduce_us']:.2f} us",
                      file=sys.stderr, flush=True)
        if coll.rank == 0:
            if args.out:
                # kernel-bench: a decode-bench result's status is a parity verdict, which this has not
                write_record(args.out, "kernel-bench", "collectives",
                             f"torchrun --nproc-per-node {coll.tp} -m vllm.models.kimi_k3.nvidia.benchmarks."
                             "decode_tp " + " ".join(argv if argv is not None else sys.argv[1:]),
                             SOURCES, results,
                             extra={"tp": coll.tp, "layers": args.layers, "context": CONTEXT,
                                    "timing": f"CUDA-graph replays, median of {args.reps} a run, runs {' '.join(ORDER)} "
                                              "after a barrier each; per form the mean of its runs, at the slowest "
                                              "rank; timing only (every rank holds rank 0's shard of random weights)",
                                    "wall_s": time.time() - t0})
            print("| TP | rows | alone µs | group µs | exchanges | µs each | one all-reduce alone µs | ranks agree |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for r in results:
                print(f"| {coll.tp} | {r['rows']} | {r['alone_us']:.1f} | {r['time_us']:.1f} | {r['exchanges_per_step']} "
                      f"| {r['per_exchange_us']:.2f} | {r['one_all_reduce_us']:.2f} | {r['ranks_agree']} |")
    finally:
        dist.destroy_process_group()
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
