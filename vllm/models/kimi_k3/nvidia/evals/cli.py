"""`k3-decode eval`: the long-context evals on both decode paths, as a table and JSON evidence.

    k3-decode eval                                     # tiny checkpoint, all tasks, 1K..64K (64K: > 100 GiB)
    k3-decode eval --device cuda --out vllm/models/kimi_k3/nvidia/evidence/<card>/eval_tiny.json \\
                   --table vllm/models/kimi_k3/nvidia/evidence/<card>/eval_tiny_<card>.md   # h200, h100
    k3-decode eval --config mini --random-weights 0 --lengths 256 --samples 2   # wiring only

Exit status: 0 when every gate is met, 1 when one is not, 2 for a bad argument, a missing
or mismatched checkpoint, or lengths whose decode caches and prefill scores cannot fit this
machine's memory (all refused before any weights load). `add_parser` / `run` plug into
latency_specialized/cli.py; `main` runs it alone (`python -m vllm.models.kimi_k3.nvidia.evals.cli eval ...`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..latency_specialized.config import ConfigError, K3TextConfig
from ..latency_specialized.host_memory import size_words, usable_memory
from ..latency_specialized.tokenizer import ByteTokenizer
from . import tasks
from .tiny import TINY_DIR, config_named, shipped_weights


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"context lengths are token counts of at least 1, found {text!r}")
    return values


def _at_least(low: int, why: str = ""):
    """An argparse type: an integer >= `low`; the message says what was found and, with `why`, why."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, found {value}{why}")
        return value

    return parse


# --logit-samples 0 (or below) would teacher-force nothing, and the KL gate would still report
# 0 as measured and pass: refused, like any count that cannot be run
_LOGIT_SAMPLES_WHY = ("; with none the teacher-forced KL gate compares no step and still reports 0 as "
                      "measured. Pass 1 or more (the committed records use 1 or 2)")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in tasks.TASKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad or text!r}; choose from {', '.join(tasks.TASKS)}")
    return names


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="run the long-context evals on both decode paths",
                              description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="tiny (default), another preset, or a config.json path")
    p.add_argument("--weights", default=None,
                   help="safetensors file or folder (default for tiny: the shipped checkpoint); "
                        "not with --random-weights")
    p.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                   help="seeded random weights instead of a checkpoint (checks wiring, scores ~0); not with --weights")
    p.add_argument("--tasks", type=_names, default=tuple(tasks.TASKS), help="comma-separated: mrcr,kv,arith")
    p.add_argument("--lengths", type=_ints, default=tasks.LENGTHS,
                   help="context lengths in tokens; refused when the longest one's caches and prefill scores "
                        "cannot fit this machine's memory")
    p.add_argument("--samples", type=_at_least(1), default=16, help="samples per task and length (>= 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generators")
    p.add_argument("--batch", type=_at_least(1), default=4, help="requests per generate call (>= 1)")
    p.add_argument("--logit-samples", type=_at_least(1, _LOGIT_SAMPLES_WHY), default=4,
                   help="samples per task and length teacher-forced on both paths for the logit divergence (>= 1)")
    p.add_argument("--parity-runs", type=_at_least(0, "; 0 skips the sampling-parity runs"), default=8,
                   help="sampling-parity runs (0: skip)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--yardstick", action=argparse.BooleanOptionalAction, default=None,
                   help="also generate with the rounding-noise yardstick and judge greedy agreement against it "
                        "(default: when the specialized side runs the kernels)")
    p.add_argument("--out", default=None, help="write the JSON evidence record here")
    p.add_argument("--table", default=None, help="write the Markdown table here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def _shown(path: Path) -> str:
    """A path as records and tables show it: relative to the repository when inside it."""
    from ..latency_specialized.evidence import REPO_ROOT

    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


HEADROOM = 256  # tokens past the longest prompt the executor's state holds (answer and slack)


def state_bytes(cfg: K3TextConfig, requests: int, max_len: int) -> int:
    """Bytes of one single-rank `DecodeState` (one token per request in a step) for `requests`
    requests of `max_len` tokens: the state itself built on the meta device (its own slot rule,
    no memory), every pool of every layer summed (a pool added to a layer state counts too)."""
    from ..reference.state import DecodeState

    st = DecodeState(cfg, cfg.shard(1, 0), max_requests=requests, max_len=max_len, device="meta")
    layers = [*st.kda.values(), *st.mla.values()]
    return sum(t.numel() * t.element_size() for layer in layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor))


def footprint(cfg: K3TextConfig, prompt: int, max_len: int, batch: int, states: int,
              device: str = "cpu") -> dict[str, int]:
    """A lower bound on the memory an eval run holds at once, in bytes: `states` decode states of
    `batch` requests × `max_len` tokens, and the reference's naive MLA prefill of a `prompt`-token
    prompt: its [heads, prompt, prompt] scores three times at once (the scores, the causal mask
    applied, the softmax; fp64 on a CPU, fp32 on CUDA: `reference/ops.acc_dtype`) with the bool
    mask, and the fp32 logits of every prompt row. Weights and other activations not counted."""
    caches = states * state_bytes(cfg, batch, max_len)
    per_score = 3 * (8 if device == "cpu" else 4) + 1
    scores = cfg.shard(1, 0).mla_heads * prompt * prompt * per_score
    logits = prompt * cfg.vocab_size * 4
    return {"caches": caches, "scores": scores, "logits": logits, "total": caches + scores + logits}


def _memory_refusal(args: argparse.Namespace, cfg: K3TextConfig) -> str | None:
    """Why the longest --lengths cannot fit, or None: checked before any prompt is built or weight
    loaded, since both take minutes at absurd lengths and the caches then fail to allocate."""
    have = usable_memory(args.device)
    if have is None:
        return None
    prompt, longest = max(args.lengths), max(args.lengths) + HEADROOM
    # the executor's state and the yardstick's live for the whole run, beside one transient state
    # of a standard generate call or a teacher-forced run
    yardstick = args.yardstick or (args.yardstick is None and args.device == "cuda")
    states = 2 + bool(yardstick)
    need = footprint(cfg, prompt, longest, args.batch, states, args.device)
    if need["total"] <= have[0]:
        return None
    heads = cfg.shard(1, 0).mla_heads
    return (f"--lengths {prompt} with --batch {args.batch} needs at least {size_words(need['total'])} "
            f"on {args.device}, more than {have[1]} ({size_words(have[0])}): decode caches {size_words(need['caches'])} "
            f"({states} states of {args.batch} requests x {longest} tokens, config {cfg.name}), prefill "
            f"attention scores {size_words(need['scores'])} (3 {'fp64' if args.device == 'cpu' else 'fp32'} "
            f"[{heads}, {prompt}, {prompt}] tensors and a bool mask), "
            f"logits {size_words(need['logits'])}. Pass shorter --lengths (the scores grow with the square of "
            "the length)" + (", or a smaller --batch (the caches grow with it)"
                             if need["caches"] >= need["scores"] else ""))


def _source(args: argparse.Namespace, cfg: K3TextConfig):
    from ..latency_specialized.weights import RandomSource, SafetensorsSource

    if args.random_weights is not None:
        return RandomSource(cfg, seed=args.random_weights), f"random seed {args.random_weights}"
    if args.weights:
        return SafetensorsSource(args.weights), _shown(Path(args.weights))
    shipped = shipped_weights(args.config)
    if shipped:
        return SafetensorsSource(shipped), _shown(shipped)
    raise ConfigError(
        f"no weights for config {cfg.name}: pass --weights PATH, or --random-weights SEED to check "
        f"the wiring only (the tiny checkpoint is not in {TINY_DIR} yet: train it with "
        "python -m vllm.models.kimi_k3.nvidia.evals.train_tiny)")


def run(args: argparse.Namespace) -> int:
    from ..latency_specialized.engine import build_specialized
    from ..latency_specialized.weights import load_rank
    from ..reference.model import ReferenceModel
    from . import harness

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but no CUDA device is present; use --device cpu", file=sys.stderr)
        return 2
    if args.weights and args.random_weights is not None:
        print(f"error: --weights {args.weights} and --random-weights {args.random_weights} both given: "
              "--random-weights draws seeded random weights and would ignore the checkpoint; pass "
              "--weights to evaluate the checkpoint, or --random-weights alone to check the wiring",
              file=sys.stderr)
        return 2
    try:
        cfg = config_named(args.config)
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ConfigError(f"config {cfg.name} has vocab_size {cfg.vocab_size} < {ByteTokenizer.vocab_size} "
                              "needed by the byte tokenizer")
        source, weights = _source(args, cfg)  # opens the checkpoint's headers only
        too_big = _memory_refusal(args, cfg)
        if too_big:
            raise ConfigError(too_big)
        spec = harness.EvalSpec(tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
                                batch=args.batch, logit_samples=args.logit_samples)
        for length in spec.lengths:  # a too-short length fails here, before any weights load
            for task in spec.tasks:
                tasks.make(task, length, 0)
        # a checkpoint that does not match the config (WeightError, a ValueError) is a clean error too
        model = ReferenceModel(cfg, load_rank(source, cfg, device=args.device))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    longest = max(spec.lengths) + HEADROOM
    paths = harness.Paths(model, harness.default_deployment(longest))
    # the executor on the specialized side: its CuTe DSL kernels on a GPU, its plumbing with the
    # reference ops on a CPU; None (the standard path serves, the record says so) outside its envelope
    executor = build_specialized(model, paths.dispatchers["specialized"], spec.batch, longest, reference_on_cpu=True)
    if executor is not None:
        paths.specialized = paths.executor = executor
        if args.yardstick or (args.yardstick is None and executor.ops.impl == "cute"):
            from ..latency_specialized.executor import SpecializedDecode
            from ..latency_specialized.torch_ops import RoundingNoiseOps
            torch.manual_seed(args.seed)  # the yardstick's noise draws
            paths.use_yardstick(SpecializedDecode(model, max_requests=spec.batch, max_len=longest,
                                                  buckets=executor.buckets, ops=RoundingNoiseOps(), graphs=False,
                                                  log=lambda _: None))
    command = "k3-decode eval " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:])
    record = harness.evaluate(paths, spec, out=args.out, command=command, weights=weights,
                              parity_runs=args.parity_runs, progress=args.progress)
    text = harness.table(record)
    print(text)
    for r in record["results"]:  # logit samples whose standard output was one token force no step
        if r["name"].endswith("/parity") and not r["forced_steps"]:
            print(f"warning: {r['task']}@{r['length']}: no decode step was teacher-forced (each forced output "
                  "was one token), so its logit divergence and KL gate compared nothing; raise --logit-samples "
                  "or --samples", file=sys.stderr)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(f"# Long-context evals: {cfg.name} ({weights})\n\n{text}\n")
    unmet = [t["name"] for t in record["targets"] if not t["met"]]
    served = record["paths_served"]["specialized"]
    print(f"[k3-decode eval] specialized side served by: {served or 'nothing'}; "
          f"{len(record['targets']) - len(unmet)}/{len(record['targets'])} gates met"
          + (f"; unmet: {', '.join(unmet)}" if unmet else ""))
    return 1 if unmet else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3-decode")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(argv)
    try:  # as `k3-decode eval` does: a bad config or checkpoint is one line, not a traceback
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
