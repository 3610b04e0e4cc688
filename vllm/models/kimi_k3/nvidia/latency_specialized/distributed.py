"""Tensor parallelism across processes: `TorchDistributed`, the torchrun launch, `tp_generate`.

    all_reduce(x)    = round_bf16( Σ_{r = 0 .. tp-1} fp32(x_r) )   summed in rank order
    all_gather(x, d) = cat(x_0, …, x_{tp-1}; dim = d)

`TorchDistributed` is the `Collective` (reference/collective.py) over a torch.distributed
process group: NCCL on GPUs (one process per GPU), gloo on CPUs (CI). It does not call
`dist.all_reduce`. NCCL's reduction order depends on its algorithm (ring or tree), channel
count and message size, and a ring rounds each hop's partial sum back to bf16; the result
would then depend on the launch and differ from `SingleRank` / `ThreadGroup`, which every
TP test and kernel is judged against. Instead every rank all-gathers the raw bf16 partials
into one [tp, …] buffer and sums them itself in rank order in fp32 with the same
`ordered_sum` as `ThreadGroup`, rounding once: bit-identical to the in-process simulation,
and identical on every rank, so sampling, MoE routing and path decisions cannot drift
apart. The cost: each rank receives (tp-1)·n elements where a ring all-reduce moves
2·(tp-1)/tp·n, i.e. tp/2 times the bytes (4x at TP8), plus a [tp, n] buffer and a
redundant tp-term fp32 sum on every rank. Decode messages are a few rows of 7168 bf16
(14 KiB a row), where a collective is latency-bound and one all-gather takes tp-1 ring
steps against the all-reduce's 2·(tp-1); bandwidth-bound prefill pays the extra bytes.
A fused all-reduce kernel may replace this only if it keeps the rank-order fp32 sum.

NVLink multicast (NVLS) stays off: on the shared H200 hosts a program that uses it can put
every GPU of the host out of service. `init_from_env` sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before NCCL starts, and
`TorchDistributed` refuses an NCCL group created without them.

Launch: `torchrun --nproc-per-node N -m vllm.models.kimi_k3.nvidia.latency_specialized
generate --tp N --config mini …` (the default tiny config has one head: TP 1 only); each
process loads only its shard (`load_rank(…, tp, rank)`), rank 0 prints, and at the end
every rank's per-step decisions are gathered and must be equal.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import astuple, dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..reference.collective import GatheredCollective
from ..reference.model import ReferenceModel
from .config import K3TextConfig
from .deployment import Deployment, StepFacts
from .dispatch import Dispatcher, Route
from .engine import Completion, Engine, Request, RunStats
from .options import BackendOptions
from .weights import TensorSource, load_rank

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = ("launch one process per rank with torchrun, e.g. `torchrun --nproc-per-node 4 "
               "-m vllm.models.kimi_k3.nvidia.latency_specialized generate --tp 4 --config mini --prompt hi` "
               "(--config mini: the default tiny config has one attention head, so it runs at --tp 1 only)")

# torch 2.13 renamed all_gather_into_tensor; the GPU image's torch 2.11 has only the old name
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LaunchError(ValueError):
    """The process was not started the way a TP run needs (torchrun, one process per rank)."""


def disable_nvlink_multicast() -> None:
    """Force NVLink multicast off in NCCL, PyTorch symmetric memory and NVSHMEM (this process
    and its children); must run before the first NCCL communicator is created."""
    os.environ.update(MULTICAST_OFF)


class TorchDistributed(GatheredCollective):
    """One rank of a TP group formed by a torch.distributed process group (default: world)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_from_env() first, or "
                               + LAUNCH_HINT)
        self.group = group
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.nccl = "nccl" in self.backend
        if self.nccl:
            wrong = {k: os.environ.get(k) for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
            if wrong:
                raise RuntimeError(
                    f"NCCL group created with NVLink multicast not disabled ({wrong}); set "
                    + ", ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items())
                    + " before init_process_group (init_from_env does this)")

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, stacked in rank order: [tp, *x.shape]."""
        if self.nccl and not x.is_cuda:
            raise ValueError(f"NCCL collectives need CUDA tensors, got one on {x.device}; "
                             "load the weights with device='cuda'")
        flat = x.contiguous().reshape(-1)
        out = torch.empty(self.tp * flat.numel(), dtype=x.dtype, device=x.device)
        _gather_into(out, flat, group=self.group)
        return out.view(self.tp, *x.shape)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Host-side objects of every rank, in rank order (for checks, never on the hot path)."""
        every: list[Any] = [None] * self.tp
        dist.all_gather_object(every, obj, group=self.group)
        return every


def init_from_env(backend: str | None = None) -> TorchDistributed:
    """Join the process group torchrun describes in the environment and return the world's
    collective. Backend: nccl when CUDA is present, else gloo; with nccl the process's GPU
    is LOCAL_RANK and NVLink multicast is switched off first."""
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise LaunchError(f"not started by torchrun: {', '.join(missing)} unset; " + LAUNCH_HINT)
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as e:
        raise LaunchError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({e}); " + LAUNCH_HINT) from None
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend {backend!r} is not supported: use 'nccl' (GPUs) or 'gloo' (CPUs)")
    device_id = None
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("backend nccl needs CUDA devices and none is present; use backend 'gloo'")
        if local >= torch.cuda.device_count():
            raise LaunchError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA device(s); "
                               "start at most one process per GPU (--nproc-per-node)")
        disable_nvlink_multicast()
        torch.cuda.set_device(local)
        device_id = torch.device("cuda", local)
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise LaunchError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not rank {rank} of {world} as the environment says")
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                device_id=device_id)
    return TorchDistributed()


def _tp_size(text: str) -> int:
    try:
        tp = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp must be an integer, got {text!r}") from None
    if tp < 1:
        raise argparse.ArgumentTypeError(f"--tp must be >= 1, got {tp}")
    return tp


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=_tp_size, default=1,
                        help="tensor-parallel size; above 1 one process per rank: torchrun "
                             "--nproc-per-node N -m vllm.models.kimi_k3.nvidia.latency_specialized "
                             "generate --tp N --config mini ... (nccl on GPUs, gloo on CPUs; the "
                             "default tiny config has one head and runs at --tp 1 only)")


class _RouteLog:
    """Forwards `route` to the dispatcher and keeps every decode step's facts and decision."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self.steps: list[tuple] = []

    def route(self, facts: StepFacts) -> Route:
        route = self.dispatcher.route(facts)
        self.steps.append((astuple(facts), route.path, route.reason))
        return route


def check_ranks_agree(coll: TorchDistributed, steps: Sequence[tuple],
                      outputs: Sequence[Sequence[int]]) -> str:
    """Gather every rank's per-step (facts, path, reason) and sampled tokens; raise on any
    difference (on every rank alike), else return the one-line statement of agreement."""
    every = coll.all_gather_object((list(steps), [list(o) for o in outputs]))
    steps0, outs0 = every[0]
    for r, (steps_r, outs_r) in enumerate(every[1:], start=1):
        if steps_r != steps0:
            i = next((i for i, (a, b) in enumerate(zip(steps0, steps_r)) if a != b),
                     min(len(steps0), len(steps_r)))
            mine = steps_r[i] if i < len(steps_r) else "no step"
            theirs = steps0[i] if i < len(steps0) else "no step"
            raise RuntimeError(f"TP ranks diverged at decode step {i}: rank {r} took {mine}, "
                               f"rank 0 took {theirs}")
        if outs_r != outs0:
            raise RuntimeError(f"TP ranks diverged: rank {r} sampled {outs_r}, rank 0 sampled {outs0}")
    return (f"tp {coll.tp} over {coll.backend}: all {coll.tp} ranks took the same path on every step "
            f"(decode steps: {len(steps0)}) and sampled the same tokens")


@dataclass
class TPGeneration:
    rank: int
    completions: list[Completion]
    stats: RunStats
    dispatcher: Dispatcher  # this rank's (its counters and verdict)
    load_s: float
    agreement: str  # check_ranks_agree's line


def tp_generate(cfg: K3TextConfig, source: TensorSource, requests: Sequence[Request], *, tp: int,
                options: BackendOptions, max_len: int, device: str = "cpu") -> TPGeneration:
    """This process's rank of a TP `tp` generation: join the group, load the shard, run the
    engine with `TorchDistributed`, check that all ranks agree, leave the group."""
    coll = init_from_env("nccl" if device == "cuda" else "gloo")
    try:
        if coll.tp != tp:
            raise LaunchError(f"--tp {tp} but torchrun started {coll.tp} process(es); "
                             f"use torchrun --nproc-per-node {tp}")
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        t0 = time.perf_counter()
        model = ReferenceModel(cfg, load_rank(source, cfg, tp, coll.rank, device=dev), coll=coll)
        load_s = time.perf_counter() - t0
        deployment = Deployment.detect(tp=tp, max_model_len=max_len, expert_dtype="bfloat16")
        dispatcher = Dispatcher(options, deployment)
        routes = _RouteLog(dispatcher)
        engine = Engine(model, dispatcher=routes, max_requests=len(requests), max_len=max_len)
        done = engine.generate(requests)
        agreement = check_ranks_agree(coll, routes.steps, [c.output_ids for c in done])
        return TPGeneration(coll.rank, done, engine.stats, dispatcher, load_s, agreement)
    finally:
        dist.destroy_process_group()
