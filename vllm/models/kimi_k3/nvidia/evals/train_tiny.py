"""Train the `tiny` K3 model on the synthetic long-context tasks; save it as a real checkpoint.

    python -m vllm.models.kimi_k3.nvidia.evals.train_tiny --device cuda --out DIR --curve FILE.json

Deterministic: the initial weights are `RandomSource(TINY, seed)`, batch i of the run is
built from seeds derived from (seed, i), and torch's deterministic algorithms are on (an op
without a deterministic CUDA kernel warns instead of aborting), so the same command on the
same GPU and software gives the same checkpoint up to those ops.

| part | choice |
| --- | --- |
| model | `TrainModel`: the reference math in differentiable whole-sequence form |
| data | mrcr / kv / arith mixed 2:2:1; lengths 512 → `--max-length` in stages with the shares of `STAGE_SHARES` (a curriculum); ~`--tokens-per-step` tokens a step, generated `--workers` processes ahead of the GPU |
| loss | cross-entropy on answer tokens (final and practice queries), 0.1 × on every other token |
| optimizer | AdamW (β 0.9/0.95, decay on matrices only), warm-up, cosine to 10 %, clipping at 1.0 |
| precision | bf16 GEMMs at the reference's rounding points (train_model.py), fp32 masters |
| budget | `--steps` fixes the schedule; `--max-seconds` stops early, saves, and says so |
| speed | on CUDA the whole step (forward, backward, clipping, AdamW) is one CUDA-graph replay per curriculum stage (`GraphedStep`); batches are padded to a fixed width per stage for it |

Output: `DIR/config.json` + `DIR/model.safetensors` (HF-style, real checkpoint names,
written by `weights.save_checkpoint`, read back by `weights.load_rank`), and the training
curve (loss per logged step, and at the end teacher-forced exact match per task and
length: greedy decoding reproduces the answer exactly iff every answer token is the
argmax given the true prefix, so this is greedy exact match without a decode loop).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..latency_specialized.config import K3TextConfig
from ..latency_specialized.tokenizer import ByteTokenizer
from ..latency_specialized.weights import RandomSource, TensorSource, WeightError, save_checkpoint
from . import tasks
from .tiny import TINY
from .train_model import TrainModel

TOK = ByteTokenizer()
CURRICULUM = (512, 1024, 2048, 4096, 8192)
# shares of the run per curriculum stage (renormalized over the stages used): short contexts
# teach the formats in many cheap steps, long ones the distances the evals ask for
STAGE_SHARES = (0.35, 0.3, 0.2, 0.15, 0.1)
ANSWER_ROOM = 96  # tokens after the context: the longest answer (an MRCR text) and EOS, rounded up


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    seed: int = 0
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    tokens_per_step: int = 65536
    max_length: int = 4096
    mix: tuple[tuple[str, float], ...] = (("mrcr", 0.4), ("kv", 0.4), ("arith", 0.2))
    practice: float = 0.3
    context_weight: float = 0.1
    kda_chunk: int = 32
    log_every: int = 10
    max_seconds: float = 0.0  # 0: no limit
    workers: int = 0  # data processes (0: built inline, between steps)
    graphs: bool = True  # on CUDA, each step is a CUDA-graph replay (GraphedStep)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.log_every < 1 or self.workers < 0:
            raise ValueError("steps must be >= 1, warmup >= 0, log_every >= 1 and workers >= 0")
        if self.max_length < CURRICULUM[0]:
            raise ValueError(f"max_length must be at least {CURRICULUM[0]} tokens, found {self.max_length}")
        unknown = [t for t, _ in self.mix if t not in tasks.TASKS]
        if unknown or not self.mix or any(w <= 0 for _, w in self.mix):
            raise ValueError(f"mix must weight known tasks ({', '.join(tasks.TASKS)}) positively, "
                             f"found {self.mix}")


class DictSource(TensorSource):
    """Checkpoint tensors held in memory, by name (what `save_checkpoint` reads)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def get(self, name: str, rows=None, cols=None) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightError(f"the trained model has no tensor {name}")
        t = self.tensors[name]
        if rows:
            t = t[rows[0]:rows[1]]
        if cols:
            t = t[:, cols[0]:cols[1]]
        return t


def save(model: TrainModel, out_dir: str | Path) -> Path:
    """The trained weights as config.json + model.safetensors, in the real checkpoint's names."""
    return save_checkpoint(DictSource(model.checkpoint_tensors()), model.cfg, out_dir)


# ---------------------------------------------------------------------- data


def length_at(step: int, tc: TrainConfig) -> int:
    """The curriculum: 512, 1024, ... up to max_length, each for its share of the run."""
    stages = [n for n in CURRICULUM if n < tc.max_length] + [tc.max_length]
    shares = [STAGE_SHARES[min(i, len(STAGE_SHARES) - 1)] for i in range(len(stages))]
    edge, where = 0.0, step / tc.steps * sum(shares)
    for n, share in zip(stages, shares):
        edge += share
        if where < edge:
            return n
    return stages[-1]


def sequence(sample: tasks.Sample, context_weight: float) -> tuple[list[int], list[float]]:
    """Token ids of prompt + answer, and each position's loss weight for predicting the next id."""
    ids = sample.prompt_ids + sample.answer_ids
    weight = [context_weight] * len(ids)
    for a, b in sample.supervised:
        for t in range(a, b):
            weight[t] = 1.0
    for t in range(len(sample.prompt_ids), len(ids)):
        weight[t] = 1.0
    # position t predicts token t + 1: shift the weights left by one
    return ids, weight[1:] + [0.0]


def batch(step: int, tc: TrainConfig, device: torch.device | str
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids [B, T], next-token targets [B, T], loss weights [B, T], context length) of one step."""
    return to_tensors(*sequences(step, tc), device)


def sequences(step: int, tc: TrainConfig) -> tuple[list[tuple[list[int], list[float]]], int]:
    """The step's (ids, loss weights) per sequence, and its context length: plain Python, so a
    data process can build it (a pure function of (seed, step): the run is the same with any
    number of workers)."""
    length = length_at(step, tc)
    size = max(1, tc.tokens_per_step // length)
    rng = random.Random(f"k3-train:{tc.seed}:{step}")
    names = [t for t, _ in tc.mix]
    weights = [w for _, w in tc.mix]
    seqs = []
    for i in range(size):
        task = rng.choices(names, weights)[0]
        s = tasks.make(task, length, seed=(tc.seed * 1_000_003 + step) * 1024 + i, practice=tc.practice)
        seqs.append(sequence(s, tc.context_weight))
    return seqs, length


def to_tensors(seqs: list[tuple[list[int], list[float]]], length: int, device: torch.device | str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Padded to `length + ANSWER_ROOM` tokens, so every batch of a stage has one shape (the
    padding predicts nothing: weight 0, and causal attention keeps it out of earlier tokens)."""
    size = len(seqs)
    width = length + ANSWER_ROOM
    longest = max(len(ids) for ids, _ in seqs)
    if longest > width:
        raise ValueError(f"a training sequence of {longest} tokens exceeds its stage's {width}; raise ANSWER_ROOM")
    ids = torch.full((size, width), TOK.PAD, dtype=torch.long)
    wts = torch.zeros(size, width)
    for r, (s_ids, s_w) in enumerate(seqs):
        ids[r, :len(s_ids)] = torch.tensor(s_ids)
        wts[r, :len(s_w)] = torch.tensor(s_w)
    targets = torch.cat([ids[:, 1:], torch.full((size, 1), TOK.PAD, dtype=torch.long)], 1)
    return ids.to(device), targets.to(device), wts.to(device), length


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per_token * weights.flatten()).sum() / weights.sum().clamp_min(1e-9)


# ---------------------------------------------------------------------- optimization


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def optimizer(model: TrainModel, tc: TrainConfig, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on the projection matrices only (not norms, gates, conv taps, biases).
    `capturable`: fused, with the learning rate a device tensor, so a CUDA graph can hold the step."""
    def decayed(name: str, p: torch.Tensor) -> bool:
        return p.dim() == 2 and not name.endswith("_res_proj.weight")

    named = list(model.named_parameters())
    device = named[0][1].device
    lr = torch.tensor(tc.lr, device=device) if capturable else tc.lr
    return torch.optim.AdamW([{"params": [p for n, p in named if decayed(n, p)], "weight_decay": tc.weight_decay},
                              {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
                             capturable=capturable)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # in place: a captured step reads this tensor
        else:
            group["lr"] = lr


def train_step(model: TrainModel, opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor,
               weights: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step; (loss, answer-token loss, gradient norm before clipping), on the device."""
    logits = model(ids)
    loss = weighted_loss(logits, targets, weights)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # a tensor: no host sync
    opt.step()
    with torch.no_grad():
        answer = weighted_loss(logits.detach(), targets, (weights >= 1.0).float())
    return loss.detach(), answer, grad_norm


class GraphedStep:
    """`train_step` as one CUDA graph per batch shape: the tiny model's step is thousands of small
    kernels, so replaying them from one graph instead of launching each is most of the speed.

    Capturing needs warm-up steps that really run (they initialize AdamW's state and cuBLAS), so
    the model and optimizer state are saved before them and restored after: the run computes
    the same steps as the eager loop."""

    def __init__(self, model: TrainModel, opt: torch.optim.Optimizer, clip: float, warmup: int = 2):
        self.model, self.opt, self.clip, self.warmup = model, opt, clip, warmup
        self.shape: tuple[int, ...] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if tuple(ids.shape) != self.shape:
            self._capture(ids, targets, weights)
        self.ids.copy_(ids)
        self.targets.copy_(targets)
        self.weights.copy_(weights)
        self.graph.replay()
        return self.out

    def _capture(self, ids: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> None:
        self.graph = None
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # the previous shape's graph pool
        self.ids, self.targets, self.weights = ids.clone(), targets.clone(), weights.clone()
        saved = ([p.detach().clone() for p in self.model.parameters()],
                 {id(t): t.clone() for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t)})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                train_step(self.model, self.opt, self.ids, self.targets, self.weights, self.clip)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), saved[0]):
                p.copy_(p0)
            for t in (t for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t)):
                if id(t) in saved[1]:
                    t.copy_(saved[1][id(t)])
                else:  # state the warm-up created starts from zero, as a first real step expects
                    t.zero_()
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = train_step(self.model, self.opt, self.ids, self.targets, self.weights, self.clip)
        self.shape = tuple(ids.shape)


@contextlib.contextmanager
def deterministic(seed: int):
    """Seeded, deterministic kernels, no TF32; the process's previous settings come back after.

    warn_only: an op without a deterministic CUDA kernel (torch names it in a warning) must not
    abort a one-shot device run; the curve records the run either way."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


@torch.no_grad()
def teacher_forced_exact(model: TrainModel, task: str, length: int, n: int, seed: int,
                         device: torch.device | str) -> float:
    """Fraction of n held-out samples whose every answer token is the argmax (= greedy exact match)."""
    hits = 0
    for s in tasks.suite(task, length, n, seed=seed):
        ids = torch.tensor([s.prompt_ids + s.answer_ids[:-1]], device=device)
        pred = model(ids)[0, len(s.prompt_ids) - 1:].argmax(-1).tolist()
        hits += int(pred == s.answer_ids)
    return hits / n


def train(tc: TrainConfig, *, cfg: K3TextConfig = TINY, device: str = "cpu", log=None
          ) -> tuple[TrainModel, dict]:
    """Run the training loop; returns the model and the curve (a JSON-ready dict)."""
    with deterministic(tc.seed):
        return _train(tc, cfg, device, log)


class Batches:
    """The run's batches in step order, built `tc.workers` processes ahead of the training loop
    (the GPU step of the tiny model is shorter than building its 65 k tokens in Python)."""

    def __init__(self, tc: TrainConfig, device: torch.device | str):
        self.tc, self.device, self.next = tc, device, 0
        # spawn: the workers import no CUDA state, whatever the parent has initialized
        self.pool = (ProcessPoolExecutor(tc.workers, mp_context=multiprocessing.get_context("spawn"))
                     if tc.workers else None)
        self.pending = [self.pool.submit(sequences, s, tc) for s in range(min(tc.steps, 2 * tc.workers))
                        ] if self.pool else []

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if self.next >= self.tc.steps:
            raise StopIteration
        step, self.next = self.next, self.next + 1
        if self.pool is None:
            return batch(step, self.tc, self.device)
        ahead = step + len(self.pending)
        if ahead < self.tc.steps:
            self.pending.append(self.pool.submit(sequences, ahead, self.tc))
        return to_tensors(*self.pending.pop(0).result(), self.device)

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


def _train(tc: TrainConfig, cfg: K3TextConfig, device: str, log) -> tuple[TrainModel, dict]:
    model = TrainModel.from_source(cfg, RandomSource(cfg, seed=tc.seed), kda_chunk=tc.kda_chunk).to(device)
    graphed = tc.graphs and torch.device(device).type == "cuda"
    opt = optimizer(model, tc, capturable=graphed)
    step_fn = GraphedStep(model, opt, tc.clip) if graphed else (
        lambda ids, targets, weights: train_step(model, opt, ids, targets, weights, tc.clip))
    curve: dict = {"config": cfg.name, "train": asdict(tc),
                   "params": sum(p.numel() for p in model.parameters()), "steps": [], "stopped_early": False}
    batches = Batches(tc, device)
    t0 = time.perf_counter()
    try:
        for step, (ids, targets, weights, length) in enumerate(batches):
            set_lr(opt, lr_at(step, tc))
            loss, answer, grad_norm = step_fn(ids, targets, weights)
            if step % tc.log_every == 0 or step == tc.steps - 1:
                row = {"step": step, "loss": loss.item(), "answer_loss": answer.item(), "lr": lr_at(step, tc),
                       "grad_norm": float(grad_norm), "length": length, "batch": ids.shape[0],
                       "seconds": round(time.perf_counter() - t0, 2)}
                curve["steps"].append(row)
                if log:
                    log(row)
                # the time limit is checked where the loop syncs anyway
                if tc.max_seconds and row["seconds"] > tc.max_seconds:
                    curve["stopped_early"] = True
                    curve["stopped_at_step"] = step
                    break
    finally:
        batches.close()
    curve["train_seconds"] = round(time.perf_counter() - t0, 2)
    return model.eval(), curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train_tiny", description=__doc__.split("\n")[0])
    d = TrainConfig()
    ap.add_argument("--out", required=True, help="checkpoint folder (config.json + model.safetensors)")
    ap.add_argument("--curve", required=True, help="JSON file for the training curve")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    ap.add_argument("--max-length", type=int, default=d.max_length)
    ap.add_argument("--kda-chunk", type=int, default=d.kda_chunk)
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--no-graphs", action="store_true", help="launch every kernel of a step (no CUDA graph)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes building batches ahead of the GPU (default: up to 8 on cuda, 0 on cpu)")
    ap.add_argument("--max-seconds", type=float, default=480.0,
                    help="stop the loop after this many seconds and save (default 480, for a 10-minute call)")
    ap.add_argument("--eval-lengths", default="1024,4096", help="lengths of the final exact-match check")
    ap.add_argument("--eval-samples", type=int, default=16)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible here; train on one, or pass --device cpu (slow)")
    tc = TrainConfig(steps=args.steps, seed=args.seed, lr=args.lr, tokens_per_step=args.tokens_per_step,
                     max_length=args.max_length, kda_chunk=args.kda_chunk, max_seconds=args.max_seconds,
                     log_every=args.log_every, graphs=not args.no_graphs,
                     workers=args.workers if args.workers is not None else
                     (min(8, max(0, (os.cpu_count() or 1) - 2)) if args.device == "cuda" else 0))
    lengths = tuple(int(x) for x in args.eval_lengths.split(",") if x)
    try:  # a bad eval length must fail now, not after the training run
        for n in lengths:
            for task, _ in tc.mix:
                tasks.make(task, n, 0)
    except ValueError as e:
        print(f"error: --eval-lengths: {e}", file=sys.stderr)
        return 2

    def log(row: dict) -> None:
        print(json.dumps(row), file=sys.stderr, flush=True)

    model, curve = train(tc, device=args.device, log=log)
    curve["command"] = " ".join(["python -m vllm.models.kimi_k3.nvidia.evals.train_tiny"] + sys.argv[1:])
    curve["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    curve["torch"] = torch.__version__
    out = save(model, args.out)
    curve_path = Path(args.curve)
    curve_path.parent.mkdir(parents=True, exist_ok=True)
    curve_path.write_text(json.dumps(curve, indent=1) + "\n")  # saved before the check, in case it dies
    curve["exact_match"] = {task: {str(n): teacher_forced_exact(model, task, n, args.eval_samples,
                                                                10_000 + tc.seed, args.device)
                                   for n in lengths}
                            for task, _ in tc.mix} if args.eval_samples else {}
    curve_path.write_text(json.dumps(curve, indent=1) + "\n")
    print(f"[train_tiny] {len(curve['steps'])} logged steps, {curve['train_seconds']} s; checkpoint {out}; "
          f"exact match {curve['exact_match']}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
